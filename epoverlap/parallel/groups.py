"""Distributed setup: the process groups, built once, in one place, and passed down.

Owns `RankLayout` (which rank holds which pipeline stage, expert shard and data shard: pure
arithmetic), `Group` (a process group with its name and ranks, whose collectives go through the
run's `CollectiveWatch`), `ParallelGroups` and `init_distributed` / `destroy_distributed`.

Layout: world = pipeline-parallel (PP) x context-parallel (CP) x data-parallel (DP), in
Megatron-core's default order `tp-cp-ep-dp-pp` (tp = 1 here; the first name varies fastest):

    rank = cp_rank + CP x dp_rank + CP x DP x pp_rank

so a pipeline stage is a block of CP x DP = world / PP consecutive ranks, a CP group (the ranks
that hold the parts of one sequence, `model.context`) is a block of CP consecutive ranks inside
it (under dynamic CP also cut into blocks of each smaller size: `context_groups`), and a
pipeline (the ranks that pass activations to each other) is the ranks with the same
place in their stage, one per stage. Dense parameters of a stage are replicated over all its
ranks, CP x DP (Megatron-core's data-parallel group with CP; grads averaged there: `dp`). The
MoE layers see a stage's ranks as Megatron-core's expert generator does (cp = 1 there), with no
regard to CP: CP x DP = EP x EDP,

    rank = ep_rank + EP x edp_rank + EP x EDP x pp_rank

the EP groups blocks of EP consecutive ranks, the experts sharded over the EP group and
replicated over the EDP group (the ranks of the stage with the same ep_rank). Without pipeline
parallelism the stage is the world; without CP, DP is the stage.

Backend: NCCL with one GPU per local rank when the run is on CUDA, gloo on CPU. Without torchrun
(no RANK/WORLD_SIZE in the environment) a single-process group is created on a free port.

Restarts (torchrun --max-restarts): torchrun's agent keeps one TCP store for every attempt and
hands it to the workers without a per-attempt prefix (torch 2.13; pytorch issue #135712), so a
restarted worker can read a dead peer's address and fail to connect. On one node every worker
of an attempt has the same TORCHELASTIC_RESTART_COUNT, so the store is prefixed by it here; over
several nodes the counts may differ: there, give torchrun TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.

CTA budget of the expert-parallel communicator (`NcclCtaBudget`, from
`--moe-a2a-nccl-max-ctas` / `--moe-a2a-nccl-min-ctas`): on NCCL the EP groups are created with
`ProcessGroupNCCL.Options` whose `config` (NCCL's ncclConfig_t) carries max_ctas / min_ctas, so
only the all-to-alls get the budget (the environment's NCCL_MAX_CTAS would bind every group).
Since torch 2.8 a collective issued with async_op=False (ours) runs on the caller's stream, so
the comm stream's priority applies to these kernels too. A budget on gloo is refused
(`build_ep_options`); config validation refuses it earlier, naming the flag.

Timeouts: every group (world, expert-parallel, expert-data-parallel) gets the configured
collective timeout (`--distributed-timeout-minutes`); a group created without one would wait
torch's default (30 minutes on gloo). Each group carries a `group_desc` (its name), so NCCL's
own watchdog messages name it too. Liveness (a dead or stalled peer named in one line) is
`watch.py`'s.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from epoverlap.parallel.watch import CollectiveWatch, Heartbeat

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; the GPU
# machines run torch 2.11, which has only the old name.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

WORLD, EXPERT_PARALLEL, EXPERT_DATA_PARALLEL = "world", "expert-parallel", "expert-data-parallel"
PIPELINE, DATA_PARALLEL = "pipeline", "data-parallel"
CONTEXT_PARALLEL = "context-parallel"
CONTEXT_PARALLEL_EXCHANGE = "context-parallel K/V gather"  # same ranks as CP, own communicator
EXPERT_PARALLEL_SPLITS = "expert-parallel split sizes"  # same ranks as EP, own communicator
EXPERT_PARALLEL_RAIL = "expert-parallel between hosts"  # --moe-dispatch-hierarchy node
EXPERT_PARALLEL_HOST = "expert-parallel inside a host"


def blocking_all_to_all(pg: dist.ProcessGroup) -> Callable[..., None]:
    """`pg`'s own all_to_all_single as `dist.all_to_all_single(..., async_op=False)` issues it
    (options made once; its checks and argument handling left out: our callers pass contiguous
    tensors of one dtype): call(output, input, output_splits=None, input_splits=None). On NCCL
    it runs on the caller's stream and the host does not wait; on gloo the host waits."""
    call = getattr(pg, "all_to_all_single", None) or pg.alltoall_base  # torch < 2.13: the latter
    options = dist.AllToAllOptions()
    options.asyncOp = False

    def all_to_all(output, input, output_splits=None, input_splits=None) -> None:
        work = call(output, input, output_splits or [], input_splits or [], options)
        if work is not None:
            work.wait()
    return all_to_all


