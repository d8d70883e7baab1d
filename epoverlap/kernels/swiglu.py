"""SwiGLU activation, optionally scaled by routing probs: the torch reference `swiglu_torch`.

Shape legend: M rows (tokens routed to this rank's experts, or tokens of a dense MLP),
F ffn width (h holds [gate | up], 2F wide).

In fp32: act = silu(gate) * up [* probs[:, None]], returned in h's dtype (the expert formula of
epoverlap.model.moe). M may be 0. Differentiable in h and probs through autograd; deterministic.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def swiglu_torch(h_M2F: torch.Tensor, probs_M: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h [M, 2F] = [gate | up] (probs [M] or None) -> act [M, F] in h's dtype."""
    gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
    act_MF = F.silu(gate_MF.float()) * up_MF.float()
    if probs_M is not None:
        act_MF = act_MF * probs_M.float().unsqueeze(-1)
    return act_MF.to(h_M2F.dtype)
