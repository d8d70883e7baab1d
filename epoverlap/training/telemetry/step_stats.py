"""The figures of a step every rank agrees on, from one reduction and one host read.

Owns `reduce_step_stats` and `StepStats`: the mean loss and aux loss over microbatches and
data-parallel ranks, the global grad norm (given as its square on the device, read with the
rest), the worst MoE layer's expert imbalance, the reason every rank stops after this step
(`training.loop.stop`: each rank's flags ride in the reduction), and the dispatch's tallies
(with a capacity, the routed pairs dropped; with the budget dispatch, the rows its fixed blocks sent
other ranks and the rows the dropless dispatch would have sent them). The expert biases are updated
from the reduced token counts here, since they need the same sums.

Each stage fills the slots of its layers (the last stage the loss) and adds its tallies, sums
them over its DP group, then over the pipeline: a layer's slot is one stage's, where the others
add 0, so every sum is exact. Floats and integers travel in two tensors (token counts stay
int64); the host reads them all at once, in float64, which holds both exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from epoverlap.parallel.watch import host_list
from epoverlap.training.loop.stop import REASONS, StopRequest

TALLIES = 3  # dropped pairs, budget rows sent, the dropless dispatch's rows


@dataclass
class StepStats:
    loss: float
    aux_loss: float
    load_imbalance: float
    stop_reason: Optional[str]
    dropped_tokens: int  # routed (token, expert) pairs over capacity, all ranks and MoE layers
    dropped_fraction: float  # of all routed pairs
    dispatch_wire: Optional[float]  # None: no fixed block crossed to another rank
    grad_norm: Optional[float] = None  # the global grad norm, where the step gave its square


def reduce_step_stats(cfg, groups, model, stop: Optional[StopRequest], losses: list,
                      norm_squared: Optional[torch.Tensor] = None) -> StepStats:
    """After the step's last backward: this step's figures, the same on every rank of `groups`
    (`stop`: this rank's reasons to stop, None outside the training loop; `norm_squared`: the
    global grad norm's square on the device, already agreed by every rank, read with the rest:
    one host read a step)."""
    t, num_layers = cfg.train, cfg.model.num_layers
    routers = model.routers()
    flags = stop.local_flags() if stop is not None else [0.0] * len(REASONS)
    # loss, aux of each layer, stop flags
    stats = torch.zeros(1 + num_layers + len(flags), device=groups.device)
    if any(flags):  # (most steps have none: no host-to-device copy then)
        stats[1 + num_layers:] = torch.tensor(flags)
    if any(loss is not None for loss in losses):
        stats[0] = torch.stack(losses).sum().float()
    num_experts = cfg.moe.num_experts or 0
    # token counts of each layer's experts, then the tallies
    ints = torch.zeros(num_layers * num_experts + TALLIES, dtype=torch.int64,
                       device=groups.device)
    counts = ints[:num_layers * num_experts].view(num_layers, num_experts)
    for router in routers:
        stats[1 + router.layer] = router.step_aux_loss.float()
        counts[router.layer] = router.step_counts
    _add_tallies(model.dispatch_budget, ints[-TALLIES:], routers)
    _sum_over_stages(groups, stats)
    _sum_over_stages(groups, ints)
    for router in routers:
        router.update_expert_bias(counts[router.layer])
    moe_layers = [layer for layer, is_moe in enumerate(cfg.moe_layer_pattern()) if is_moe]
    reads = torch.cat([stats[:1], stats[1:1 + num_layers].sum().view(1),
                       _worst_imbalance(counts, moe_layers).view(1), stats[1 + num_layers:]])
    norm = [] if norm_squared is None else [norm_squared.view(1)]
    values = host_list(torch.cat([*norm, reads.double(), ints[-TALLIES:].double()]))
    norm_read, (loss, aux, imbalance, *rest) = values[:len(norm)], values[len(norm):]
    stop, (dropped, sent, exact) = rest[:-TALLIES], rest[-TALLIES:]
    scale = 1.0 / (t.num_microbatches * groups.dp_size)
    routed = (groups.dp_size * t.num_microbatches * cfg.microbatch_tokens
              * cfg.moe.moe_router_topk * len(moe_layers))
    return StepStats(loss * scale, aux * scale, imbalance, StopRequest.agreed(stop),
                     int(dropped), dropped / routed if routed else 0.0,
                     sent / exact if sent and exact else None,
                     math.sqrt(norm_read[0]) if norm_read else None)


def _worst_imbalance(counts: torch.Tensor, moe_layers: list) -> torch.Tensor:
    """The most tokens any expert got over the mean, of the worst MoE layer (1 without one)."""
    if not moe_layers:
        return torch.ones((), device=counts.device)
    moe_counts = counts[moe_layers].float()
    return (moe_counts.amax(dim=1) / moe_counts.mean(dim=1).clamp(min=1e-9)).max()


def _add_tallies(budget, tallies: torch.Tensor, routers: list) -> None:
    """This rank's dropped pairs and budget rows, into `tallies` (on the device, no sync)."""
    for router in routers:
        tallies[0] += router.step_dropped
    if budget is not None:
        tallies[1:] += budget.wire_rows


def _sum_over_stages(groups, slots: torch.Tensor) -> None:
    """In place: sum over the stage's DP group, then over the pipeline."""
    if groups.dp_size > 1:
        groups.dp.all_reduce(slots)
    if groups.pp_size > 1:
        groups.pp.all_reduce(slots)
