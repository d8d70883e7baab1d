"""Chunk sort after the dispatch all-to-all, in Triton: `sort_chunks_by_idxs_triton`.

Owns the drop-in replacement of `sort_chunks.sort_chunks_by_idxs_torch` (same arguments and
outputs: output chunk j is input chunk sorted_idxs[j]) and its two kernels:
  `_chunk_src_rows_kernel`: output row -> input row [N] int32 from the device split sizes (each
    program finds its rows' chunks by comparing with the running chunk ends, C in tiles).
  `_move_rows_kernel`: a 2-D tiled row copy, gather (forward) or scatter (backward) by that map;
    the probs [N] ride along.

Shape legend: N rows, H hidden, C chunks.

No host sync on CUDA, static shapes (N rows in, N rows out), deterministic (pure copies).
Rows past sum(split_sizes) stay in place. A split-size total above N is reported (on CUDA by a
device assert in `_chunk_src_rows_kernel`, no extra launch; on CPU by a ValueError) and never
read or written past N. Launches: forward 2, backward 1.
Loops with run-time bounds are `while` loops (see permutation_triton.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached
from . import triton_utils
from .triton_utils import (DEVICE_ASSERT_OPTIONS, cdiv, check_int32_rows, copy_config, next_pow2,
                           rows_per_copy_program)


@launch_cached
@triton.jit(do_not_specialize=["N"])  # row counts vary per step: one variant
def _chunk_src_rows_kernel(
    split_sizes_ptr,  # [C] int in: rows of input chunk c (device tensor)
    sorted_idxs_ptr,  # [C] int in: output chunk j is input chunk sorted_idxs[j]
    src_rows_ptr,     # [N] int32 out: input row of output row r (r itself past the total)
    total_ptr,        # [1] int32 out: sum of the split sizes (written by program 0)
    C, N,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    CHECK_N: tl.constexpr,  # device-assert sum(split_sizes) <= N (CUDA)
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    chunk = tl.zeros((BLOCK_R,), dtype=tl.int32)      # output chunk holding row r
    out_start = tl.zeros((BLOCK_R,), dtype=tl.int32)  # its first output row
    running = tl.zeros((), dtype=tl.int32)
    c0 = 0
    while c0 < C:  # output chunks c0.. : a row lies past every chunk that ends at or before it
        c = c0 + tl.arange(0, BLOCK_C)
        src_chunk = tl.load(sorted_idxs_ptr + c, mask=c < C, other=0)
        ok = (c < C) & (src_chunk >= 0) & (src_chunk < C)
        size = tl.load(split_sizes_ptr + src_chunk, mask=ok, other=0).to(tl.int32)
        end = tl.cumsum(size, axis=0) + running
        before = (end[None, :] <= r[:, None]) & (c[None, :] < C)
        chunk += tl.sum(before.to(tl.int32), axis=1)
        out_start += tl.sum(tl.where(before, size[None, :], 0), axis=1)
        running += tl.sum(size, axis=0)
        c0 += BLOCK_C
    inside = chunk < C
    src_chunk = tl.load(sorted_idxs_ptr + chunk, mask=inside, other=0).to(tl.int32)
    in_start = tl.zeros((BLOCK_R,), dtype=tl.int32)
    c0 = 0
    while c0 < C:  # input start of src_chunk: sizes of the input chunks before it
        c = c0 + tl.arange(0, BLOCK_C)
        size = tl.load(split_sizes_ptr + c, mask=c < C, other=0).to(tl.int32)
        in_start += tl.sum(tl.where(c[None, :] < src_chunk[:, None], size[None, :], 0), axis=1)
        c0 += BLOCK_C
    src = tl.where(inside, in_start + r - out_start, r)
    tl.store(src_rows_ptr + r, src, mask=r < N)
    if tl.program_id(0) == 0:
        tl.store(total_ptr, running)
        if CHECK_N:
            tl.device_assert(running <= N, "sort_chunks_by_idxs: split_sizes sum to more than "
                             "the input's rows")


@launch_cached
@triton.jit(do_not_specialize=["N"])  # row counts vary per step: one variant
def _move_rows_kernel(
    in_ptr,         # [N, H] in
    src_rows_ptr,   # [N] int32 in: output row r <- input row src_rows[r] (a permutation)
    out_ptr,        # [N, H] out: out[r] = in[src[r]] (gather), or out[src[r]] = in[r] (SCATTER)
    probs_ptr,      # [N] in: per-row probs, moved like the rows (if HAS_PROBS)
    out_probs_ptr,  # [N] out (if HAS_PROBS)
    N, H,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, SCATTER: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    pid_r, pid_h = tl.program_id(0), tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    src = tl.load(src_rows_ptr + r, mask=r < N, other=0)
    ok = (r < N) & (src >= 0) & (src < N)  # never touch a row past N
    if SCATTER:
        read_row, write_row = r, src
    else:
        read_row, write_row = src, r
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = ok[:, None] & (h[None, :] < H)
    x = tl.load(in_ptr + read_row[:, None].to(tl.int64) * H + h[None, :], mask=mask)
    tl.store(out_ptr + write_row[:, None].to(tl.int64) * H + h[None, :], x, mask=mask)
    if HAS_PROBS:
        if pid_h == 0:
            p = tl.load(probs_ptr + read_row, mask=ok)
            tl.store(out_probs_ptr + write_row, p, mask=ok)


def chunk_src_rows_triton(split_sizes_C: torch.Tensor, sorted_idxs_C: torch.Tensor,
                          num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output row -> input row [N] int32, split-size total [1] int32); one launch, no sync.

    On CUDA the launch also device-asserts total <= N; elsewhere the caller checks the total
    (`triton_utils.check_count_fits`).
    """
    num_chunks = split_sizes_C.numel()
    device = split_sizes_C.device
    src_rows_N = torch.empty(num_rows, dtype=torch.int32, device=device)
    total_1 = torch.empty(1, dtype=torch.int32, device=device)  # written by program 0
    if num_rows == 0 or num_chunks == 0:
        total_1 = split_sizes_C.sum().to(torch.int32).reshape(1)
        return torch.arange(num_rows, dtype=torch.int32, device=device), total_1
    block_c = min(next_pow2(num_chunks), 128)
    block_r = 128 if block_c <= 64 else 64
    check = triton_utils.device_asserts(src_rows_N)
    _chunk_src_rows_kernel[(cdiv(num_rows, block_r),)](
        split_sizes_C, sorted_idxs_C, src_rows_N, total_1, num_chunks, num_rows,
        BLOCK_R=block_r, BLOCK_C=block_c, CHECK_N=check, num_warps=4,
        **(DEVICE_ASSERT_OPTIONS if check else {}))
    return src_rows_N, total_1


