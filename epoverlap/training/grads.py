"""Gradient buffers: fp32 `main_grad` per parameter, reduction over the right group, clipping.

Owns `GradBuffers`. Every parameter gets `param.main_grad`, a view into one flat fp32 buffer
for dense parameters and one for expert parameters. The deferrable GEMMs accumulate their
weight grads there directly; every other parameter's autograd `.grad` is folded in by a
post-accumulate hook and released. Reduction happens once per step, after the last backward
and the last weight-grad action:
  dense:  sum over all ranks (data parallel = the world), divided by the world size;
  expert: sum over the expert-data-parallel group, divided by the world size (each EP rank's
          expert grad already sums the contributions of its whole EP group).
The global grad norm counts replicated parameters once and sums the expert shards over EP.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from epoverlap.parallel.groups import ParallelGroups


def _fold_into_main_grad(param: torch.Tensor) -> None:
    if param.grad is None:  # a deferrable GEMM already wrote main_grad and returned no grad
        return
    param.main_grad.add_(param.grad)
    param.grad = None


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "is_expert", False)


class GradBuffers:
    """Flat fp32 grad buffers for a model's dense and expert parameters."""

    def __init__(self, model: nn.Module, groups: ParallelGroups):
        self.groups = groups
        params = [p for p in model.parameters() if p.requires_grad]
        self.dense = [p for p in params if not is_expert(p)]
        self.expert = [p for p in params if is_expert(p)]
        device = params[0].device
        self.dense_flat = self._attach(self.dense, device)
        self.expert_flat = self._attach(self.expert, device)
        self._hooks = [p.register_post_accumulate_grad_hook(_fold_into_main_grad)
                       for p in params]

    @staticmethod
    def _attach(params: list, device) -> torch.Tensor:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        offset = 0
        for p in params:
            p.main_grad = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        return flat

    def zero(self) -> None:
        self.dense_flat.zero_()
        self.expert_flat.zero_()

    def reduce(self) -> None:
        """Average over data-parallel replicas (see the module docstring for the scaling)."""
        world = self.groups.world_size
        if world == 1:
            return
        self.groups.world.all_reduce(self.dense_flat)
        if self.expert_flat.numel():
            if self.groups.edp_size > 1:
                self.groups.edp.all_reduce(self.expert_flat)
            self.expert_flat.div_(world)
        self.dense_flat.div_(world)

    def global_norm(self) -> float:
        """L2 norm of the whole (global) gradient. Collective over the EP group."""
        expert_sq = self.expert_flat.pow(2).sum()
        if self.groups.ep_size > 1:
            self.groups.ep.all_reduce(expert_sq)
        return math.sqrt(float(self.dense_flat.pow(2).sum() + expert_sq))

    def clip(self, max_norm: float) -> float:
        """Scale grads so the global norm is at most max_norm (0 disables). Returns the norm."""
        norm = self.global_norm()
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            self.dense_flat.mul_(scale)
            self.expert_flat.mul_(scale)
        return norm

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
