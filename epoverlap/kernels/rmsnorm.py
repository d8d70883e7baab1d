"""RMSNorm: the torch reference `rms_norm_torch` (the model's formula, unchanged).

Shape legend: T rows (all leading dims of x flattened), H hidden.

y = (x32 * rsqrt(mean(x32^2, -1) + eps)).to(x.dtype) * weight, with x32 = x.float(): the
normalisation in fp32, the weight applied in x's dtype (so y has x's dtype when weight does).
Differentiable in x and weight through autograd; deterministic. With `main_grad` the weight's
grad is added to it in the backward instead (`main_grad.into_main_grad`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .main_grad import into_main_grad


def rms_norm_torch(x_TH: torch.Tensor, weight_H: torch.Tensor, eps: float,
                   main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H] -> y [..., H]; with `main_grad`
    (fp32 [H]) the weight's grad is added there."""
    if main_grad is not None:
        weight_H = into_main_grad(weight_H, main_grad)
    x32_TH = x_TH.float()
    normed_TH = x32_TH * torch.rsqrt(x32_TH.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed_TH.to(x_TH.dtype) * weight_H
