"""Distributed setup: the process groups, built once, in one place, and passed down.

Owns `RankLayout` (which rank holds which pipeline stage, expert shard and data shard: pure
arithmetic), `ParallelGroups` and `init_distributed` / `destroy_distributed`.

Layout: world = pipeline-parallel (PP) x data-parallel (DP), and DP = expert-parallel (EP) x
expert-data-parallel (EDP), in Megatron-core's default order `tp-cp-ep-dp-pp` (tp = cp = 1
here; the first name varies fastest):

    rank = ep_rank + EP x edp_rank + EP x EDP x pp_rank,   dp_rank = ep_rank + EP x edp_rank

so a pipeline stage is a block of DP = world / PP consecutive ranks, the EP groups are blocks of
EP consecutive ranks inside it, and a pipeline (the ranks that pass activations to each other)
is the ranks with the same dp_rank, one per stage. Dense parameters of a stage are replicated
over its DP group (grads averaged there); experts are sharded over the EP group and replicated
over the EDP group (the ranks of the stage with the same ep_rank). Without pipeline parallelism
the stage is the world.

Backend: NCCL with one GPU per local rank when the run is on CUDA, gloo on CPU. Without torchrun
(no RANK/WORLD_SIZE in the environment) a single-process group is created on a free port.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankLayout:
    """Megatron-core's rank order for a world of `world_size` = PP x EP x EDP (module doc)."""

    world_size: int
    pp_size: int = 1
    ep_size: int = 1

    @property
    def dp_size(self) -> int:
        return self.world_size // self.pp_size

    @property
    def edp_size(self) -> int:
        return self.dp_size // self.ep_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.dp_size

    def dp_rank(self, rank: int) -> int:
        return rank % self.dp_size

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep_size

    def edp_rank(self, rank: int) -> int:
        return self.dp_rank(rank) // self.ep_size

    def pp_groups(self) -> list[list[int]]:
        """One pipeline per dp_rank: its ranks in stage order."""
        return [list(range(d, self.world_size, self.dp_size)) for d in range(self.dp_size)]

    def dp_groups(self) -> list[list[int]]:
        """One data-parallel group per stage (dense grads are averaged there)."""
        return [list(range(p * self.dp_size, (p + 1) * self.dp_size))
                for p in range(self.pp_size)]

    def ep_groups(self) -> list[list[int]]:
        return [list(range(b * self.ep_size, (b + 1) * self.ep_size))
                for b in range(self.world_size // self.ep_size)]

    def edp_groups(self) -> list[list[int]]:
        """Per stage and ep_rank: the replicas of one expert shard."""
        return [list(range(p * self.dp_size + e, (p + 1) * self.dp_size, self.ep_size))
                for p in range(self.pp_size) for e in range(self.ep_size)]


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
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Optional[dist.ProcessGroup] = None
    pp_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's pipeline, by stage
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: Optional[dist.ProcessGroup] = None  # None with one stage: the world

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


def init_distributed(ep_size: int, device_kind: str, timeout_minutes: float = 10.0,
                     pp_size: int = 1) -> ParallelGroups:
    """Initialize torch.distributed and build the PP, DP, EP and EDP groups."""
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
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    layout = RankLayout(world_size, pp_size, ep_size)
    ep_group = _new_groups(world_size, layout.ep_groups(), rank)
    edp_group = _new_groups(world_size, layout.edp_groups(), rank)
    pp_group = _new_groups(world_size, layout.pp_groups(), rank) if pp_size > 1 else None
    dp_group = _new_groups(world_size, layout.dp_groups(), rank) if pp_size > 1 else None
    return ParallelGroups(rank=rank, world_size=world_size, local_rank=local_rank,
                          ep_size=ep_size, ep_rank=layout.ep_rank(rank),
                          edp_size=layout.edp_size, edp_rank=layout.edp_rank(rank),
                          device=device, backend=backend, ep_group=ep_group,
                          edp_group=edp_group, pp_size=pp_size, pp_rank=layout.pp_rank(rank),
                          pp_group=pp_group,
                          pp_ranks=tuple(layout.pp_groups()[layout.dp_rank(rank)]),
                          dp_size=layout.dp_size, dp_rank=layout.dp_rank(rank),
                          dp_group=dp_group)


def destroy_distributed() -> None:
    """Tear down (release every CUDA graph before this: see environment.md)."""
    if dist.is_initialized():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.destroy_process_group()
