"""Token permute / unpermute for dropless MoE dispatch: torch reference implementations.

Owns the row-id map format shared by every backend, and the differentiable torch references
`permute_torch` / `unpermute_torch` with Megatron-core's signatures.

Row-id map: int32 [T, E]; entry (t, e) is the row of the permuted tensor that holds token t's
copy for expert e, or -1 when t is not routed to e. Rows are expert-major (all rows of expert
0, then expert 1, ...) and ascending by source token within an expert. Because rows are
expert-major, a token's rows ascend with the expert index: walking them in row order is walking
them in expert order, which fixes the summation order of unpermute (deterministic, no atomics).

Shape legend: T tokens, E experts, H hidden, N permuted rows (= num_out_tokens, T*k dropless),
K the most rows any token has.

Every function here is deterministic. `build_row_id_map` and `permute_torch` never sync the
host when `num_out_tokens` is given; `unpermute_torch` syncs once (K is data dependent), which
is why the Triton backend, not this one, is the graph-safe default on GPU.
"""

from __future__ import annotations

from typing import Optional

import torch


def build_row_id_map(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """[T, E] bool routing map -> [T, E] int32 row-id map (see module docstring)."""
    routed_ET = routing_map_TE.bool().t()
    dest_ET = torch.cumsum(routed_ET.reshape(-1).to(torch.int32), 0, dtype=torch.int32) - 1
    row_id_map_ET = torch.where(routed_ET.reshape(-1), dest_ET, -1).view(routed_ET.shape)
    return row_id_map_ET.t().contiguous()


def check_num_out_tokens(row_id_map_TE: torch.Tensor, num_out_tokens: int) -> None:
    """Fail clearly when the map routes more rows than `num_out_tokens` (never write past N).

    On CPU this raises ValueError; on CUDA it is a device-side assert (no host sync).
    """
    num_routed = (row_id_map_TE >= 0).sum()
    msg = (f"permute: routing map routes more (token, expert) pairs than num_out_tokens="
           f"{num_out_tokens}; refusing to write out of bounds")
    if row_id_map_TE.is_cuda:
        torch._assert_async(num_routed <= num_out_tokens, msg)
    elif int(num_routed) > num_out_tokens:
        raise ValueError(f"{msg} (routed {int(num_routed)})")


def _row_sources(row_id_map_TE: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each permuted row: its flat (t * E + e) entry and whether the row is used. [N], [N]."""
    dest_flat = row_id_map_TE.reshape(-1).long()
    slot = torch.where(dest_flat >= 0, dest_flat, num_rows)  # unrouted pairs go to a dump slot
    flat_entry_N = torch.zeros(num_rows + 1, dtype=torch.long, device=row_id_map_TE.device)
    flat_entry_N.scatter_(0, slot, torch.arange(dest_flat.numel(), device=dest_flat.device))
    num_routed = (dest_flat >= 0).sum()
    row_used_N = torch.arange(num_rows, device=row_id_map_TE.device) < num_routed
    return flat_entry_N[:num_rows], row_used_N


def _token_rows(row_id_map_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, its rows in expert order and their experts, padded with -1: [T, K], [T, K]."""
    big = torch.iinfo(torch.int32).max
    keys_TE = torch.where(row_id_map_TE >= 0, row_id_map_TE, big)
    rows_TE, experts_TE = torch.sort(keys_TE, dim=1, stable=True)
    max_rows = int((row_id_map_TE >= 0).sum(dim=1).max()) if row_id_map_TE.numel() else 0
    rows_TK = rows_TE[:, :max_rows]
    return torch.where(rows_TK == big, -1, rows_TK), experts_TE[:, :max_rows]


def _gather_rows(src_RH: torch.Tensor, index: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """src[index] with rows where `keep` is False set to zero."""
    out = src_RH.index_select(0, index.clamp(min=0).reshape(-1)).view(*index.shape, src_RH.shape[1])
    return torch.where(keep.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))


def _unpermute_rows(permuted_NH, row_id_map_TE, merging_probs_TE=None):
    """Sum each token's rows (times its merging prob) in fixed expert order, fp32 accumulation."""
    num_tokens = row_id_map_TE.shape[0]
    rows_TK, experts_TK = _token_rows(row_id_map_TE)
    out_TH = torch.zeros(num_tokens, permuted_NH.shape[1], dtype=torch.float32,
                         device=permuted_NH.device)
    for slot in range(rows_TK.shape[1]):
        row_T = rows_TK[:, slot]
        contrib_TH = _gather_rows(permuted_NH, row_T, row_T >= 0).float()
        if merging_probs_TE is not None:
            prob_T = merging_probs_TE.gather(1, experts_TK[:, slot:slot + 1]).float()
            contrib_TH = contrib_TH * prob_T
        out_TH = out_TH + contrib_TH
    return out_TH.to(permuted_NH.dtype)


def _permute_rows(tokens_TH, row_id_map_TE, num_rows, probs_TE=None):
    """Copy each token to its rows; rows past the routed count are zero. -> [N, H], [N] | None."""
    flat_entry_N, row_used_N = _row_sources(row_id_map_TE, num_rows)
    num_experts = row_id_map_TE.shape[1]
    permuted_NH = _gather_rows(tokens_TH, flat_entry_N // num_experts, row_used_N)
    permuted_probs_N = None
    if probs_TE is not None:
        picked_N = probs_TE.reshape(-1).index_select(0, flat_entry_N)
        permuted_probs_N = torch.where(row_used_N, picked_N, torch.zeros_like(picked_N))
    return permuted_NH, permuted_probs_N


class _PermuteTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens_TH, probs_TE, row_id_map_TE, num_rows):
        ctx.save_for_backward(row_id_map_TE)
        ctx.probs_dtype = None if probs_TE is None else probs_TE.dtype
        return _permute_rows(tokens_TH, row_id_map_TE, num_rows, probs_TE)

    @staticmethod
    def backward(ctx, grad_permuted_NH, grad_permuted_probs_N):
        (row_id_map_TE,) = ctx.saved_tensors
        grad_tokens_TH = _unpermute_rows(grad_permuted_NH, row_id_map_TE)
        grad_probs_TE = None
        if ctx.probs_dtype is not None and grad_permuted_probs_N is not None:
            grad_probs_TE = _gather_rows(grad_permuted_probs_N.unsqueeze(1), row_id_map_TE,
                                         row_id_map_TE >= 0).squeeze(-1).to(ctx.probs_dtype)
        return grad_tokens_TH, grad_probs_TE, None, None


class _UnpermuteTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted_NH, merging_probs_TE, row_id_map_TE):
        ctx.save_for_backward(permuted_NH, merging_probs_TE, row_id_map_TE)
        return _unpermute_rows(permuted_NH, row_id_map_TE, merging_probs_TE)

    @staticmethod
    def backward(ctx, grad_out_TH):
        permuted_NH, merging_probs_TE, row_id_map_TE = ctx.saved_tensors
        num_rows = permuted_NH.shape[0]
        grad_rows_NH, probs_N = _permute_rows(grad_out_TH, row_id_map_TE, num_rows,
                                              merging_probs_TE)
        grad_probs_TE = None
        if merging_probs_TE is not None:
            dot_N = (grad_rows_NH.float() * permuted_NH.float()).sum(dim=1, keepdim=True)
            grad_probs_TE = _gather_rows(dot_N, row_id_map_TE, row_id_map_TE >= 0).squeeze(-1)
            grad_probs_TE = grad_probs_TE.to(merging_probs_TE.dtype)
            grad_rows_NH = (grad_rows_NH.float() * probs_N.float().unsqueeze(1)).to(
                grad_out_TH.dtype)
        return grad_rows_NH, grad_probs_TE, None


def permute_torch(
    tokens_TH: torch.Tensor,
    routing_map_TE: torch.Tensor,
    probs_TE: Optional[torch.Tensor] = None,
    num_out_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Group token copies by expert. -> (permuted [N, H], permuted_probs [N] | None, row_id_map).

    N = num_out_tokens (the routed count when None, which syncs the host). Differentiable in
    tokens and probs; the backward is an unpermute.
    """
    row_id_map_TE = build_row_id_map(routing_map_TE)
    if num_out_tokens is None:
        num_out_tokens = int(routing_map_TE.sum())
    check_num_out_tokens(row_id_map_TE, num_out_tokens)
    permuted_NH, permuted_probs_N = _PermuteTorch.apply(tokens_TH, probs_TE, row_id_map_TE,
                                                        num_out_tokens)
    return permuted_NH, permuted_probs_N, row_id_map_TE


def unpermute_torch(
    permuted_NH: torch.Tensor,
    row_id_map_TE: torch.Tensor,
    restore_shape: Optional[torch.Size] = None,
    probs: Optional[torch.Tensor] = None,
    routing_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Inverse of permute: each token sums its rows, weighted by `probs` [T, E] if given. -> [T, H].

    `routing_map` is accepted for Megatron-core signature compatibility; the row-id map already
    holds it. Differentiable in permuted rows and probs.
    """
    del routing_map
    num_tokens = row_id_map_TE.shape[0]
    if restore_shape is not None and tuple(restore_shape)[0] != num_tokens:
        raise ValueError(f"restore_shape={tuple(restore_shape)} does not match the row-id map's "
                         f"{num_tokens} tokens")
    return _UnpermuteTorch.apply(permuted_NH, probs, row_id_map_TE)
