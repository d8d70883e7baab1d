"""Helpers for the gloo multi-process test tier: spawn N CPU ranks, collect their results.

`run_ranks(fn, world_size, *args)` starts `world_size` processes (spawn), sets the torchrun
environment for each, runs `fn(rank, world_size, *args)` and returns the list of per-rank
return values (pickled through files). A failing rank fails the test with its traceback; a
hang is bounded by `timeout_s`.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, out_dir, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report, then re-raise so the process exits non-zero
        path.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise
    path.write_bytes(pickle.dumps(result))


def run_ranks(fn, world_size: int, *args, timeout_s: float = 240.0) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline_ok = _join(context, timeout_s)
        results = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if not path.exists():
                raise AssertionError(f"rank {rank} produced no result "
                                     f"({'timed out' if not deadline_ok else 'crashed'})")
            status, value = pickle.loads(path.read_bytes())
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


def _join(context, timeout_s: float) -> bool:
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if context.join(timeout=1.0):
                return True
        except mp.ProcessRaisedException:
            return True
        except mp.ProcessExitedException:
            return True
    for process in context.processes:
        process.kill()
    return False


def single_rank_groups():
    """The ParallelGroups of a world of one CPU process, without a process group (in-process
    tests: nothing collective runs at world size 1)."""
    from epoverlap.parallel.groups import (EXPERT_DATA_PARALLEL, EXPERT_PARALLEL, WORLD, Group,
                                           ParallelGroups)
    from epoverlap.parallel.watch import CollectiveWatch
    watch = CollectiveWatch(0, 1, 60.0, False, None)
    only = {name: Group(name, (0,), None, watch)
            for name in (WORLD, EXPERT_PARALLEL, EXPERT_DATA_PARALLEL)}
    return ParallelGroups(rank=0, world_size=1, local_rank=0, ep_size=1, ep_rank=0, edp_size=1,
                          edp_rank=0, device=torch.device("cpu"), backend="none", watch=watch,
                          world=only[WORLD], ep=only[EXPERT_PARALLEL],
                          edp=only[EXPERT_DATA_PARALLEL])


def one_process_model(cfg, backend: str, dtype, device, delay: bool = False,
                      one_node: bool = False):
    """(model, weight-grad queue, grad buffers) of `cfg` on one process, EP=1, for the
    executor-level tests that drive plans themselves."""
    from epoverlap.model.transformer import MoEModel
    from epoverlap.parallel.comm import ExpertComm
    from epoverlap.schedule.wgrad import WeightGradQueue
    from epoverlap.training.optimizer.grads import GradBuffers
    from epoverlap.kernels import make_moe_ops
    queue = WeightGradQueue(enabled=delay)
    model = MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                     ExpertComm(None, 1), 0, make_moe_ops(backend), dtype=dtype,
                     device=torch.device(device), wgrad_queue=queue, one_node_moe_layers=one_node)
    return model, queue, GradBuffers(model, single_rank_groups())