def _launch_move_rows(input_NH, src_rows_N, probs_N, scatter, config=None):
    """Rows (and probs) moved by `src_rows_N`: gather, or its inverse when `scatter`."""
    num_rows, hidden = input_NH.shape
    out_NH = torch.empty_like(input_NH)
    out_probs_N = None if probs_N is None else torch.empty_like(probs_N)
    if num_rows == 0:
        return out_NH, out_probs_N
    config = config or copy_config(hidden, input_NH.element_size())
    block_r = rows_per_copy_program(config.block_h, input_NH.element_size())
    grid = (cdiv(num_rows, block_r), max(1, cdiv(hidden, config.block_h)))
    _move_rows_kernel[grid](
        input_NH, src_rows_N, out_NH, probs_N if probs_N is not None else input_NH,
        out_probs_N if out_probs_N is not None else out_NH, num_rows, hidden,
        BLOCK_R=block_r, BLOCK_H=config.block_h, SCATTER=scatter, HAS_PROBS=probs_N is not None,
        num_warps=config.num_warps)
    return out_NH, out_probs_N


class _SortChunksTriton(torch.autograd.Function):
    """Gather rows by the chunk map; the backward is the scatter by the same map."""

    @staticmethod
    def forward(ctx, input_NH, probs_N, src_rows_N):
        ctx.set_materialize_grads(False)  # no zero-filled grads for unused outputs
        ctx.save_for_backward(src_rows_N)
        ctx.input_meta = (input_NH.shape, input_NH.dtype, input_NH.device)
        return _launch_move_rows(input_NH, src_rows_N, probs_N, scatter=False)

    @staticmethod
    def backward(ctx, grad_out_NH, grad_probs_N):
        (src_rows_N,) = ctx.saved_tensors
        if grad_out_NH is None:
            if grad_probs_N is None:
                return None, None, None
            shape, dtype, device = ctx.input_meta
            grad_out_NH = torch.zeros(shape, dtype=dtype, device=device)
        grad_in_NH, grad_in_probs_N = _launch_move_rows(
            grad_out_NH.contiguous(), src_rows_N,
            None if grad_probs_N is None else grad_probs_N.contiguous(), scatter=True)
        return grad_in_NH, grad_in_probs_N, None


def sort_chunks_by_idxs_triton(
    input_NH: torch.Tensor,
    split_sizes_C: torch.Tensor,
    sorted_idxs_C: torch.Tensor,
    probs_N: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reorder chunks of rows: output chunk j = input chunk sorted_idxs[j]. -> (rows, probs).

    Same contract as `sort_chunks.sort_chunks_by_idxs_torch`; split_sizes [C] and sorted_idxs
    [C] may live on the device (no host sync on CUDA). Differentiable in input and probs.
    """
    if split_sizes_C.numel() != sorted_idxs_C.numel():
        raise ValueError(f"split_sizes has {split_sizes_C.numel()} chunks but sorted_idxs has "
                         f"{sorted_idxs_C.numel()}")
    if input_NH.dim() != 2:
        raise ValueError(f"input must be [N, H], got shape {tuple(input_NH.shape)}")
    num_rows = input_NH.shape[0]
    if probs_N is not None and tuple(probs_N.shape) != (num_rows,):
        raise ValueError(f"probs shape {tuple(probs_N.shape)}: must be ({num_rows},)")
    check_int32_rows(num_rows, "input rows")
    device = input_NH.device
    src_rows_N, total_1 = chunk_src_rows_triton(
        split_sizes_C.to(device).contiguous(), sorted_idxs_C.to(device).contiguous(), num_rows)
    if not triton_utils.device_asserts(src_rows_N) or num_rows == 0 or sorted_idxs_C.numel() == 0:
        # (CUDA with a kernel launched: asserted there)
        triton_utils.check_count_fits(
            total_1, num_rows, f"sort_chunks_by_idxs: split_sizes sum to more than the input's "
            f"{num_rows} rows")
    return _SortChunksTriton.apply(input_NH.contiguous(),
                                   None if probs_N is None else probs_N.contiguous(), src_rows_N)
