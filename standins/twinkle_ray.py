"""twinkle's Ray mode with ``MegatronModel`` workers on a CPU-only machine, as twinkle's recipes run it
(``twinkle.initialize(mode='ray')``, ``remote_group=...``): for tests/integrations/twinkle/ray_megatron_recipes.py and
bench/bench_recipe.py.

What twinkle-kit 0.5.1's Ray mode needs here (none of it product code; the first three as in
tests/integrations/twinkle/ray_twinkle_step.py):

- ``ray.init(num_cpus=...)`` before ``twinkle.initialize``: twinkle's resource manager asks for 4 Ray CPUs per
  CPU process per node (``node_cpu // 4 >= ncpu_proc_per_node``) and a 2-core machine has 2;
- ``MASTER_ADDR`` / ``MASTER_PORT`` in the driver before each model is built: twinkle's CPU branch of
  ``RayHelper.create_workers`` sets no rendezvous (its GPU branch does) and copies the driver's environment (the
  port: :func:`free_port`);
- twinkle has no CPU platform: its ``Platform`` places on the CPU (``standins.megatron.cpu_platform``) and
  ``GPU.device_backend()`` (``'nccl'``, which ``_try_init_process_group`` asks) answers ``'gloo'``;
- the stand-ins of ``standins.megatron_lora.training_on_cpu()`` (1-9, 13-17) and 12 (packed batches), applied
  in each model worker at its start, before twinkle builds a model there: Ray's ``worker_process_setup_hook``
  (given to ``ray.init``; actors inherit it) runs :func:`setup_worker`, which enters them for the process's
  lifetime in processes that twinkle started as model workers (``WORKER_NAME`` set) and does nothing in others.
  Each worker computes with one thread (two workers share the 2 cores).
"""
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
_WORKER = contextlib.ExitStack()


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (32768-60999) and above Ray's worker ports (10002-19999):
    the workers bind it seconds later, and a port the kernel hands out meanwhile (to another process's connection,
    or another test's ``bind(0)``) would be taken by then."""
    import random
    for _ in range(100):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


@contextlib.contextmanager
def gloo_backend():
    """twinkle's GPU platform answering ``device_backend() == 'gloo'``: the process group of a CPU worker."""
    from twinkle.utils.platforms.gpu import GPU
    real = vars(GPU)["device_backend"]
    GPU.device_backend = staticmethod(lambda platform=None: "gloo")
    try:
        yield
    finally:
        GPU.device_backend = real


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: in a twinkle model worker, the CPU stand-ins for its lifetime."""
    if not os.environ.get("WORKER_NAME") or os.environ.get("TWINKLE_MODE") != "ray":
        return
    import torch

    from . import mcore_bridge, megatron_lora
    torch.set_num_threads(1)
    _WORKER.enter_context(megatron_lora.training_on_cpu(fp32_params=True))
    _WORKER.enter_context(mcore_bridge.packed_attention_on_cpu())
    _WORKER.enter_context(gloo_backend())


@contextlib.contextmanager
def ray_session(num_cpus: int = 16):
    """A local Ray whose workers can import standins and run :func:`setup_worker`, and twinkle's Ray mode with
    the CPU groups ``'model'`` (2 processes) and ``'solo'`` (1); Ray and twinkle's registry are shut down on exit, whatever
    happened. Its temporary directory is its own (another Ray on this machine keeps its own), removed on exit (Ray
    leaves its session's logs and sockets there)."""
    import ray
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, _temp_dir=temp_dir,
                 runtime_env={"worker_process_setup_hook": "standins.twinkle_ray.setup_worker"})
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    try:
        import twinkle
        from twinkle import DeviceGroup
        twinkle.initialize(mode="ray", nproc_per_node=1, ncpu_proc_per_node=3, lazy_collect=False,
                           groups=[DeviceGroup(name="model", ranks=2, device_type="CPU"),
                                   DeviceGroup(name="solo", ranks=1, device_type="CPU")])
        yield
    finally:
        try:
            from twinkle.infra._ray.ray_helper import RayHelper
            RayHelper.teardown()
        except Exception:  # noqa: BLE001  (Ray itself is shut down next, whatever happened)
            pass
        try:
            ray.shutdown()
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)


def new_rendezvous() -> None:
    """A fresh ``MASTER_PORT`` for the next model's workers (twinkle copies the driver's environment)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def on_workers(model, fn, *args):
    """``fn(actor, *args)`` in each of ``model``'s Ray workers (``__ray_call__``); their results, by rank."""
    import ray
    return ray.get([actor.__ray_call__.remote(fn, *args) for actor in model._actors])


def release(model) -> None:
    """End ``model``'s workers (their processes and memory) once a recipe is done with it."""
    import ray
    for actor in getattr(model, "_actors", []):
        ray.kill(actor)


def run_driver(cmd, env, timeout, stderr=subprocess.STDOUT):
    """Run a Ray driver ``cmd`` in a process group of its own and end the group when it returns or fails (Ray's
    GCS, raylet and workers are in it: none outlives the driver); returns (exit status, its stdout)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.communicate()
    return proc.returncode, output
