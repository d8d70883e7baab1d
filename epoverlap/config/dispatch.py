"""How the MoE dispatch sizes its all-to-alls, as the configuration states it: `DispatchMode`
(dropless, capacity, capacity_padded, budget; once per rank or not), the facts validation and
the memory estimate need (does the dispatch read split sizes on the host, does it drop tokens,
how many rows a rank's experts compute), and the pure sizing rules the dispatcher shares
(`padded_rows`, `budget_block_rows`, `budget_group_rows`, `budget_levels`), and a run's
place in the table of dispatch rules (`dispatch_choice`: `config.dispatch_rules`). The
dispatcher itself is `epoverlap.model.moe`; it imports these, never the reverse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from epoverlap.config.dispatch_rules import DispatchChoice, graphs_scope, refusal
from epoverlap.kernels.capacity import get_capacity

if TYPE_CHECKING:
    from epoverlap.config import MoEConfig, RunConfig


@dataclass(frozen=True)
class DispatchMode:
    """How the dispatcher sizes its all-to-alls (see the module docstring), from the config."""

    capacity_factor: Optional[float] = None
    pad_to_capacity: bool = False
    drop_policy: str = "probs"
    budget: Optional[float] = None
    once_per_rank: bool = False  # --moe-dispatch-once-per-rank (not with a padded capacity)
    hierarchy: str = "flat"  # --moe-dispatch-hierarchy: "node" sends once per host, then rank

    @classmethod
    def of(cls, moe: MoEConfig) -> "DispatchMode":
        return cls(capacity_factor=moe.capacity_factor,
                   pad_to_capacity=moe.moe_pad_expert_input_to_capacity,
                   drop_policy=moe.moe_token_drop_policy, budget=moe.moe_dispatch_budget,
                   once_per_rank=moe.moe_dispatch_once_per_rank,
                   hierarchy=moe.moe_dispatch_hierarchy)

    @property
    def by_host(self) -> bool:
        """--moe-dispatch-hierarchy node: once per destination host, then inside the host."""
        return self.hierarchy == "node"

    @property
    def name(self) -> str:
        if self.budget is not None:
            return "budget"
        if self.capacity_factor is None:
            return "dropless"
        return "capacity_padded" if self.pad_to_capacity else "capacity"

    @property
    def sizing(self) -> str:
        """How rows are sized (`dispatch_rules.SIZINGS`): host_splits, padded or budget."""
        return {"dropless": "host_splits", "capacity": "host_splits",
                "capacity_padded": "padded"}.get(self.name, self.name)

    @property
    def routing(self) -> str:
        """How rows are routed (`dispatch_rules.ROUTINGS`): by host before once per rank."""
        if self.by_host:
            return "per_host"
        return "per_rank" if self.once_per_rank else "per_expert"

    @property
    def drops_tokens(self) -> bool:
        return self.capacity_factor is not None

    @property
    def dispatch_syncs_host(self) -> bool:
        """True when the dispatch reads split sizes on the host (not capturable in a graph)."""
        return self.sizing == "host_splits"

    def expert_rows(self, tokens: int, topk: int, num_experts: int, ranks: int) -> int:
        """Rows a rank's dispatch sends (and, routing balanced, its experts compute) for a
        microbatch of `tokens` tokens: tokens x topk (dropless, capacity: at most that),
        experts x capacity padded, with the budget ranks x block at the first budget level
        that holds balanced routing (>= 1; an imbalanced step reruns larger, up to `ranks`)."""
        rows = tokens * topk
        if self.budget is not None:
            level = next(b for b in budget_levels(self.budget, ranks) if b >= 1)
            return ranks * budget_block_rows(level, rows, ranks)
        if self.pad_to_capacity:
            return padded_rows(tokens, topk, num_experts, self.capacity_factor)
        return rows

    @staticmethod
    def preprocess_syncs_host(kernel_backend: str) -> bool:
        """No mode reads the host in preprocess; the torch reference permute does (its backward
        sizes a gather by the most rows any token has), the Triton one does not."""
        return kernel_backend == "torch"


def a2a_waves_blocker(cfg: "RunConfig", waves: int) -> str:
    """Why `waves` waves of local experts (--moe-a2a-waves, `model.waves`) cannot run
    with `cfg`, in the words of a ConfigError ('' when they can): they need MoE layers over EP
    ranks, at least `waves` local experts, a flat dispatch one row per expert (dropless,
    capacity, or the budget's fixed blocks per expert group: `model.waves_budget`), and
    nodes no graph makes one: local graphs of the pre-dispatch segments, or with the budget one
    graph over the whole iteration (whole-layer graphs make each MoE layer one node, nothing
    to split into waves)."""
    if waves == 1:
        return ""
    ep = cfg.parallel.expert_model_parallel_size or 1
    if not any(cfg.moe_layer_pattern()) or ep <= 1:
        return "needs MoE layers and --expert-model-parallel-size > 1 (no all-to-all to split)"
    local = cfg.moe.num_experts // ep
    if waves > local:
        return (f"must be <= the {local} local experts of a rank (--num-experts / "
                f"--expert-model-parallel-size): a wave is a group of them")
    return refusal(dispatch_choice(cfg, waves=waves), "--moe-a2a-waves")


def hierarchy_blocker(cfg: "RunConfig", per_host: int) -> str:
    """Why --moe-dispatch-hierarchy node cannot run with `cfg` on hosts of `per_host` ranks, in
    the words of a ConfigError ('' when it can): it needs an expert-parallel group of whole
    hosts, at least two, and a dispatch of data-dependent rows (dropless, capacity unpadded,
    or the budget's fixed blocks of them). Under --comm-mode local_copy both stages are local
    copies (`HostRoute.mirrored`): the compute-only baseline of the hierarchy."""
    mode = DispatchMode.of(cfg.moe)
    if not mode.by_host:
        return ""
    ep = cfg.parallel.expert_model_parallel_size or 1
    if ep % per_host or ep // per_host < 2:
        return (f"needs the expert-parallel group to span whole hosts, at least two: EP {ep} "
                f"over hosts of {per_host} ranks (LOCAL_WORLD_SIZE / --emulate-hosts)")
    return refusal(dispatch_choice(cfg), "--moe-dispatch-hierarchy")


def dispatch_choice(cfg: "RunConfig", waves: Optional[int] = None) -> DispatchChoice:
    """`cfg`'s place in the table of dispatch rules (`config.dispatch_rules`), the flags'
    path; `waves`: --moe-a2a-waves as if given so."""
    mode, graphs = DispatchMode.of(cfg.moe), cfg.cuda_graph
    waves = cfg.overlap.moe_a2a_waves if waves is None else waves
    return DispatchChoice(sizing=mode.sizing, routing=mode.routing,
                          graphs=graphs_scope(graphs.impl, graphs.modules or ()),
                          waves="one" if waves == 1 else "several",
                          transport=cfg.parallel.moe_a2a_transport)


BY_HOST_MAX_SHARE = 0.8  # the auto hierarchy's bar: at most this share of flat's rows cross


def group_reach(experts: int, topk: int, groups: int) -> float:
    """The chance that a token's `topk` experts, drawn from `experts` (balanced routing), hit a
    given one of `groups` equal groups of them: 1 - C(E - E / groups, k) / C(E, k)."""
    return 1.0 - (math.comb(experts - experts // groups, topk) / math.comb(experts, topk))


def by_host_row_share(experts: int, topk: int, hosts: int) -> float:
    """Rows the hierarchical dispatch sends between hosts over the flat dispatch's (one per
    chosen expert), routing balanced: hosts x reach(hosts) / topk (top-8 of 64 over 2 hosts:
    0.25; top-8 of 256 over 8 hosts: 0.66, over 32 hosts: 0.90)."""
    return hosts * group_reach(experts, topk, hosts) / topk


def padded_rows(tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Permuted rows with --moe-pad-expert-input-to-capacity: every expert's capacity."""
    return num_experts * get_capacity(tokens * topk, num_experts, capacity_factor)


def budget_block_rows(budget: float, rows: int, ranks: int) -> int:
    """Rows per destination rank at a budget: ceil(budget x rows / ranks), at most `rows`."""
    return min(rows, math.ceil(budget * rows / ranks))


def budget_group_rows(budget: float, tokens: int, topk: int, group: int, experts: int) -> int:
    """Rows per (rank pair, group of `group` of the `experts` experts) at a budget (the
    budget dispatch in waves): ceil(budget x tokens x topk x group / experts), at most
    tokens x min(topk, group), all a rank can route one group (reached at budget = experts)."""
    return min(tokens * min(topk, group), math.ceil(budget * tokens * topk * group / experts))


def budget_levels(factor: float, ranks: int) -> tuple[float, ...]:
    """The budgets a rerun may use: factor, 2 x factor, ... up to `ranks` (whose block holds
    every row a rank routes, so it can never overflow)."""
    levels = [factor]
    while levels[-1] < ranks:
        levels.append(min(levels[-1] * 2, float(ranks)))
    return tuple(levels)
