"""Megatron-core call signatures for the routing ops, over either backend.

Owns the four entry points a Megatron-core user calls from `megatron.core.transformer.moe.
moe_utils`, with its parameter names, order and defaults (megatron-core 0.16.1):

  permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False)
      -> (permuted_tokens [N, H], permuted_probs [N] | None, row_id_map [T, E] int32)
  unpermute(permuted_tokens, sorted_indices, restore_shape=None, probs=None, routing_map=None,
            fused=False, drop_and_pad=False) -> [T, H]
  sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False)
      -> (output [N, H], permuted_probs [N] | None)
  topk_routing_with_score_function(logits, topk, use_pre_softmax=False, num_groups=None,
      group_topk=None, scaling_factor=None, score_function="softmax", expert_bias=None,
      fused=False, router_replay=None) -> (probs [T, E], routing_map [T, E] bool)

Each `*_entry(impl)` wraps one backend's shape-suffixed implementation (`permute_torch`,
`permute_triton`, ...); `megatron_entries(module)` wraps those of a backend module
(`reference` or `triton_ops`) for its `MoEOps` table, so the table of either backend answers
Megatron-core's calls, positional or by keyword.

Differences a caller can see, each stated where it applies:
- The third output of `permute` is our row-id map (token, expert) -> row, not Megatron-core's
  `sorted_indices` (row -> token). Pass it back to `unpermute` as Megatron-core does (its own
  fused path also hands a row-id map around); the permuted rows are the same, in the same order.
- `fused` is accepted and changes nothing: the backend chosen for the table is the
  implementation (there is no unfused fallback to pick).
- `drop_and_pad=True` (capacity-padded routing, `num_out_tokens` = experts x capacity) needs
  a routing map that gives every expert exactly `capacity` tokens, as megatron-core's router
  produces with `moe_pad_expert_input_to_capacity` (`capacity.apply_router_token_dropping`);
  the rows are then megatron-core's, in its order. Another map raises ValueError on the CPU
  and fails a device assert on CUDA (megatron-core would silently truncate or pad it).
- A non-None `router_replay` raises ValueError: epoverlap has no routing replay.
- `restore_shape` may be left out (the row-id map knows the token count); when given, it is
  checked against the map.
- A tensor `num_out_tokens` (Megatron-core's dispatchers pass `tokens_per_expert.sum()`) is
  read to the host once, as Megatron-core's own masked_select does; an int never syncs.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def check_padded_routing_map(routing_map_TE: torch.Tensor, num_out_tokens: int) -> None:
    """drop_and_pad: every expert must hold exactly num_out_tokens / experts tokens (no sync on
    CUDA: a device assert)."""
    num_experts = routing_map_TE.shape[1]
    if num_out_tokens % num_experts:
        raise ValueError(f"permute: drop_and_pad=True needs num_out_tokens={num_out_tokens} to "
                         f"be experts x capacity ({num_experts} experts)")
    capacity = num_out_tokens // num_experts
    exact = (routing_map_TE.sum(dim=0) == capacity).all()
    msg = (f"permute: drop_and_pad=True needs a routing map with exactly capacity={capacity} "
           f"tokens per expert (moe_pad_expert_input_to_capacity routing)")
    if routing_map_TE.is_cuda:
        torch._assert_async(exact, msg)
    elif not bool(exact):
        raise ValueError(msg)


def _host_count(num_out_tokens) -> Optional[int]:
    if isinstance(num_out_tokens, torch.Tensor):
        return int(num_out_tokens.item())
    return None if num_out_tokens is None else int(num_out_tokens)


def permute_entry(permute_impl: Callable) -> Callable:
    """Megatron-core's `permute` over `permute_impl(tokens_TH, routing_map_TE, probs_TE, n)`."""

    def permute(tokens: torch.Tensor, routing_map: torch.Tensor,
                probs: Optional[torch.Tensor] = None, num_out_tokens=None, fused: bool = False,
                drop_and_pad: bool = False):
        """Group token copies by expert (Megatron-core signature; see `megatron_api`)."""
        del fused
        count = _host_count(num_out_tokens)
        if drop_and_pad and count is not None:
            check_padded_routing_map(routing_map, count)
        return permute_impl(tokens, routing_map, probs, count)

    return permute


def unpermute_entry(unpermute_impl: Callable) -> Callable:
    """Megatron-core's `unpermute` over `unpermute_impl(rows_NH, row_id_map_TE, shape, probs)`."""

    def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                  restore_shape: Optional[torch.Size] = None,
                  probs: Optional[torch.Tensor] = None,
                  routing_map: Optional[torch.Tensor] = None, fused: bool = False,
                  drop_and_pad: bool = False) -> torch.Tensor:
        """Sum each token's rows, weighted by `probs` [T, E] if given (Megatron-core signature).

        `sorted_indices` is the row-id map `permute` returned; `routing_map` is accepted and
        unused (the map holds it), and so is `drop_and_pad` (the map covers padded rows too).
        """
        del fused, routing_map, drop_and_pad
        return unpermute_impl(permuted_tokens, sorted_indices, restore_shape, probs)

    return unpermute


def sort_chunks_entry(sort_impl: Callable) -> Callable:
    """Megatron-core's `sort_chunks_by_idxs` over `sort_impl(rows_NH, sizes_C, idxs_C, probs_N)`."""

    def sort_chunks_by_idxs(input: torch.Tensor, split_sizes: torch.Tensor,  # noqa: A002
                            sorted_idxs: torch.Tensor, probs: Optional[torch.Tensor] = None,
                            fused: bool = False):
        """Output chunk j = input chunk sorted_idxs[j] (Megatron-core signature)."""
        del fused
        return sort_impl(input, split_sizes, sorted_idxs, probs)

    return sort_chunks_by_idxs


def topk_routing_entry(router_impl: Callable) -> Callable:
    """Megatron-core's `topk_routing_with_score_function` over `router_impl(logits_TE, k, **kw)`."""

    def topk_routing_with_score_function(
            logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
            num_groups: Optional[int] = None, group_topk: Optional[int] = None,
            scaling_factor: Optional[float] = None, score_function: str = "softmax",
            expert_bias: Optional[torch.Tensor] = None, fused: bool = False,
            router_replay=None):
        """Route: logits [T, E] -> (probs [T, E], routing_map [T, E] bool) (Megatron-core
        signature)."""
        del fused
        if router_replay is not None:
            raise ValueError("topk_routing_with_score_function: router_replay is not supported "
                             "(epoverlap has no routing replay); pass router_replay=None")
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_tokens, num_experts], got shape "
                             f"{tuple(logits.shape)}")
        return router_impl(logits, topk, score_function=score_function,
                           use_pre_softmax=use_pre_softmax, num_groups=num_groups,
                           group_topk=group_topk, scaling_factor=scaling_factor,
                           expert_bias=expert_bias)

    return topk_routing_with_score_function


def megatron_entries(backend_module) -> dict[str, Callable]:
    """The four entry points over `backend_module`'s permute, unpermute, sort_chunks_by_idxs
    and router_topk, by their Megatron-core names."""
    return {
        "permute": permute_entry(backend_module.permute),
        "unpermute": unpermute_entry(backend_module.unpermute),
        "sort_chunks_by_idxs": sort_chunks_entry(backend_module.sort_chunks_by_idxs),
        "topk_routing_with_score_function": topk_routing_entry(backend_module.router_topk),
    }
