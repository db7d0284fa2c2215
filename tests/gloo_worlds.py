"""gloo worlds of CPU processes that run a test module's registered cases.

A module registers cases with ``cases = Cases(__name__, timeout_s[, setup])``
and ``@cases.register()`` (``@cases.register(2)`` for one world size), then has
one pytest item per (world, case) check ``cases.failures(world, name)``. ``setup``: a context manager
factory the workers enter around all cases (process-wide patches a module needs,
e.g. megatron-core on the CPU). Each world is started once
(torch.multiprocessing, spawn), imports the module by name and runs every case in
turn; each case does its collectives first and asserts after, so a failing rank
cannot leave the others waiting. Per-rank tracebacks come back to the parent. A
world that does not finish within its timeout is killed and its items fail.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


class Cases:
    def __init__(self, module_name: str, timeout_s: float, setup=contextlib.nullcontext):
        self.module_name = module_name
        self.timeout_s = timeout_s
        self.setup = setup
        self.cases = {}  # name -> (fn, world sizes)
        self._worlds = {}

    def register(self, *worlds):
        def add(fn):
            self.cases[fn.__name__] = (fn, worlds or (2, 4))
            return fn
        return add

    def params(self):
        """(world, name) pairs for pytest.mark.parametrize."""
        return [(w, n) for n, (_fn, ws) in self.cases.items() for w in ws]

    def failures(self, world: int, name: str) -> list[str]:
        if world not in self._worlds:
            try:
                self._worlds[world] = _run_world(self.module_name, world, self.timeout_s)
            except Exception as e:  # noqa: BLE001  (every item of this world reports it)
                self._worlds[world] = e
        per_rank = self._worlds[world]
        if isinstance(per_rank, Exception):
            raise per_rank
        return [f"rank {r}:\n{res[name]}" for r, res in enumerate(per_rank) if res.get(name, "missing")]


def _worker(rank, world, init_file, out_dir, module_name):
    torch.set_num_threads(1)
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cases = importlib.import_module(module_name).cases
    results = {}
    try:
        with cases.setup():
            for name, (fn, worlds) in cases.cases.items():
                if world not in worlds:
                    continue
                try:
                    fn(rank, world)
                    results[name] = None
                except Exception:  # noqa: BLE001  (reported to the parent, per case)
                    results[name] = traceback.format_exc()
                dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _run_world(module_name, world, timeout_s):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, module_name), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gloo world of {world} did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        per_rank = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return per_rank
