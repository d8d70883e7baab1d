"""RMSNorm: the torch reference `rms_norm_torch` (the model's formula, unchanged).

Shape legend: T rows (all leading dims of x flattened), H hidden.

y = (x32 * rsqrt(mean(x32^2, -1) + eps)).to(x.dtype) * weight, with x32 = x.float(): the
normalisation in fp32, the weight applied in x's dtype (so y has x's dtype when weight does).
Differentiable in x and weight through autograd; deterministic.
"""

from __future__ import annotations

import torch


def rms_norm_torch(x_TH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H] -> y [..., H]."""
    x32_TH = x_TH.float()
    normed_TH = x32_TH * torch.rsqrt(x32_TH.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed_TH.to(x_TH.dtype) * weight_H
