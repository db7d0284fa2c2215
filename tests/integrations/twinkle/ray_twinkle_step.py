"""One GRPO step of twinkle's TransformersModel, as twinkle's Ray recipes run it
(tests/integrations/twinkle/test_startup_hook_ray.py).

    python tests/integrations/twinkle/ray_twinkle_step.py OUT MODEL_DIR MODE [VALUE]

MODE ``ray``: twinkle's Ray mode with a real (local) Ray: a training model (``remote_group='model'``,
one ``forward_backward``) and a reference model (``remote_group='ref'``, one ``forward_only``) in Ray
workers. VALUE is put into the driver's environment only, after ``ray.init``: it can reach a worker
through twinkle's copy of the driver's environment alone (a plain Ray task started then does not see it).
No install() anywhere. MODE ``local`` / ``local-installed``: the same step in this process, twinkle-kit as
shipped / with ``install(**parse(VALUE))``. Writes OUT (torch.save): loss, log-probs and, for Ray, what
each worker reports of twinkle-mem.

What twinkle-kit 0.5.1's Ray mode needs on a CPU-only machine (none of it product code):
- ``ray.init(num_cpus=8)`` before ``twinkle.initialize``: twinkle's resource manager asks for several Ray
  CPUs per process, and with this machine's 2 it asserts "Not enough resources";
- ``MASTER_ADDR`` / ``MASTER_PORT`` in the driver before a model is built: accelerate's ``env://``
  rendezvous in the worker (twinkle copies them with the rest of the driver's environment);
- twinkle has no CPU platform (``get_local_device()`` says ``cuda:N``): pointed at ``cpu`` in each worker
  before its first step, as the in-process runs do with standins.megatron's ``cpu_platform``.
"""
import os
import socket
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))  # standins/
VAR = "TWINKLE_MEM_INSTALL"
LENGTHS, PROMPT, VOCAB = [24, 17], 6, 512  # the tiny Qwen3 that test saves: vocab 512
ADVANTAGES = [1.0, -0.5]


def samples():
    from standins.megatron import lm_samples
    return lm_samples(LENGTHS, VOCAB, prompt=PROMPT)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_cpu(actor=None):
    """In a worker (or this process): twinkle's GPU platform places on the CPU, one thread as Ray gives a worker."""
    from twinkle.utils import platforms
    platforms.GPU.get_local_device = staticmethod(lambda *args, **kwargs: "cpu")
    torch.set_num_threads(1)
    return os.getpid()


def report(actor=None):
    """What a process says of twinkle-mem: installed and with which options, and its pid."""
    import sys as _sys
    if "twinkle_mem" not in _sys.modules:
        return dict(pid=os.getpid(), settings=None, variable=os.environ.get(VAR))
    from twinkle_mem.integrations import twinkle as integration
    return dict(pid=os.getpid(), settings=integration.installed_settings(), variable=os.environ.get(VAR))


def step(model, ref):
    from twinkle.loss import GRPOLoss
    model.set_loss(GRPOLoss(entropy_coef=0.0))
    out = model.forward_backward(inputs=samples(), advantages=torch.tensor(ADVANTAGES), temperature=0.7)
    ref_out = ref.forward_only(inputs=samples(), temperature=0.7)
    return dict(loss=float(out["loss"]), logps=torch.as_tensor(out["logps"]).detach().cpu(),
                ref_logps=torch.as_tensor(ref_out["logps"]).detach().cpu())


def run_ray(model_dir, value):
    import ray
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True)
    try:
        os.environ[VAR] = value  # the driver only, after ray.init
        plain_task_sees = ray.get(ray.remote(lambda: os.environ.get(VAR)).remote())
        import twinkle
        from twinkle import DeviceGroup, DeviceMesh
        from twinkle.model.transformers import TransformersModel
        twinkle.initialize(mode="ray", nproc_per_node=1, ncpu_proc_per_node=2, lazy_collect=False,
                           groups=[DeviceGroup(name="model", ranks=1, device_type="CPU"),
                                   DeviceGroup(name="ref", ranks=1, device_type="CPU")])
        models = []
        for group in ("model", "ref"):  # each its own world of one: its own rendezvous port
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            models.append(TransformersModel(model_id=model_dir, remote_group=group, mixed_precision="no",
                                            device_mesh=DeviceMesh.from_sizes(dp_size=1)))
        model, ref = models
        workers = [m._actors[0] for m in (model, ref)]
        ray.get([w.__ray_call__.remote(on_cpu) for w in workers])
        result = step(model, ref)
        result["workers"] = ray.get([w.__ray_call__.remote(report) for w in workers])
        result["plain_task_sees"] = plain_task_sees
        result["driver_pid"] = os.getpid()
        return result
    finally:
        try:
            from twinkle.infra._ray.ray_helper import RayHelper
            RayHelper.teardown()
        except Exception:  # noqa: BLE001  (Ray itself is shut down next, whatever happened)
            pass
        ray.shutdown()


def run_local(model_dir, value, installed):
    import twinkle
    from twinkle.model.transformers import TransformersModel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    twinkle.initialize(mode="local", lazy_collect=False)
    if installed:
        from twinkle_mem.integrations import twinkle as integration
        from twinkle_mem.integrations.twinkle.startup import parse
        integration.install(**parse(value))
    on_cpu()
    model = TransformersModel(model_id=model_dir, mixed_precision="no")
    return step(model, model)


def main(out, model_dir, mode, value=""):
    if mode == "ray":
        result = run_ray(model_dir, value)
    else:
        assert VAR not in os.environ
        result = run_local(model_dir, value, installed=mode == "local-installed")
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
