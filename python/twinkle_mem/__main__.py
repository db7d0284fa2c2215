"""`python -m twinkle_mem`: version, torch, which backends are built and loaded, whether a GPU is visible; for
twinkle-kit, verl and ms-swift: the one found and what install() would patch there, whether install() ran in this
process, whether the start-up hook (twinkle's .pth, verl's entry point, ms-swift's plugin file) is in place, and what
the variable (TWINKLE_MEM_INSTALL, TWINKLE_MEM_VERL, TWINKLE_MEM_SWIFT), as set now, would do. Exit status 2 when a
variable is invalid."""
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
    from twinkle_mem.integrations import verl as verl_integration
    from twinkle_mem.integrations.twinkle import startup
    from twinkle_mem.integrations.verl import startup as verl_startup
    value = os.environ.get(startup.ENV_VAR)
    _framework("twinkle-kit", integration, startup.VARIABLE, value, {"fused_lm_head": True})
    print(f"start-up hook: {startup.hook_status()}")
    print(f"  {startup.describe(value)}")
    verl_value = os.environ.get(verl_startup.ENV_VAR)
    _framework("verl", verl_integration, verl_startup.VARIABLE, verl_value, {"logits_path": True})
    print(f"verl.plugins entry point: {verl_startup.entry_point_status()}")
    print(f"  {verl_startup.VARIABLE.describe(verl_value)}")
    from twinkle_mem.integrations import swift as swift_integration
    from twinkle_mem.integrations.swift import startup as swift_startup
    swift_value = os.environ.get(swift_startup.ENV_VAR)
    _framework("ms-swift", swift_integration, swift_startup.PLUGIN_VARIABLE, swift_value, {})
    print(f"ms-swift plugin: --external_plugins {swift_integration.PLUGIN}")
    print(f"  {swift_startup.describe(swift_value)}")
    bad = False
    for variable, text in ((startup.VARIABLE, value), (verl_startup.VARIABLE, verl_value),
                           (swift_startup.VARIABLE, swift_value)):
        try:
            variable.parse(text)
        except ValueError:
            bad = True
    return 2 if bad else 0  # a job script can check the variables before it starts anything


def _framework(name, integration, variable, value, every_part) -> None:
    """The framework this process would import, what install() would patch there (as the variable asks; unset or
    off: ``every_part``), and whether install() ran here."""
    try:
        options = variable.parse(value)
    except ValueError:
        options = None
    shown = every_part if options is None else options
    try:
        found, *parts = integration.describe(**shown)
    except ImportError as error:
        print(f"{name}: {error}")
    else:
        print(f"{found}; {variable.install_call(shown)} patches there (each part recognized by {name}'s code):")
        for line in parts:
            print(f"  {line}")
    print(f"install() into {name} in this process: {'yes' if integration.is_installed() else 'no'} "
          f"({integration.__name__}.is_installed() tells, in any process)")



if __name__ == "__main__":
    sys.exit(main())
