"""Chunk sort after the dispatch all-to-all: torch reference `sort_chunks_by_idxs_torch`.

Rows arrive grouped in chunks (source rank, local expert); the experts want them grouped
(local expert, source rank), and the combine wants them back. `sort_chunks_by_idxs` moves
whole chunks: output chunk j is input chunk sorted_idxs[j].

Shape legend: N rows, H hidden, C chunks.

Split sizes are device tensors and nothing here syncs the host: the output has as many rows as
the input (static), and the row permutation is computed on device. Deterministic (a gather
forward, the inverse gather backward).
"""

from __future__ import annotations

from typing import Optional

import torch


def chunk_sort_source_rows(split_sizes_C: torch.Tensor, sorted_idxs_C: torch.Tensor,
                           num_rows: int) -> torch.Tensor:
    """Output row -> input row for moving chunks into `sorted_idxs` order. [N] int64.

    Rows past sum(split_sizes) (if any) map to themselves.
    """
    device = split_sizes_C.device
    sizes_C = split_sizes_C.to(torch.int64)
    sorted_idxs_C = sorted_idxs_C.to(device=device, dtype=torch.int64)
    in_start_C = torch.cumsum(sizes_C, 0) - sizes_C
    out_sizes_C = sizes_C.index_select(0, sorted_idxs_C)
    out_start_C = torch.cumsum(out_sizes_C, 0) - out_sizes_C
    total = sizes_C.sum()
    out_row_N = torch.arange(num_rows, device=device)
    # Which output chunk each output row falls in (rows past the total land in the last one).
    out_chunk_N = torch.searchsorted(torch.cumsum(out_sizes_C, 0), out_row_N, right=True)
    out_chunk_N = out_chunk_N.clamp(max=max(sorted_idxs_C.numel() - 1, 0))
    src_chunk_N = sorted_idxs_C.index_select(0, out_chunk_N)
    src_row_N = in_start_C.index_select(0, src_chunk_N) + out_row_N - out_start_C.index_select(
        0, out_chunk_N)
    return torch.where(out_row_N < total, src_row_N, out_row_N)


def _invert(perm_N: torch.Tensor) -> torch.Tensor:
    inverse_N = torch.empty_like(perm_N)
    inverse_N.scatter_(0, perm_N, torch.arange(perm_N.numel(), device=perm_N.device))
    return inverse_N


class _GatherRows(torch.autograd.Function):
    """out = x[src_rows]; src_rows is a permutation, so the backward is the inverse gather."""

    @staticmethod
    def forward(ctx, x, src_rows_N):
        ctx.save_for_backward(src_rows_N)
        return x.index_select(0, src_rows_N)

    @staticmethod
    def backward(ctx, grad_out):
        (src_rows_N,) = ctx.saved_tensors
        return grad_out.index_select(0, _invert(src_rows_N)), None


def sort_chunks_by_idxs_torch(
    input_NH: torch.Tensor,
    split_sizes_C: torch.Tensor,
    sorted_idxs_C: torch.Tensor,
    probs_N: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reorder chunks of rows: output chunk j = input chunk sorted_idxs[j]. -> (rows, probs).

    split_sizes [C] and sorted_idxs [C] may live on the device. Differentiable in input and
    probs.
    """
    if split_sizes_C.numel() != sorted_idxs_C.numel():
        raise ValueError(f"split_sizes has {split_sizes_C.numel()} chunks but sorted_idxs has "
                         f"{sorted_idxs_C.numel()}")
    src_rows_N = chunk_sort_source_rows(split_sizes_C.to(input_NH.device),
                                        sorted_idxs_C, input_NH.shape[0])
    out_NH = _GatherRows.apply(input_NH, src_rows_N)
    out_probs_N = None if probs_N is None else _GatherRows.apply(probs_N, src_rows_N)
    return out_NH, out_probs_N