class _FastAllToAll(NamedTuple):
    """What `Group.all_to_all_single` needs per call, made once."""

    call: Callable[..., None]
    where: str  # the watch's description
    peers: tuple[int, ...]


@dataclass(frozen=True)
class Group:
    """A process group (None: the default one), its name and global ranks. Collectives are
    issued through these methods so the watch knows which group and op is in flight.

    `all_to_all_single`, the one collective issued hundreds of times a step (every dispatch
    and combine, forward and backward), takes a short path: `blocking_all_to_all` inside the
    watch's `begin` / `end` with a description made once, instead of `dist`'s wrapper inside a
    generator context with an f-string per call."""

    name: str
    ranks: tuple[int, ...]
    pg: Optional[dist.ProcessGroup]
    watch: CollectiveWatch

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        with self.watch.collective(self.name, self.ranks, "all_reduce"):
            dist.all_reduce(tensor, op=op, group=self.pg)

    def watched(self, op: str):
        """A context that tracks `op`, issued by no method here, as this group's collective:
        a CUDA graph replay holding the group's collectives (captured ones run only there)."""
        return self.watch.collective(self.name, self.ranks, op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_splits: Optional[list[int]] = None,
                          input_splits: Optional[list[int]] = None) -> None:
        """Blocking all_to_all_single (class docstring): on NCCL it runs on the caller's stream
        and the host does not wait; on gloo the host waits for it."""
        fast, watch = self._fast_all_to_all, self.watch
        entry = watch.begin(fast.where, fast.peers)
        try:
            fast.call(output, input, output_splits, input_splits)
        except BaseException as error:
            watch.failed(entry, error)
        watch.end(entry)

    @functools.cached_property
    def _fast_all_to_all(self) -> "_FastAllToAll":
        """Made on the first call (the default group exists by then); a frozen dataclass still
        takes it, as cached_property writes the instance's __dict__ directly."""
        pg = self.pg if self.pg is not None else dist.distributed_c10d._get_default_group()
        return _FastAllToAll(blocking_all_to_all(pg),
                             *self.watch.target(self.name, self.ranks, "all_to_all"))

    def all_to_all_single_async(self, output: torch.Tensor, input: torch.Tensor):
        """Equal-split all_to_all_single started without waiting (gloo: on the backend's own
        threads); the caller waits on the returned work inside `watched(...)`."""
        with self.watch.collective(self.name, self.ranks, "all_to_all start"):
            return dist.all_to_all_single(output, input, group=self.pg, async_op=True)

    def barrier(self) -> None:
        with self.watch.collective(self.name, self.ranks, "barrier"):
            dist.barrier(group=self.pg)

    def all_gather_object(self, objects: list, obj: object) -> None:
        with self.watch.collective(self.name, self.ranks, "all_gather_object"):
            dist.all_gather_object(objects, obj, group=self.pg)

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """`output` [size x input's rows, ...]: every rank's `input`, in rank order."""
        with self.watch.collective(self.name, self.ranks, "all_gather"):
            _ALL_GATHER_SINGLE(output, input, group=self.pg)

    def exchange(self, output: torch.Tensor, input: torch.Tensor, dst: int, src: int) -> None:
        """Send `input` to rank `dst` while receiving `output` from rank `src` (global ranks),
        both started before either is waited for (a ring's step: every rank sends and
        receives at once)."""
        with self.watch.collective(self.name, self.ranks, f"send to {dst}, recv from {src}"):
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, input, dst, self.pg),
                                            dist.P2POp(dist.irecv, output, src, self.pg)])
            for work in works:
                work.wait()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        with self.watch.collective(self.name, self.ranks, f"send to rank {dst}"):
            dist.send(tensor, dst=dst, group=self.pg)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        with self.watch.collective(self.name, self.ranks, f"recv from rank {src}"):
            dist.recv(tensor, src=src, group=self.pg)


