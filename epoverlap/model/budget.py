"""The budget dispatch's buffer size: `DispatchBudget`, one per model, shared by its MoE layers'
dispatchers (`model.dispatch.sizing.BudgetDispatcher`), read by the trainer after each
forward-backward to decide a rerun (`training.loop.step`) and by the graph banks, which hold one
bank per budget level (`graphs.banks`). The sizing rules themselves are the config's
(`config.dispatch`). `ByHostBudget` sizes the hierarchical dispatch's two stages
(`model.dispatch.by_host.ByHostBudgetDispatcher`): a block per host, then a block per host mate,
and the experts' rows.
`GroupBudget` sizes the blocks of a layer in waves, one per (rank pair, group of experts)
(`model.waves_budget`), at the shared budget's level; its demand joins the budget's.

With --moe-dispatch-budget-fit the base budget follows the demand (`BudgetFit`): after the
first step it becomes the least factor that held the most any step of the window wanted, plus
`FIT_MARGIN`; it grows at once after a step that overflowed it, and shrinks where the window
needed less, at most every `FIT_SHRINK_STEPS` steps (each change recaptures the graphs that
hold the dispatch). The window can be cut to the demand of some of its steps (`keep_steps`: the
path tuner's decision keeps the steps that ran the chosen path), and the base may then shrink
to it at once. Every rank sees the same all-reduced demand, so
every rank fits alike. The rows the fixed blocks move beside the rows the dropless dispatch
would move (`wire_rows`) are counted on the device, for the step's report.
"""

from __future__ import annotations

import collections
import math
from typing import Optional, Sequence

import torch

from epoverlap.config.dispatch import (budget_block_rows, budget_group_rows, budget_levels,
                                      group_reach)

FIT_MARGIN = 0.02  # the fitted base budget: the window's most demand, plus this share
FIT_GRID = 128  # ... rounded up to a multiple of 1 / FIT_GRID
FIT_SHRINK_STEPS = 100  # the fitted budget shrinks at most once in this many steps


