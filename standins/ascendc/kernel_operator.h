// The kernel's `#include "kernel_operator.h"` resolves here when it is built
// against the project's stand-in of the AscendC API (see ascendc_standin.h).
#pragma once
#include "ascendc_standin.h"
