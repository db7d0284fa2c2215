"""`python -m twinkle_mem`: version, torch, which backends are built and loaded, whether a GPU is visible; for
each framework (twinkle-kit, verl: ``integrations.FRAMEWORKS``) what its declaration reports
(``core/framework.py``'s ``Framework.report``): the one found, whether install() ran in this process, whether the
start-up hook (twinkle's .pth, verl's entry point) is in place, what the variable (TWINKLE_MEM_INSTALL,
TWINKLE_MEM_VERL), as set now, would do, and part by part what install() would patch there (recognized, or refused
and why) and what is patched in this process; verl's engines, each part by part. Exit status 2 when a variable is
invalid."""
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
    from twinkle_mem.integrations import declarations
    bad = False
    for framework in declarations():
        value = os.environ.get(framework.variable.name)
        print("\n".join(framework.report(value)))
        try:
            framework.variable.parse(value)
        except ValueError:
            bad = True
    return 2 if bad else 0  # a job script can check the variables before it starts anything


if __name__ == "__main__":
    sys.exit(main())
