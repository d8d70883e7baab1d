"""A weight whose grad goes into an fp32 main grad: `into_main_grad`, the torch references' form
of the fused weight grads (the Triton kernels write the main grad themselves).

`into_main_grad(weight, main_grad)` is the weight itself in the forward; in the backward the
grad autograd computed for it (in the weight's dtype, summed over every use in the graph) is
added to `main_grad` and no grad reaches the weight. That is the add the grad buffers' hook
made (`training.optimizer.grads`), moved into the backward: the same values, the same bits.
"""

from __future__ import annotations

import torch


class _IntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, main_grad):
        ctx.main_grad = main_grad
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.main_grad.add_(grad)
        return None, None


def into_main_grad(weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """`weight`, whose grad is added to `main_grad` (fp32, weight's shape) instead."""
    if main_grad.shape != weight.shape or main_grad.dtype != torch.float32:
        raise ValueError(f"main grad {main_grad.dtype} {tuple(main_grad.shape)}: must be fp32 of "
                         f"the weight's shape {tuple(weight.shape)}")
    return _IntoMainGrad.apply(weight, main_grad)
