"""Expert capacity and token dropping with Megatron-core's semantics (megatron-core 0.16.1).

Owns `get_capacity` and `apply_router_token_dropping`, with the parameter names, order and
defaults of `megatron.core.transformer.moe.moe_utils`, and `dropped_pairs`, the count the
trainer logs. One implementation serves both kernel backends: it is a top-k over tokens and a
scatter, static in shape (k = the capacity, a host int computed from shapes only), so it runs
inside CUDA graphs and syncs no host.

Semantics (as megatron-core's router applies them after top-k routing):
  capacity = ceil(num_tokens * topk / num_experts * capacity_factor)  [get_capacity]
  keep, per expert, `capacity` tokens: those with the highest probs (policy "probs") or the
  routed ones found first by a top-k over the routing map (policy "position"); when the
  capacity exceeds the token count, every token fits.
  pad_to_capacity=False: final map = routed AND kept; pad_to_capacity=True: final map = kept,
  so every expert gets exactly `capacity` tokens, routed or not (the unrouted ones carry
  prob 0: they cost expert FLOPs but change no output), which makes every split size static.
  final probs = probs * final map.
Ties in the top-k are broken by `torch.topk` itself, exactly as megatron-core calls it, so
both pick the same tokens on the same device.

Shape legend: T tokens, E experts.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

DROP_POLICIES = ("probs", "position")


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float,
                 min_capacity: Optional[int] = None) -> int:
    """Rows each expert takes: ceil(num_tokens / num_experts * capacity_factor), at least
    `min_capacity` when given. `num_tokens` counts (token, expert) pairs: tokens x topk."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    return capacity if min_capacity is None else max(capacity, min_capacity)


def _kept_by_capacity(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, capacity: int,
                      drop_policy: str) -> torch.Tensor:
    """[T, E] bool: the `capacity` tokens each expert keeps under `drop_policy`."""
    num_tokens = probs_TE.shape[0]
    if capacity > num_tokens:
        return torch.ones_like(routing_map_TE, dtype=torch.bool)
    if drop_policy == "probs":
        scores_TE = probs_TE
    elif drop_policy == "position":
        scores_TE = routing_map_TE.int()
    else:
        raise ValueError(f"drop_policy {drop_policy!r}: allowed {', '.join(DROP_POLICIES)}")
    _, kept_CE = torch.topk(scores_TE, k=capacity, dim=0, sorted=False)
    return torch.zeros_like(probs_TE).scatter(0, kept_CE, 1).bool()


def apply_router_token_dropping(routing_probs: torch.Tensor, routing_map: torch.Tensor,
                                router_topk: int, capacity_factor: float,
                                drop_policy: str = "probs", pad_to_capacity: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Enforce the expert capacity on routed (probs [T, E], routing_map [T, E] bool).

    -> (final_probs [T, E], final_map [T, E] bool), see the module docstring.
    Differentiable in `routing_probs` (a multiplication by the final map).
    """
    if routing_probs.dim() != 2 or routing_map.dim() != 2:
        raise ValueError(f"routing_probs and routing_map must be [tokens, experts], got "
                         f"{tuple(routing_probs.shape)} and {tuple(routing_map.shape)}")
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    kept_TE = _kept_by_capacity(routing_probs, routing_map, capacity, drop_policy)
    final_map_TE = kept_TE if pad_to_capacity else torch.logical_and(routing_map, kept_TE)
    return routing_probs * final_map_TE, final_map_TE


def dropped_pairs(routing_map_TE: torch.Tensor, final_map_TE: torch.Tensor) -> torch.Tensor:
    """Routed (token, expert) pairs the capacity dropped: 0-d int64 on the device (no sync)."""
    return torch.logical_and(routing_map_TE, ~final_map_TE).sum(dtype=torch.int64)
