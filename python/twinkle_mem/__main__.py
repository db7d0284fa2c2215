"""`python -m twinkle_mem`: version, torch, which backends are built and loaded, whether a GPU is visible,
the twinkle-kit found and what install() would patch there, whether install() ran in this process, and
whether the start-up hook is installed and what TWINKLE_MEM_INSTALL, as set now, would do."""
import os
import platform
import sys

import torch

import twinkle_mem


def _cpu_path() -> str:
    """The CPU kernel path in use, and why: the widest this CPU has, or TWINKLE_MEM_CPU_ISA's cap."""
    from twinkle_mem.op import native
    widest = native.cpu_kernel_path("")
    if widest is None:
        return "unknown (this library does not say)"
    cap = os.environ.get(native.CPU_ISA_ENV)
    if not cap:
        return f"{widest} (the widest this CPU has)"
    try:
        return f"{native.cpu_kernel_path()} ({native.CPU_ISA_ENV}={cap}; this CPU has {widest})"
    except ValueError as e:
        return f"none: {e}"


def _gpus() -> str:
    # Apart from the library: a CUDA build of torch loads _C_cuda on a machine without a GPU.
    n = torch.cuda.device_count()
    return f"{n} visible ({torch.cuda.get_device_name(0)})" if n else "none visible"


def main() -> int:
    print(f"twinkle-mem {twinkle_mem.__version__}")
    print(f"torch {torch.__version__} (cuda {torch.version.cuda}), python {platform.python_version()}")
    for backend, state in twinkle_mem.backends().items():
        loaded = state == "loaded"
        extra = f" [cpu kernel path: {_cpu_path()}, {torch.get_num_threads()} threads]" if backend == "cpu" and loaded else ""
        if backend == "cuda":
            state, extra = f"library {state}", f"; GPU: {_gpus()}"
        print(f"  {backend:5s} {state}{extra}")
    from twinkle_mem.integrations import twinkle as integration
    from twinkle_mem.integrations.twinkle import startup
    value = os.environ.get(startup.ENV_VAR)
    try:
        options = startup.parse(value)
    except ValueError:
        options = None
    try:
        shown = options if options is not None else {"fused_lm_head": True}  # (unset: every part)
        found, *parts = integration.describe(**shown)
    except ImportError as error:
        print(f"twinkle-kit: {error}")
    else:
        asked = startup.install_call(shown)
        print(f"{found}; {asked} patches there (each part recognized by twinkle's code):")
        for line in parts:
            print(f"  {line}")
    print(f"install() in this process: {'yes' if integration.is_installed() else 'no'} "
          "(twinkle_mem.integrations.twinkle.is_installed() tells, in any process)")
    print(f"start-up hook: {startup.hook_status()}")
    print(f"  {startup.describe(value)}")
    try:
        startup.parse(value)
    except ValueError:
        return 2  # a job script can check the variable before it starts anything
    return 0


if __name__ == "__main__":
    sys.exit(main())
