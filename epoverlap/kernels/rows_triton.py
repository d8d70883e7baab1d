"""Row copies around fixed-size buffers with empty rows, in Triton: `gather_rows_triton` and
`zero_rows_from_triton`, drop-in replacements of `rows.gather_rows_torch` and
`rows.zero_rows_from_torch` (same arguments, same bits), and their kernels:
  `_gather_rows_kernel`: out[y] = src[index[y]], a zero row where index[y] < 0, in one launch
    (the reference: a clamp, an index_select and a where over the whole output).
  `_zero_rows_kernel`: rows >= a device-held end zeroed, either in place (the forward: only
    the programs over rows at or past the end store anything, the others exit after reading
    the end) or into a copy (the backward: rows below the end copied, the rest zeros).

Shape legend: X source rows, Y output rows, M rows, H row width (trailing dims flattened: [X]
rows are [X, 1], [X, K] probs are rows of K).

Both tile (rows, H) in 2-D: BLOCK_H of the row per program, as many rows as make ~16 KiB
(`triton_utils.row_tile_config`), so wide rows move in 16-byte vectors and narrow ones (probs)
take many rows per program; one kernel serves every width. Row addresses are int64. No host
sync, static shapes (CUDA-graph safe), deterministic (pure copies). Launches: one each.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached
from .triton_utils import cdiv, check_int32_rows, row_tile_config


@launch_cached
@triton.jit(do_not_specialize=["X", "Y"])  # row counts vary per step: one variant
def _gather_rows_kernel(
    src_ptr,    # [X, H] in
    index_ptr,  # [Y] int32 or int64 in: output row y <- source row index[y]; < 0: a zero row
    out_ptr,    # [Y, H] out
    X, Y, H,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    src = tl.load(index_ptr + r, mask=r < Y, other=-1).to(tl.int64)
    ok = (src >= 0) & (src < X)  # an index >= X (a caller's bug) is never read: a zero row
    in_h = h[None, :] < H
    x = tl.load(src_ptr + src[:, None] * H + h[None, :], mask=ok[:, None] & in_h, other=0)
    tl.store(out_ptr + r[:, None].to(tl.int64) * H + h[None, :], x,
             mask=(r < Y)[:, None] & in_h)


@launch_cached
@triton.jit(do_not_specialize=["M"])  # row counts vary per step: one variant
def _zero_rows_kernel(
    in_ptr,   # [M, H] in (read only if COPY)
    end_ptr,  # [1] int in: rows >= end are zeroed
    out_ptr,  # [M, H] out: in place (the same tensor as in) unless COPY
    M, H,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    COPY: tl.constexpr,  # out = in with rows >= end zeroed; else zeros stored into rows >= end
):
    end = tl.load(end_ptr).to(tl.int32)
    r0 = tl.program_id(0) * BLOCK_R
    if not COPY:
        if r0 + BLOCK_R <= end:  # every row of this program is kept: nothing to write
            return
    r = r0 + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = h[None, :] < H
    offset = r[:, None].to(tl.int64) * H + h[None, :]
    if COPY:
        x = tl.load(in_ptr + offset, mask=(r < end)[:, None] & in_h, other=0)
        tl.store(out_ptr + offset, x, mask=(r < M)[:, None] & in_h)
    else:
        zeros = tl.zeros((BLOCK_R, BLOCK_H), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + offset, zeros, mask=((r >= end) & (r < M))[:, None] & in_h)


def _tiles(rows_MH: torch.Tensor):
    """(grid, BLOCK_R, BLOCK_H, num_warps) over [M, H] rows."""
    num_rows, hidden = rows_MH.shape
    config = row_tile_config(hidden, rows_MH.element_size())
    grid = (cdiv(num_rows, config.block_t), cdiv(hidden, config.block_h))
    return grid, config.block_t, config.block_h, config.num_warps


def gather_rows_triton(src_X: torch.Tensor, index_Y: torch.Tensor) -> torch.Tensor:
    """src [X, ...], index [Y] int (device; < 0: an empty row) -> [Y, ...], a zero row where
    index < 0. One launch, no host sync. A plain copy with no autograd graph (raises if src
    needs a grad): `model.dispatch.rows.move_rows` is its differentiable form."""
    if index_Y.dim() != 1:
        raise ValueError(f"gather_rows: index must be [Y], got shape {tuple(index_Y.shape)}")
    if src_X.dim() == 0:
        raise ValueError("gather_rows: src must have a row dim, got a scalar")
    if src_X.requires_grad and torch.is_grad_enabled():
        raise ValueError("gather_rows: not differentiable; use model.dispatch.rows.move_rows")
    num_src, num_out = src_X.shape[0], index_Y.shape[0]
    check_int32_rows(max(num_src, num_out), "gather_rows rows")
    trailing = tuple(src_X.shape[1:])
    src_XH = src_X.reshape(num_src, math.prod(trailing)).contiguous()
    out_YH = torch.empty((num_out, src_XH.shape[1]), dtype=src_X.dtype, device=src_X.device)
    if out_YH.numel() == 0:
        return out_YH.view(num_out, *trailing)
    if num_src == 0:  # every index is empty
        return out_YH.zero_().view(num_out, *trailing)
    grid, block_r, block_h, warps = _tiles(out_YH)
    _gather_rows_kernel[grid](src_XH, index_Y.contiguous(), out_YH, num_src, num_out,
                              src_XH.shape[1], BLOCK_R=block_r, BLOCK_H=block_h,
                              num_warps=warps)
    return out_YH.view(num_out, *trailing)


def _launch_zero_rows(in_MH: torch.Tensor, end_1: torch.Tensor, out_MH: torch.Tensor,
                      copy: bool) -> None:
    if in_MH.numel() == 0:
        return
    grid, block_r, block_h, warps = _tiles(in_MH)
    _zero_rows_kernel[grid](in_MH, end_1, out_MH, in_MH.shape[0], in_MH.shape[1],
                            BLOCK_R=block_r, BLOCK_H=block_h, COPY=copy, num_warps=warps)


def _copy_with_rows_zeroed(x_M: torch.Tensor, end_1: torch.Tensor) -> torch.Tensor:
    """A new tensor: x's rows below end, zeros from end on."""
    x_MH = x_M.reshape(x_M.shape[0], math.prod(x_M.shape[1:])).contiguous()
    out_MH = torch.empty_like(x_MH)
    _launch_zero_rows(x_MH, end_1, out_MH, copy=True)
    return out_MH.view(x_M.shape)