@dataclass(frozen=True)
class NcclCtaBudget:
    """How many CTAs (thread blocks, one SM each) NCCL may use per collective of one
    communicator: its ncclConfig_t's maxCTAs / minCTAs. None: NCCL's own choice."""

    max_ctas: Optional[int] = None
    min_ctas: Optional[int] = None

    @property
    def is_default(self) -> bool:
        return self.max_ctas is None and self.min_ctas is None

    def describe(self) -> str:
        if self.is_default:
            return "NCCL default"
        parts = [f"{name} {value}" for name, value in (("max", self.max_ctas),
                                                       ("min", self.min_ctas)) if value]
        return "CTAs " + ", ".join(parts)


def build_ep_options(budget: Optional[NcclCtaBudget], backend: str,
                     timeout: datetime.timedelta, options_factory=None):
    """The `pg_options` of the expert-parallel groups: None (the backend's defaults) without a
    budget; on NCCL a `ProcessGroupNCCL.Options()` (or `options_factory()`) whose `config`
    holds the budget's max_ctas / min_ctas (fields left alone keep NCCL's defaults) and whose
    timeout is the group's (so torch does not warn that the two differ). Raises ValueError for
    a budget on another backend."""
    if budget is None or budget.is_default:
        return None
    if backend != "nccl":
        raise ValueError(f"an NCCL CTA budget ({budget.describe()}) was given for a {backend} "
                         "process group: it applies to NCCL communicators only")
    if options_factory is None:
        options_factory = dist.ProcessGroupNCCL.Options
    options = options_factory()
    if budget.max_ctas is not None:
        options.config.max_ctas = budget.max_ctas
    if budget.min_ctas is not None:
        options.config.min_ctas = budget.min_ctas
    options._timeout = timeout
    return options


