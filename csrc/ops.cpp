// The op contract: one set of schemas (their text and the contract's comments
// are in python/twinkle_mem/schemas.def, shipped with the package so that Python
// can define them when no native library loads), implemented per dispatch key by
// csrc/cpu, csrc/cuda and csrc/npu (and by the composite fallback in Python),
// each registering csrc/common/op_entry.h's entry points, which turn the
// schema's arguments into one OpOptions (op_options.h) for the kernels.
// The math is csrc/common/online_softmax.h, the indexing csrc/common/layout.h.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(twinkle_mem, m) {
#include "../python/twinkle_mem/schemas.def"
}