class _ZeroRowsFrom(torch.autograd.Function):
    """Forward: zeros written into x's rows >= end, in place (x is marked dirty), or into a
    copy where x is not contiguous. Backward: the grad with rows >= end zeroed, a new tensor
    (the incoming grad may be shared)."""

    @staticmethod
    def forward(ctx, x_M, end_1):
        ctx.save_for_backward(end_1)
        if not x_M.is_contiguous():
            return _copy_with_rows_zeroed(x_M, end_1)
        x_MH = x_M.view(x_M.shape[0], math.prod(x_M.shape[1:]))
        _launch_zero_rows(x_MH, end_1, x_MH, copy=False)
        ctx.mark_dirty(x_M)
        return x_M

    @staticmethod
    def backward(ctx, grad_M):
        (end_1,) = ctx.saved_tensors
        return _copy_with_rows_zeroed(grad_M, end_1), None


def zero_rows_from_triton(x_M: torch.Tensor, end_1: torch.Tensor) -> torch.Tensor:
    """x [M, ...], end [1] int (device) -> x with rows >= end zeroed, written into x itself
    (in place, rows below end untouched) when x is contiguous; use the returned tensor.
    Differentiable (the grad's rows >= end zeroed, out of place). x must not be a leaf that
    needs a grad (an in-place write); the experts pass the grouped GEMM's fresh output, which
    nothing else holds (`model.moe`)."""
    if x_M.dim() == 0 or end_1.numel() != 1:
        raise ValueError(f"zero_rows_from: x must be [M, ...] and end [1], got shapes "
                         f"{tuple(x_M.shape)} and {tuple(end_1.shape)}")
    check_int32_rows(x_M.shape[0], "zero_rows_from rows")
    return _ZeroRowsFrom.apply(x_M, end_1.reshape(1))
