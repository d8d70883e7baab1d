"""`make_dispatcher`: the one place a dispatcher is put together from the configuration's two
choices (`DispatchMode.sizing`, `.routing`): the sizing's class holding the routing's strategy
(`_DISPATCHERS`); the pairs refused are `config.dispatch_rules`'s.
"""

from __future__ import annotations

from typing import Optional

import torch

from epoverlap.config.dispatch import DispatchMode
from epoverlap.config.dispatch_rules import DispatchChoice, why_refused
from epoverlap.kernels import MoEOps
from epoverlap.model.budget import ByHostBudget, DispatchBudget
from epoverlap.model.dispatch.base import TokenDispatcher
from epoverlap.model.dispatch.by_host import ByHostBudgetDispatcher, ByHostDispatcher
from epoverlap.model.dispatch.routing import ROUTINGS
from epoverlap.model.dispatch.sizing import (BudgetDispatcher, HostSplitDispatcher,
                                                 PaddedCapacityDispatcher)
from epoverlap.parallel.comm import ExpertComm


_DISPATCHERS = {  # (how rows are sized, how they are routed) -> the sizing's class
    ("host_splits", "per_expert"): HostSplitDispatcher,
    ("padded", "per_expert"): PaddedCapacityDispatcher,
    ("budget", "per_expert"): BudgetDispatcher,
    ("host_splits", "per_rank"): HostSplitDispatcher,
    ("budget", "per_rank"): BudgetDispatcher,
    ("host_splits", "per_host"): ByHostDispatcher,  # both stages sized with their routing
    ("budget", "per_host"): ByHostBudgetDispatcher,
}  # a padded capacity routed once per rank or host is refused (`dispatch_rules.RULES`)


def make_dispatcher(comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                    device: torch.device, mode: DispatchMode = DispatchMode(),
                    budget: Optional[DispatchBudget] = None) -> TokenDispatcher:
    """The dispatcher of `mode`'s two choices, how rows are sized and how they are routed
    (`DispatchMode.sizing`, `.routing`), built once per model and shared by its MoE layers (it
    keeps no per-layer state). `budget`: the model's `DispatchBudget`, in budget mode only.
    Once per rank on one EP rank is the plain dispatch. By host: over `comm.by_host`."""
    if (mode.sizing == "budget") != (budget is not None):
        raise ValueError(f"dispatch mode {mode.name} with budget {budget}")
    if (mode.sizing, mode.routing) not in _DISPATCHERS:
        raise ValueError(f"dispatch {mode.sizing} {mode.routing}: " + why_refused(
            DispatchChoice(sizing=mode.sizing, routing=mode.routing)))
    routing = "per_expert" if mode.routing == "per_rank" and comm.size == 1 else mode.routing
    sizing = _DISPATCHERS[(mode.sizing, routing)]
    if mode.once_per_rank and comm.size > 1 and budget is not None and budget.pairs is None:
        raise ValueError("dispatch once per rank with a budget that does not budget the "
                         "experts' rows (DispatchBudget pairs_per_dispatch)")
    if routing == "per_host" and comm.by_host is None:
        raise ValueError("dispatch by host needs the communicators between and inside hosts")
    if routing == "per_host" and budget is not None and not isinstance(budget, ByHostBudget):
        raise ValueError("dispatch by host with a budget that does not size its stages "
                         "(model.budget.ByHostBudget)")
    dispatcher = sizing(comm, num_experts, topk, ops, device, mode, budget,
                        routing=ROUTINGS[routing](comm, num_experts, topk, ops))
    if dispatcher.reads_host != mode.dispatch_syncs_host:
        raise AssertionError(f"{sizing.__name__} disagrees with the config on host reads")
    return dispatcher
