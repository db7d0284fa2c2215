"""Shared test setup: the device list, the seed, twinkle-mem's twinkle integration uninstalled
around every test that asks for it (``uninstalled``; the integration modules use it autouse), and a
count of the fused op's calls (``fused_calls``). Shared helpers: tests/helpers.py.

TWINKLE_MEM_TEST_DEVICES=cpu,cuda (or cpu,npu) runs every device-parametrized
test on each listed device; the default is the CPU alone.
"""
import functools
import importlib.util
import os
import sys

# A developer's exported TWINKLE_MEM_INSTALL would install twinkle-mem into this process the moment twinkle is
# imported, and the comparisons with twinkle-kit as shipped would compare twinkle-mem with itself. The tests of
# the variable set it in the fresh interpreters they start.
os.environ.pop("TWINKLE_MEM_INSTALL", None)
os.environ.pop("TWINKLE_MEM_SWIFT", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI (CI=true) replays the same examples every run, so that a submission's result does not depend on
# the draw; a developer's run draws new ones (a failure found there is printed with its seed).
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

DEVICES = [d.strip() for d in os.environ.get("TWINKLE_MEM_TEST_DEVICES", "cpu").split(",") if d.strip()]

# tests/integrations/verl/ needs verl, whose pins (transformers < 5.11) conflict with the test extras: .ci/run runs
# it in a venv of its own (`pip install ".[verl,test-verl]"`, TWINKLE_MEM_VERL_TIER=1). Elsewhere it is not collected,
# and the run's header says so; in that tier a missing verl is an error, not a skip.
VERL_FOUND = importlib.util.find_spec("verl") is not None
if os.environ.get("TWINKLE_MEM_VERL_TIER") and not VERL_FOUND:
    raise RuntimeError("TWINKLE_MEM_VERL_TIER is set but verl is not installed: pip install '.[verl,test-verl]'")
collect_ignore = [] if VERL_FOUND else ["integrations/verl"]
# tests/integrations/swift/ likewise needs ms-swift (trl < 1.0, transformers 5.19): its own venv and tier
# (`pip install ".[ms-swift,test-swift]"`, TWINKLE_MEM_SWIFT_TIER=1).
SWIFT_FOUND = importlib.util.find_spec("swift") is not None and importlib.util.find_spec("swift.rlhf_trainers") is not None
if os.environ.get("TWINKLE_MEM_SWIFT_TIER") and not SWIFT_FOUND:
    raise RuntimeError("TWINKLE_MEM_SWIFT_TIER is set but ms-swift is not installed: pip install '.[ms-swift,test-swift]'")
if not SWIFT_FOUND:
    collect_ignore.append("integrations/swift")


def pytest_report_header(config):
    missing = [(name, folder) for name, folder, found in (("verl", "verl", VERL_FOUND),
                                                          ("ms-swift", "swift", SWIFT_FOUND)) if not found]
    return [f"tests/integrations/{folder}: not collected ({name} is not installed here; .ci/run runs them in a venv "
            "of their own)" for name, folder in missing] or None


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cuda_context_survives():
    """A device-side assert leaves this process's CUDA context unusable: every later test would error. Under
    pytest-xdist (bench/gpu_check.sh) the worker exits instead; xdist reports the test as crashed and carries on
    in a fresh worker."""
    yield
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:  # torch.AcceleratorError derives from it
        if os.environ.get("PYTEST_XDIST_WORKER"):
            print(f"\n{os.environ['PYTEST_XDIST_WORKER']}: the CUDA context is broken after this test, the worker "
                  f"ends: {e}", file=sys.__stderr__, flush=True)
            os._exit(3)
        raise


@pytest.fixture(autouse=True)
def _head_plans_restored():
    """A test that changes the fused head's device plans (tests/helpers.blocks, monkeypatch) must undo it: a later
    test would run another plan and fail far from the cause. The test that leaves them changed fails, and they are
    put back."""
    plans = sys.modules.get("twinkle_mem.heads.plans")
    before = dict(plans.PLANS) if plans else None
    forced = os.environ.get("TWINKLE_MEM_HEAD_PLAN")
    yield
    plans = sys.modules.get("twinkle_mem.heads.plans")
    left = os.environ.get("TWINKLE_MEM_HEAD_PLAN") != forced
    if forced is None:
        os.environ.pop("TWINKLE_MEM_HEAD_PLAN", None)
    else:
        os.environ["TWINKLE_MEM_HEAD_PLAN"] = forced
    if plans is not None and before is not None and plans.PLANS != before:
        changed = {k: v for k, v in plans.PLANS.items() if before.get(k) != v}
        plans.PLANS.clear()
        plans.PLANS.update(before)
        pytest.fail(f"this test left the head plans changed: {changed}")
    if left:
        pytest.fail("this test left TWINKLE_MEM_HEAD_PLAN changed")


@pytest.fixture
def uninstalled():
    """twinkle_mem.integrations.twinkle not installed before the test, and undone after it."""
    from twinkle_mem.integrations import twinkle as integration
    integration.uninstall()
    yield
    integration.uninstall()


@pytest.fixture(scope="module")
def gpt_step_cpu():
    """For a module of twinkle Megatron steps in this process: standins.megatron's gpt_step_on_cpu around it."""
    from standins.megatron import gpt_step_on_cpu
    with gpt_step_on_cpu():
        yield


@pytest.fixture
def fused_calls(monkeypatch):
    """How often the fused op ran (the deferred heads call it through twinkle_mem)."""
    import twinkle_mem

    calls = []
    real = twinkle_mem.linear_selective_log_softmax

    @functools.wraps(real)
    def counting(*args, **kwargs):
        calls.append((tuple(args[0].shape), args[0].dtype))
        return real(*args, **kwargs)

    monkeypatch.setattr(twinkle_mem, "linear_selective_log_softmax", counting)
    return calls