class DispatchBudget:
    """The buffer size of the sync-free dropless dispatch, shared by every MoE layer of a model.

    Each rank sends every EP rank one block of `block_rows` rows: ceil(factor x N / ranks), at
    most N, where N = tokens x topk of a microbatch (factor 1.0 = the balanced share). A
    dispatch that routes more than a block's rows to one rank sends only the first block of them
    and raises `demand_rows` (a device scalar: the most rows any dispatch of the step wanted to
    send to one rank); after the step the trainer all-reduces it and, if it exceeds the block,
    reruns the step at `rerun_level(demand)`, the smallest of `levels` whose block holds it.

    Once per rank a received row goes to up to min(topk, L) local experts, so the experts' rows
    are budgeted apart (`pairs_per_dispatch` = tokens x topk, the balanced share of (token,
    expert) pairs a rank's experts get; `pairs_per_row` = min(topk, L)): `expert_rows`, with its
    own demand (`demand_expert_rows`, the most pairs any dispatch brought one rank's experts).
    Without `pairs_per_dispatch` the rows are the pairs already: nothing apart to budget. The
    experts' demand is counted where the rows arrive, so a step whose sends overflowed counts
    only the pairs of the rows that were sent: its rerun, whose blocks hold every row, may still
    overflow the experts' budget and run once more (never with k >= EP at a budget >= 1, whose
    blocks hold one row per token).
    """

    def __init__(self, factor: float, ranks: int, rows_per_dispatch: int,
                 device: torch.device, pairs_per_dispatch: Optional[int] = None,
                 pairs_per_row: int = 1, memory_steps: int = 0, fit: bool = False,
                 rank: int = 0):
        self.ranks, self.rows, self.rank = ranks, rows_per_dispatch, rank
        self.pairs, self.pairs_per_row = pairs_per_dispatch, pairs_per_row
        self.levels = budget_levels(factor, ranks)
        self.level = 0
        # the levels the last `memory_steps` steps ended at (--moe-dispatch-budget-memory)
        self.recent_levels: collections.deque = collections.deque(maxlen=memory_steps)
        self.demand_rows = torch.zeros((), dtype=torch.int64, device=device)
        self.demand_expert_rows = torch.zeros((), dtype=torch.int64, device=device)
        self.groups: dict[tuple, GroupBudget] = {}  # the layers in waves (`group_budget`)
        # [rows the blocks sent other ranks over the step's attempts, rows the dropless
        # dispatch would have sent them in its last attempt]
        self.wire_rows = torch.zeros(2, dtype=torch.int64, device=device)
        self.fit = BudgetFit(max(memory_steps, 1)) if fit else None

    @classmethod
    def of_model(cls, moe, tokens: int, mode, comm, device: torch.device,
                 ep_rank: int) -> Optional["DispatchBudget"]:
        """The one budget every MoE layer's dispatcher shares (`moe`: the `MoEConfig`; `tokens`:
        of one microbatch on one rank; `mode`: the model's `DispatchMode`; budget mode only,
        else None; by host it sizes both stages)."""
        if mode.budget is None:
            return None
        hosts = comm.by_host.hosts if mode.by_host and comm.by_host is not None else 1
        return cls.for_dispatch(mode.budget, comm.size, tokens, moe.moe_router_topk,
                                moe.num_experts, mode.once_per_rank, device,
                                memory_steps=moe.moe_dispatch_budget_memory, hosts=hosts,
                                fit=moe.moe_dispatch_budget_fit, rank=ep_rank)

    @classmethod
    def for_dispatch(cls, factor: float, ranks: int, tokens: int, topk: int, num_experts: int,
                     once_per_rank: bool, device: torch.device, memory_steps: int = 0,
                     hosts: int = 1, fit: bool = False, rank: int = 0) -> "DispatchBudget":
        """The budget of a dispatch of `tokens` tokens a microbatch: rows are (token, expert)
        pairs, or once per rank (EP > 1) (token, rank) pairs, at most min(topk, ranks) a token,
        each going to at most min(topk, L) local experts, whose rows are budgeted apart. By
        host (`hosts` > 1): `ByHostBudget`. `rank`: this rank's index in the EP group."""
        if hosts > 1:
            return ByHostBudget(factor, hosts, ranks // hosts, tokens, topk, num_experts,
                                device, memory_steps, fit)
        if once_per_rank and ranks > 1:
            return cls(factor, ranks, tokens * min(topk, ranks), device,
                       pairs_per_dispatch=tokens * topk,
                       pairs_per_row=min(topk, num_experts // ranks), memory_steps=memory_steps,
                       fit=fit, rank=rank)
        return cls(factor, ranks, tokens * topk, device, memory_steps=memory_steps, fit=fit,
                   rank=rank)

    def start_level(self) -> int:
        """The level a training step starts at: the largest level one of the remembered steps
        ended at (0 without a memory). Every rank remembers the same levels (they are agreed
        by an all-reduce), so every rank starts alike."""
        return max(self.recent_levels, default=0)

    def remember(self, level: int, demand: Optional[Sequence[int]] = None,
                 step: Optional[int] = None) -> None:
        """Training step `step` ended at `level`, its last attempt's all-reduced `demand`."""
        self.recent_levels.append(level)
        if self.fit is not None and demand is not None:
            self.fit.observe(self.needed_factor(demand), step)

    def keep_steps(self, steps: set) -> None:
        """The fit forgets the demand of every step but `steps` (`BudgetFit.keep_steps`)."""
        if self.fit is not None:
            self.fit.keep_steps(steps)

    @property
    def max_levels(self) -> int:
        """The most levels the budget can have (a fitted base is at least 1)."""
        if self.fit is None:
            return len(self.levels)
        return len(budget_levels(min(1.0, self.levels[0]), self.ranks))

    def refit(self) -> Optional[float]:
        """Before a step: the fitted base budget, where it changes now (`BudgetFit.due`), the
        levels rebuilt from it and the remembered levels forgotten (they name the old levels);
        else None."""
        if self.fit is None:
            return None
        factor = self.fit.due(self.levels[0], float(self.ranks))
        if factor is None:
            return None
        self.levels, self.level = budget_levels(factor, self.ranks), 0
        self.recent_levels.clear()
        return factor

    def fit_state(self) -> Optional[dict]:
        """The base budget and the fit's state, for a checkpoint (None without a fit)."""
        if self.fit is None:
            return None
        return {"base": self.levels[0], **self.fit.state()}

    def load_fit_state(self, state: dict) -> None:
        """`fit_state` of the saved run, where this run fits too."""
        if self.fit is not None:
            self.levels = budget_levels(state["base"], self.ranks)
            self.fit.load(state)

    def needed_factor(self, demand: Sequence[int]) -> float:
        """The least factor whose blocks hold `demand` (`demand()`, max over ranks)."""
        need = demand[0] * self.ranks / self.rows
        if self.pairs is not None:
            need = max(need, demand[1] / self.pairs)
        return max([need] + [group.needed_factor(wanted)
                             for group, wanted in self._group_demands(demand)])

    @property
    def factor(self) -> float:
        return self.levels[self.level]

    def block_rows_at(self, level: int) -> int:
        return budget_block_rows(self.levels[level], self.rows, self.ranks)

    @property
    def block_rows(self) -> int:
        return self.block_rows_at(self.level)

    def expert_rows_at(self, level: int) -> Optional[int]:
        """Rows the local experts get at `level` (once per rank), else None: the budget times
        the balanced share of pairs, at most every received row times `pairs_per_row` (at the
        top level, `ranks` x the pairs: every pair of every rank, so it never overflows)."""
        if self.pairs is None:
            return None
        received = self.ranks * self.block_rows_at(level) * self.pairs_per_row
        return min(received, math.ceil(self.levels[level] * self.pairs))

    @property
    def expert_rows(self) -> Optional[int]:
        return self.expert_rows_at(self.level)

    def check_rows(self, num_rows: int) -> None:
        """A dispatch's permuted rows must be the count its blocks were sized for."""
        if num_rows != self.rows:
            raise RuntimeError(f"budget dispatch of {num_rows} rows, sized for {self.rows}")

    def note(self, send_R: torch.Tensor) -> None:
        """Record on the device the most rows this dispatch routes to one rank (no sync)."""
        torch.maximum(self.demand_rows, send_R.max(), out=self.demand_rows)

    def note_wire(self, send_R: torch.Tensor, block_rows: int) -> None:
        """Count on the device what a dispatch of fixed blocks sends the other ranks, and what
        the dropless dispatch would have sent them (`send_R`: its rows per rank)."""
        exact = send_R.sum() - send_R[self.rank]
        self.wire_rows[0].add_(block_rows * (self.ranks - 1))
        self.wire_rows[1].add_(exact)

    def note_expert_rows(self, pairs: torch.Tensor) -> None:
        """Record on the device the pairs this dispatch brought the local experts (no sync)."""
        torch.maximum(self.demand_expert_rows, pairs, out=self.demand_expert_rows)

    def group_budget(self, group_sizes: Sequence[int], topk: int,
                     num_experts: int) -> "GroupBudget":
        """The budget of waves of local experts in groups of `group_sizes` (one per wave
        count, shared by the layers; made before any graph is captured, so its demand keeps
        its address)."""
        key = tuple(group_sizes)
        if key not in self.groups:
            self.groups[key] = GroupBudget(self, key, self.rows // topk, topk, num_experts)
        return self.groups[key]

    def reset_demand(self) -> None:
        """Before an attempt: no demand yet, and no exact rows (the blocks' rows add up over a
        step's attempts, `reset_wire`)."""
        self.demand_rows.zero_()
        self.demand_expert_rows.zero_()
        self.wire_rows[1].zero_()
        for group in self.groups.values():
            group.demand_rows.zero_()

    def reset_wire(self) -> None:
        """Before a step."""
        self.wire_rows.zero_()

    def demand(self) -> torch.Tensor:
        """[rows to one rank, pairs on one rank's experts, then each `GroupBudget`'s rows to
        one rank's group, group by group] of the step, on the device."""
        return torch.cat([torch.stack([self.demand_rows, self.demand_expert_rows])]
                         + [group.demand_rows for group in self.groups.values()])

    def fits(self, level: int, demand: Sequence[int]) -> bool:
        experts = self.expert_rows_at(level)
        fits_groups = all(group.fits(level, wanted)
                          for group, wanted in self._group_demands(demand))
        return (self.block_rows_at(level) >= demand[0] and fits_groups
                and (experts is None or experts >= demand[1]))

    def _group_demands(self, demand: Sequence[int]) -> list[tuple["GroupBudget", Sequence[int]]]:
        """Each `GroupBudget` with its part of `demand` (after the first two entries)."""
        parts, start = [], 2
        for group in self.groups.values():
            parts.append((group, demand[start:start + len(group.sizes)]))
            start += len(group.sizes)
        return parts

    def rerun_level(self, demand: Sequence[int]) -> Optional[int]:
        """None when the level in use holds `demand` (`demand()`, max over ranks), else the
        smallest level that does."""
        if self.fits(self.level, demand):
            return None
        return next(level for level in range(len(self.levels)) if self.fits(level, demand))


class ByHostBudget(DispatchBudget):
    """The budget of the hierarchical dispatch over `hosts` hosts of `per_host` ranks, three
    buffers sized at each level f of `levels` (balanced routing's share times f, at most what
    can ever come):

      stage 1  `block_rows`: rows a rank sends each host (one per token reaching it): f x
               tokens x reach(hosts), at most `tokens`;
      stage 2  `within_rows`: rows a rank forwards each mate of its host (its rail's rows for
               that mate's experts): f x hosts x tokens x reach(ranks), at most every row it
               received (hosts x `block_rows`);
      experts  `expert_rows`: (row, local expert) pairs, as once per rank: f x tokens x topk,
               at most every received row (per_host x `within_rows`) times min(topk, L).

    reach(g) = `config.dispatch.group_reach`: the chance a token's experts hit one of g equal
    groups. At the top level (f = ranks) every buffer holds all it can ever get. Each buffer
    records its demand; `fits` needs all three."""

    def __init__(self, factor: float, hosts: int, per_host: int, tokens: int, topk: int,
                 num_experts: int, device: torch.device, memory_steps: int = 0,
                 fit: bool = False):
        ranks = hosts * per_host
        super().__init__(factor, ranks, tokens * min(topk, hosts), device,
                         pairs_per_dispatch=tokens * topk,
                         pairs_per_row=min(topk, num_experts // ranks),
                         memory_steps=memory_steps, fit=fit)
        self.hosts, self.per_host, self.tokens = hosts, per_host, tokens
        self._host_share = tokens * group_reach(num_experts, topk, hosts)
        self._mate_share = hosts * tokens * group_reach(num_experts, topk, ranks)
        self.demand_within_rows = torch.zeros((), dtype=torch.int64, device=device)

    def block_rows_at(self, level: int) -> int:
        return min(self.tokens, math.ceil(self.levels[level] * self._host_share))

    def within_rows_at(self, level: int) -> int:
        return min(self.hosts * self.block_rows_at(level),
                   math.ceil(self.levels[level] * self._mate_share))

    @property
    def within_rows(self) -> int:
        return self.within_rows_at(self.level)

    def expert_rows_at(self, level: int) -> int:
        received = self.per_host * self.within_rows_at(level) * self.pairs_per_row
        return min(received, math.ceil(self.levels[level] * self.pairs))

    def note_within(self, send_P: torch.Tensor) -> None:
        """Record on the device the most rows this rank forwards one host mate (no sync)."""
        torch.maximum(self.demand_within_rows, send_P.max(), out=self.demand_within_rows)

    def reset_demand(self) -> None:
        super().reset_demand()
        self.demand_within_rows.zero_()

    def demand(self) -> torch.Tensor:
        """[rows to one host, rows to one host mate, pairs on one rank's experts]."""
        return torch.stack([self.demand_rows, self.demand_within_rows,
                            self.demand_expert_rows])

    def fits(self, level: int, demand: Sequence[int]) -> bool:
        return (self.block_rows_at(level) >= demand[0]
                and self.within_rows_at(level) >= demand[1]
                and self.expert_rows_at(level) >= demand[2])

    def needed_factor(self, demand: Sequence[int]) -> float:
        return max(demand[0] / self._host_share, demand[1] / self._mate_share,
                   demand[2] / self.pairs)


class GroupBudget:
    """The block sizes of the budget dispatch in waves (`model.waves_budget`): at each level f of
    the shared `DispatchBudget`, rank pairs exchange for group g of a rank's local experts (G_g
    of the E experts) a block of f x tokens x topk x G_g / E rows (the balanced share), at most
    all a rank can route the group (`config.dispatch.budget_group_rows`); the top level holds
    that many. `demand_rows` [K] (device): the most rows any dispatch of the step routed to one
    rank's group g, all-reduced and checked with the budget's (`DispatchBudget.fits`)."""

    def __init__(self, budget: DispatchBudget, sizes: tuple, tokens: int, topk: int,
                 num_experts: int):
        self.budget, self.sizes = budget, sizes
        self.tokens, self.topk, self.num_experts = tokens, topk, num_experts
        self.demand_rows = torch.zeros(len(sizes), dtype=torch.int64,
                                       device=budget.demand_rows.device)

    def rows_at(self, level: int) -> list[int]:
        """Each group's block rows at `level` (the top level: as if the budget were E)."""
        top = level == len(self.budget.levels) - 1
        factor = float(self.num_experts) if top else self.budget.levels[level]
        return [budget_group_rows(factor, self.tokens, self.topk, size, self.num_experts)
                for size in self.sizes]

    @property
    def rows(self) -> list[int]:
        return self.rows_at(self.budget.level)

    def note(self, send_RK: torch.Tensor) -> None:
        """Record on the device the most rows this dispatch routes to one rank's group k."""
        torch.maximum(self.demand_rows, send_RK.max(dim=0).values, out=self.demand_rows)

    def fits(self, level: int, demand: Sequence[int]) -> bool:
        return all(rows >= wanted for rows, wanted in zip(self.rows_at(level), demand))

    def needed_factor(self, demand: Sequence[int]) -> float:
        """The least factor whose blocks hold `demand` (each group's most rows to one rank)."""
        return max(wanted * self.num_experts / (self.tokens * self.topk * size)
                   for size, wanted in zip(self.sizes, demand))


class BudgetFit:
    """When the fitted base budget changes (--moe-dispatch-budget-fit), from the factors the
    last `window` steps needed (`DispatchBudget.needed_factor`): after the first step; at
    once where a step needed more than the base (it overflowed: rerun); where the window needs
    less, once `FIT_SHRINK_STEPS` steps have passed since the last change."""

    def __init__(self, window: int):
        self.needs: collections.deque = collections.deque(maxlen=window)
        self.steps: collections.deque = collections.deque(maxlen=window)  # each need's step
        self.fitted = False
        self.steps_since = 0  # steps since the last change

    def observe(self, need: float, step: Optional[int] = None) -> None:
        self.needs.append(need)
        self.steps.append(step)
        self.steps_since += 1

    def keep_steps(self, steps: set) -> None:
        """The window keeps the needs of `steps` alone (where it has any; the path tuner's
        decision: the steps that ran the chosen path), and the base may shrink to them before
        the next step, without waiting `FIT_SHRINK_STEPS`: a candidate that needed more (the
        blocks of a layer in waves) no longer holds it up."""
        kept = [(need, step) for need, step in zip(self.needs, self.steps) if step in steps]
        if kept:
            self.needs.clear()
            self.steps.clear()
            for need, step in kept:
                self.needs.append(need)
                self.steps.append(step)
            self.steps_since = max(self.steps_since, FIT_SHRINK_STEPS)

    def target(self, top: float) -> float:
        """The window's most need plus the margin, on the grid, within [1, `top`]."""
        wanted = max(self.needs) * (1 + FIT_MARGIN)
        return min(top, max(1.0, math.ceil(wanted * FIT_GRID) / FIT_GRID))

    def due(self, base: float, top: float) -> Optional[float]:
        """The new base budget if it changes now (else None)."""
        if not self.needs:
            return None
        target = self.target(top)
        grow = self.needs[-1] > base
        shrink = (target * (1 + FIT_MARGIN) < base
                  and self.steps_since >= FIT_SHRINK_STEPS)
        if target == base or (self.fitted and not grow and not shrink):
            return None
        self.fitted, self.steps_since = True, 0
        return target

    def state(self) -> dict:
        return {"needs": list(self.needs), "fitted": self.fitted,
                "steps_since": self.steps_since}

    def load(self, state: dict) -> None:
        self.needs.extend(state["needs"])
        self.steps.extend([None] * len(state["needs"]))
        self.fitted, self.steps_since = state["fitted"], state["steps_since"]