@dataclass(frozen=True)
class RankLayout:
    """Megatron-core's rank order for a world of `world_size` = PP x CP x DP = PP x EP x EDP
    (module doc)."""

    world_size: int
    pp_size: int = 1
    ep_size: int = 1
    cp_size: int = 1

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: CP x DP (= EP x EDP)."""
        return self.world_size // self.pp_size

    @property
    def dp_size(self) -> int:
        """Ranks that read different data (Megatron-core's data-parallel size)."""
        return self.stage_size // self.cp_size

    @property
    def edp_size(self) -> int:
        return self.stage_size // self.ep_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.stage_size

    def stage_rank(self, rank: int) -> int:
        """The place of `rank` in its stage (its index in the stage's dense-grad group)."""
        return rank % self.stage_size

    def cp_rank(self, rank: int) -> int:
        return rank % self.cp_size

    def dp_rank(self, rank: int) -> int:
        return self.stage_rank(rank) // self.cp_size

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep_size

    def edp_rank(self, rank: int) -> int:
        return self.stage_rank(rank) // self.ep_size

    def pp_groups(self) -> list[list[int]]:
        """One pipeline per place in a stage: its ranks in stage order."""
        return [list(range(d, self.world_size, self.stage_size))
                for d in range(self.stage_size)]

    def dp_cp_groups(self) -> list[list[int]]:
        """One group per stage, CP x DP ranks (dense grads are averaged there; Megatron-core's
        data-parallel group with CP)."""
        return [list(range(p * self.stage_size, (p + 1) * self.stage_size))
                for p in range(self.pp_size)]

    def dp_groups(self) -> list[list[int]]:
        """Per stage and cp_rank: the ranks reading different data (Megatron-core's "dp")."""
        return [list(range(p * self.stage_size + c, (p + 1) * self.stage_size, self.cp_size))
                for p in range(self.pp_size) for c in range(self.cp_size)]

    def cp_blocks(self, size: int) -> list[list[int]]:
        """Every CP group cut into blocks of `size` consecutive ranks (dynamic CP's groups of
        that size; `size` divides CP)."""
        return [list(range(b, b + size)) for b in range(0, self.world_size, size)]

    def cp_groups(self) -> list[list[int]]:
        """The ranks holding the parts of one sequence: blocks of CP consecutive ranks."""
        return [list(range(b * self.cp_size, (b + 1) * self.cp_size))
                for b in range(self.world_size // self.cp_size)]

    def ep_groups(self) -> list[list[int]]:
        return [list(range(b * self.ep_size, (b + 1) * self.ep_size))
                for b in range(self.world_size // self.ep_size)]

    def ep_host_groups(self, per_host: int) -> list[list[int]]:
        """Each EP group cut into its hosts of `per_host` consecutive ranks (the hierarchical
        dispatch's second stage, inside a host)."""
        return [group[h:h + per_host] for group in self.ep_groups()
                for h in range(0, self.ep_size, per_host)]

    def ep_rail_groups(self, per_host: int) -> list[list[int]]:
        """Per EP group and index inside a host: that rank of each of the group's hosts (the
        hierarchical dispatch's first stage, between hosts)."""
        return [group[i::per_host] for group in self.ep_groups() for i in range(per_host)]

    def edp_groups(self) -> list[list[int]]:
        """Per stage and ep_rank: the replicas of one expert shard."""
        return [list(range(p * self.stage_size + e, (p + 1) * self.stage_size, self.ep_size))
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
    world: Group
    ep: Group
    edp: Group
    watch: CollectiveWatch
    pp_size: int = 1
    pp_rank: int = 0
    pp: Optional[Group] = None  # this rank's pipeline, its ranks by stage; None with one stage
    dp: Optional[Group] = None  # this stage's CP x DP ranks, where dense grads are averaged
    #                             (Megatron-core's data-parallel group with CP); one stage: world
    cp: Optional[Group] = None  # the ranks holding the parts of my sequences; None without CP
    cp_exchange: Optional[Group] = None  # the CP ranks' second communicator: the K/V gather
    #                                      of the comm lane (model.context), apart from what
    #                                      the compute lane issues on `cp` meanwhile
    ep_budget: Optional[NcclCtaBudget] = None  # the EP communicator's CTA limits, if any
    ep_splits: Optional[Group] = None  # the EP ranks' second communicator: the early split-size
    #                                    exchange of the dropless dispatch (parallel.comm)
    ep_rail: Optional[Group] = None  # --moe-dispatch-hierarchy node: my index's rank of every
    ep_host: Optional[Group] = None  # host of my EP group; my host's ranks of my EP group

    def __post_init__(self):
        if self.dp is None:
            self.dp = self.world

    @property
    def dp_size(self) -> int:
        """Ranks of the stage, CP x DP: the dense grads' replicas."""
        return self.dp.size

    @property
    def dp_rank(self) -> int:
        return self.dp.ranks.index(self.rank)

    @property
    def cp_size(self) -> int:
        return 1 if self.cp is None else self.cp.size

    @property
    def cp_rank(self) -> int:
        return 0 if self.cp is None else self.cp.ranks.index(self.rank)

    @property
    def data_size(self) -> int:
        """Ranks of the stage that read different sequences: DP = stage / CP."""
        return self.dp_size // self.cp_size

    @property
    def data_rank(self) -> int:
        """Which of them this rank's sequences are (its CP group's: `RankLayout.dp_rank`)."""
        return self.dp_rank // self.cp_size

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        return self.ep.pg

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


def _new_groups(name: str, ranks_of: list[list[int]], my_rank: int,
                timeout: datetime.timedelta, watch: CollectiveWatch,
                make_options: Callable[[], Any] = lambda: None) -> Group:
    """Create every group of the partition (all ranks must call); return the one holding me.
    Each group gets its own `make_options()` (torch writes the group's name and ranks into
    the options object it is given)."""
    mine = None
    for ranks in ranks_of:
        pg = dist.new_group(ranks, timeout=timeout, group_desc=name, pg_options=make_options())
        if my_rank in ranks:
            mine = Group(name, tuple(ranks), pg, watch)
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


def _attempt_of_rank_0() -> str:
    """Rank 0's torchrun restart count, on every rank: the heartbeat keys' prefix. Each node's
    agent counts its own restarts, so after a lost node is replaced by a fresh one the counts
    differ between nodes; one prefix keeps every rank's heartbeat where the others look."""
    attempt = [os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")]
    dist.broadcast_object_list(attempt, src=0)
    return str(attempt[0])


def _start_watch(rank: int, world_size: int, timeout: datetime.timedelta,
                 on_gpu: bool) -> CollectiveWatch:
    heartbeat = (Heartbeat.from_env(rank, world_size, _attempt_of_rank_0())
                 if world_size > 1 else None)
    watch = CollectiveWatch(rank, world_size, timeout.total_seconds(), on_gpu, heartbeat)
    watch.start()
    return watch


def init_distributed(ep_size: int, device_kind: str, timeout_minutes: float = 10.0,
                     pp_size: int = 1,
                     ep_budget: Optional[NcclCtaBudget] = None,
                     ep_per_host: Optional[int] = None, cp_size: int = 1) -> ParallelGroups:
    """Initialize torch.distributed and build the PP, DP, CP, EP and EDP groups (the EP groups
    with `ep_budget`'s NCCL CTA limits, if any; with `ep_per_host`, the hierarchical
    dispatch's groups of each EP group over hosts of that many ranks)."""
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
    watch = _start_watch(rank, world_size, timeout, backend == "nccl")
    return expert_parallel_groups(ep_size, device, local_rank, watch=watch, timeout=timeout,
                                  pp_size=pp_size, ep_budget=ep_budget, ep_per_host=ep_per_host,
                                  cp_size=cp_size)


def expert_parallel_groups(ep_size: int, device: torch.device, local_rank: int = 0, *,
                           watch: CollectiveWatch,
                           timeout: datetime.timedelta = datetime.timedelta(minutes=10),
                           pp_size: int = 1,
                           ep_budget: Optional[NcclCtaBudget] = None,
                           ep_per_host: Optional[int] = None,
                           cp_size: int = 1) -> ParallelGroups:
    """The PP, DP, CP, EP and EDP groups of `pp_size` stages, `cp_size` and `ep_size` over the
    initialized world (every rank must call), watched by `watch`; the EP groups with
    `ep_budget`'s NCCL CTA limits; with `ep_per_host`, each EP group's rails and hosts
    (`add_host_groups`). Called again with another EP size (or budget) in the same world, it
    gives a second, independent layout (tests resume one run's checkpoint at another EP size
    in one process group; the overlap benchmark sweeps budgets)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = RankLayout(world_size, pp_size, ep_size, cp_size)
    backend = dist.get_backend()
    build_ep_options(ep_budget, backend, timeout)  # a budget on gloo: refused before any group

    def groups(name: str, ranks_of: list[list[int]], budget=None) -> Group:
        return _new_groups(name, ranks_of, rank, timeout, watch,
                           lambda: build_ep_options(budget, backend, timeout))

    world = Group(WORLD, tuple(range(world_size)), None, watch)
    staged = pp_size > 1
    made = ParallelGroups(
        rank=rank, world_size=world_size, local_rank=local_rank, ep_size=ep_size,
        ep_rank=layout.ep_rank(rank), edp_size=layout.edp_size, edp_rank=layout.edp_rank(rank),
        device=device, backend=dist.get_backend(), world=world, watch=watch,
        ep=groups(EXPERT_PARALLEL, layout.ep_groups(), ep_budget), ep_budget=ep_budget,
        ep_splits=groups(EXPERT_PARALLEL_SPLITS, layout.ep_groups()) if ep_size > 1 else None,
        edp=groups(EXPERT_DATA_PARALLEL, layout.edp_groups()),
        pp_size=pp_size, pp_rank=layout.pp_rank(rank),
        pp=groups(PIPELINE, layout.pp_groups()) if staged else None,
        dp=groups(DATA_PARALLEL, layout.dp_cp_groups()) if staged else world,
        cp=groups(CONTEXT_PARALLEL, layout.cp_groups()) if cp_size > 1 else None,
        cp_exchange=(groups(CONTEXT_PARALLEL_EXCHANGE, layout.cp_groups()) if cp_size > 1
                     else None))
    if ep_per_host is not None:
        add_host_groups(made, ep_per_host, timeout)
    return made


def add_host_groups(groups: ParallelGroups, per_host: int,
                    timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> None:
    """The hierarchical dispatch's groups of `groups`' EP layout over hosts of `per_host`
    ranks (`ep_rail`, `ep_host`), made now where `expert_parallel_groups` did not (every rank
    must call, as it builds its trainer)."""
    layout = RankLayout(groups.world_size, groups.pp_size, groups.ep_size, groups.cp_size)
    groups.ep_rail = _new_groups(EXPERT_PARALLEL_RAIL, layout.ep_rail_groups(per_host),
                                 groups.rank, timeout, groups.watch)
    groups.ep_host = _new_groups(EXPERT_PARALLEL_HOST, layout.ep_host_groups(per_host),
                                 groups.rank, timeout, groups.watch)


def context_groups(groups: ParallelGroups, sizes: tuple[int, ...],
                   timeout: datetime.timedelta = datetime.timedelta(minutes=10)
                   ) -> dict[int, Group]:
    """Dynamic CP's groups: my block of each size in `sizes` (every rank must call, in the
    same order, as it builds its trainer)."""
    layout = RankLayout(groups.world_size, groups.pp_size, groups.ep_size, groups.cp_size)
    return {size: _new_groups(f"{CONTEXT_PARALLEL} of {size}", layout.cp_blocks(size),
                              groups.rank, timeout, groups.watch) for size in sizes}


def destroy_distributed(groups: Optional[ParallelGroups] = None) -> None:
    """Tear down (release every CUDA graph before this: see environment.md); stops the
    watch's heartbeat thread of `groups`."""
    if groups is not None:
        groups.watch.close()
    if dist.is_initialized():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.destroy_process_group()
