"""Rotary position embedding: the torch reference `rotary_torch` (the model's formula).

Shape legend: B batch, N heads, S sequence, D head dim, D2 = D / 2.

GPT-NeoX half rotation: x1, x2 = the two halves of each head; in fp32,
y = cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin]).to(x.dtype). cos / sin [S, D2] fp32
broadcast over B and N. Differentiable through autograd; deterministic.
"""

from __future__ import annotations

import torch


def rotary_torch(x_BNSD: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor
                 ) -> torch.Tensor:
    """Rotate the two halves of each head of x [B, N, S, D] by the angles of cos/sin [S, D2]."""
    x1_BNSD2, x2_BNSD2 = x_BNSD.float().chunk(2, dim=-1)
    rotated_BNSD = torch.cat([x1_BNSD2 * cos_SD2 - x2_BNSD2 * sin_SD2,
                              x2_BNSD2 * cos_SD2 + x1_BNSD2 * sin_SD2], dim=-1)
    return rotated_BNSD.to(x_BNSD.dtype)
