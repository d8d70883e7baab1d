"""--check-for-nan-in-loss-and-grad: find a NaN/Inf loss or gradient on this rank before the
gradients are reduced (so the rank where it appeared is known), agree over the world, and stop
the step before the optimizer, the expert biases or anything else is updated.

Owns `check_finite`. Costs one host sync and, with more than one rank, one small all-reduce per
step; the parameter-by-parameter search and the gather of messages run only after a failure.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from epoverlap.errors import NonFiniteError
from epoverlap.parallel.groups import ParallelGroups
from epoverlap.parallel.watch import host_list
from epoverlap.training.optimizer.grads import GradBuffers


def _local_problem(losses: Sequence[Optional[torch.Tensor]], model: nn.Module,
                   grads: GradBuffers) -> Optional[str]:
    """What is non-finite on this rank (checked in this order: loss, then grads), or None.
    A pipeline stage without the loss head has None losses."""
    own = [(mb, loss) for mb, loss in enumerate(losses) if loss is not None]
    flats = [f for f in (grads.dense_flat, grads.expert_flat) if f.numel()]
    checks = [torch.isfinite(loss.float()).reshape(1) for _, loss in own] + \
        [torch.isfinite(flat).all().reshape(1) for flat in flats]
    finite = host_list(torch.cat(checks)) if checks else []
    if all(finite):  # the one host sync of a clean step
        return None
    bad_losses = [mb for (mb, _), ok in zip(own, finite) if not ok]
    if bad_losses:
        return f"NaN/Inf in the loss of microbatch(es) {bad_losses}"
    bad = [name for name, p in model.named_parameters()
           if p.requires_grad and not bool(torch.isfinite(p.main_grad).all())]
    return f"NaN/Inf in the gradient of {bad[0]} (first of {len(bad)} parameter(s))"


def check_finite(step: int, losses: Sequence[torch.Tensor], model: nn.Module,
                 grads: GradBuffers, groups: ParallelGroups) -> None:
    """Raise NonFiniteError on every rank if any rank has a non-finite loss or gradient."""
    problem = _local_problem(losses, model, grads)
    problems = [problem]
    if groups.world_size > 1:
        flag = torch.tensor([0.0 if problem is None else 1.0], device=groups.device)
        groups.world.all_reduce(flag, op=dist.ReduceOp.MAX)
        if host_list(flag)[0] == 0:
            return
        problems = [None] * groups.world_size
        groups.world.all_gather_object(problems, problem)
    elif problem is None:
        return
    where = "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(problems)
                      if text is not None)
    raise NonFiniteError(f"step {step}: {where}; stopped before the optimizer step "
                         f"(optimizer state unchanged)")
