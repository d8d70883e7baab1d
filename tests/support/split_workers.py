"""Rank functions of tests/test_split_exchange.py (spawned by dist_helpers.run_ranks): the
dropless dispatch's split-size exchange, started early on its own communicator, beside an
all-to-all of the EP communicator that one rank joins late."""

from __future__ import annotations

import threading
import time

import torch

LOCAL_EXPERTS = 2


def counts_of(rank: int, world: int) -> list[int]:
    """Rank r routes 100 r + e rows to expert e (distinct per rank and expert)."""
    return [100 * rank + e for e in range(world * LOCAL_EXPERTS)]


def _start_on_the_comm_lane(comm, tensor, device):
    """Issue an EP all-to-all the way the executor's comm lane does (a second stream on CUDA,
    a worker thread on CPU); return a `done()` probe."""
    if device.type == "cuda":
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            comm.all_to_all(tensor, None, None)
            done = torch.cuda.Event()
            done.record(stream)
        return done.query, lambda: done.synchronize()
    thread = threading.Thread(target=comm.all_to_all, args=(tensor, None, None))
    thread.start()
    return (lambda: not thread.is_alive()), thread.join


def exchange_beside_a_late_all_to_all(rank: int, world: int, device_kind: str,
                                      late_s: float) -> dict:
    """Rank 0 issues an EP all-to-all first; every other rank joins it `late_s` seconds after
    it has read its own split sizes. Rank 0 then starts and reads the split exchange: with its
    own communicator it completes while the all-to-all still waits for the late ranks."""
    from epoverlap.parallel.comm import ExpertComm
    from epoverlap.parallel.groups import destroy_distributed, init_distributed

    groups = init_distributed(world, device_kind, timeout_minutes=2)
    device = groups.device
    comm = ExpertComm(groups.ep, world, counts_group=groups.ep_splits)
    counts_E = torch.tensor(counts_of(rank, world), dtype=torch.int64, device=device)
    payload = torch.full((world * 4,), float(rank), device=device)
    comm.all_to_all(payload, None, None)  # both communicators up before anything is timed
    comm.start_split_exchange(counts_E).read()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    groups.world.barrier()

    if rank == 0:
        a2a_done, a2a_wait = _start_on_the_comm_lane(comm, payload, device)
    start = time.monotonic()
    exchange = comm.start_split_exchange(counts_E)
    sizes = exchange.read()
    read_s = time.monotonic() - start
    recv_RL = exchange.recv_RL.cpu().tolist()
    if rank == 0:
        finished_before_read = a2a_done()
    else:
        time.sleep(late_s)
        a2a_done, a2a_wait = _start_on_the_comm_lane(comm, payload, device)
        finished_before_read = None
    a2a_wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    destroy_distributed(groups)
    return {"sizes": sizes, "recv_RL": recv_RL, "read_s": read_s,
            "a2a_finished_before_read": finished_before_read}
