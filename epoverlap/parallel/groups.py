"""Distributed setup: the process groups, built once, in one place, and passed down.

Owns `ParallelGroups` and `init_distributed` / `destroy_distributed`.

Layout: world = data-parallel x expert-parallel. Every rank is a data-parallel rank for dense
parameters (replicated, grads averaged over the world). Expert parallel groups are blocks of
`ep` consecutive ranks (rank r has ep_rank = r % ep); experts are sharded over the EP group and
replicated over the expert-data-parallel (EDP) group, the ranks with the same ep_rank.

Backend: NCCL with one GPU per local rank when the run is on CUDA, gloo on CPU. Without torchrun
(no RANK/WORLD_SIZE in the environment) a single-process group is created on a free port.

Restarts (torchrun --max-restarts): torchrun's agent keeps one TCP store for every attempt and
hands it to the workers without a per-attempt prefix (torch 2.13; pytorch issue #135712), so a
restarted worker can read a dead peer's address and fail to connect. On one node every worker
of an attempt has the same TORCHELASTIC_RESTART_COUNT, so the store is prefixed by it here; over
several nodes the counts may differ: there, give torchrun TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class ParallelGroups:
    rank: int
    world_size: int
    local_rank: int
    ep_size: int
    ep_rank: int
    edp_size: int
    edp_rank: int
    device: torch.device
    backend: str
    ep_group: Optional[dist.ProcessGroup]
    edp_group: Optional[dist.ProcessGroup]

    @property
    def world_group(self) -> Optional[dist.ProcessGroup]:
        return None  # the default group

    def is_first(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_env() -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))


def _new_groups(world_size: int, ranks_of: list[list[int]], my_rank: int):
    """Create every group of the partition (all ranks must call); return the one holding me."""
    mine = None
    for ranks in ranks_of:
        group = dist.new_group(ranks)
        if my_rank in ranks:
            mine = group
    return mine


def _store_per_attempt(world_size: int, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """torchrun's shared store, prefixed by the restart count, on one node (module docstring)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"epoverlap/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            store)


def init_distributed(ep_size: int, device_kind: str, timeout_minutes: float = 10.0
                     ) -> ParallelGroups:
    """Initialize torch.distributed and build the EP and EDP groups."""
    _ensure_env()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} "
                               f"CUDA devices are visible: start at most one rank per GPU")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    store = _store_per_attempt(world_size, timeout)
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return expert_parallel_groups(ep_size, device, local_rank)


def expert_parallel_groups(ep_size: int, device: torch.device, local_rank: int = 0
                           ) -> ParallelGroups:
    """The EP and EDP groups of `ep_size` over the initialized world (every rank must call).
    Called again with another size in the same world, it gives a second, independent layout
    (tests resume one run's checkpoint at another EP size in one process group)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    edp_size = world_size // ep_size
    ep_blocks = [list(range(b * ep_size, (b + 1) * ep_size)) for b in range(edp_size)]
    edp_strides = [list(range(e, world_size, ep_size)) for e in range(ep_size)]
    ep_group = _new_groups(world_size, ep_blocks, rank)
    edp_group = _new_groups(world_size, edp_strides, rank)
    return ParallelGroups(rank=rank, world_size=world_size, local_rank=local_rank,
                          ep_size=ep_size, ep_rank=rank % ep_size, edp_size=edp_size,
                          edp_rank=rank // ep_size, device=device, backend=backend,
                          ep_group=ep_group, edp_group=edp_group)


def destroy_distributed() -> None:
    """Tear down (release every CUDA graph before this: see environment.md)."""
    if dist.is_initialized():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.destroy_process_group()
