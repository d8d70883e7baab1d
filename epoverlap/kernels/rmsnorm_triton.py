"""RMSNorm in Triton: `rms_norm_triton`, a drop-in replacement of `rmsnorm.rms_norm_torch`.

Shape legend: T rows (leading dims of x flattened), H hidden, P backward programs.

Kernels (deterministic: no atomics, fixed summation orders):
  `_rms_norm_fwd_kernel`: BLOCK_T whole rows per program: one read of x, one write of y and
    of the per-row 1/rms (fp32 [T], kept for the backward). 1 launch.
  `_rms_norm_bwd_kernel`: P programs, each walking a contiguous range of rows: dx per row, and
    the program's partial weight grad sum(dy * normed) over its rows in fp32 [P, H].
  `_rms_norm_dw_kernel`: sums the [P, H] partials over P in a fixed order, casts to the weight's
    dtype; with a main grad (`rms_norm_triton(..., main_grad=)`) it adds that value, in fp32, to
    the main grad instead of writing a grad: the bits of writing the grad and the grad buffers'
    hook adding it, without the add's launch. Backward: 2 launches (1 when the weight needs no
    grad).

Rounding follows the reference step by step, so the kernels differ from it only by summation
order and rsqrt/division ulps: normed is rounded to x's dtype before the weight multiply; in the
backward, dy * weight is rounded to x's dtype (the grad of the rounded normed) and dy * normed
to y's dtype before the row sum (autograd's mul backward does both in the half dtype).
Under TRITON_INTERPRET the fp32 -> bf16 cast truncates (GPU and torch round to nearest even), so
interpreted bf16 results can be one bf16 ulp below the reference; fp16 casts round there too.
Whole rows live in registers: H <= MAX_HIDDEN. Loops with run-time bounds are `while` loops (see
permutation_triton.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached
from .triton_reduce import sum_partial_rows
from .triton_utils import cdiv, next_pow2

MAX_HIDDEN = 32768      # a row (and its fp32 temporaries) must fit in one program's registers
MAX_BWD_PROGRAMS = 512  # rows of the weight-grad partials: <= ~4% of the backward's traffic


@dataclass(frozen=True)
class RowTile:
    """BLOCK_T rows x BLOCK_H hidden per program, and its warps."""

    block_t: int
    block_h: int
    num_warps: int


@functools.lru_cache(maxsize=64)
def rms_norm_tile(hidden: int) -> RowTile:
    """Whole rows, ~4K elements per program (H >= 4096: one row), 16 elements per thread.

    H 7168 -> 1 x 8192, 16 warps (bf16: two 16-byte vectors per thread and tensor);
    H 2048 -> 2 x 2048, 8 warps; H 128 -> 16 x 128, 4 warps. A pure function of H, so every
    rank and run reduces in the same order.
    """
    if hidden > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden={hidden}: the Triton kernel keeps a row in registers, "
                         f"at most {MAX_HIDDEN} (use --kernel-backend torch)")
    block_h = next_pow2(hidden)
    block_t = max(1, min(16, 4096 // block_h))
    return RowTile(block_t, block_h, min(32, max(4, block_t * block_h // 512)))


@launch_cached
@triton.jit(do_not_specialize=["T"])  # row counts vary per step: one variant
def _rms_norm_fwd_kernel(
    x_ptr,     # [T, H] in: rows stride_x apart, unit stride along H
    w_ptr,     # [H] in: weight
    y_ptr,     # [T, H] out (contiguous): normed.to(x.dtype) * weight, y's dtype
    rstd_ptr,  # [T] fp32 out: 1 / sqrt(mean(x^2) + eps), for the backward
    T, H, stride_x, eps,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    mask = (t < T)[:, None] & (h < H)[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_x + h[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
    # round like the reference: normed to x's dtype, then times the weight in y's dtype
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    tl.store(y_ptr + t[:, None] * H + h[None, :], (normed * w[None, :]).to(y_ptr.dtype.element_ty),
             mask=mask)
    tl.store(rstd_ptr + t, rstd, mask=t < T)


@launch_cached
@triton.jit(do_not_specialize=["T", "rows_per_program"])  # row counts vary per step: one variant
def _rms_norm_bwd_kernel(
    dy_ptr,       # [T, H] in: grad of y, rows stride_dy apart, unit stride along H
    x_ptr,        # [T, H] in: the forward's x, rows stride_x apart
    w_ptr,        # [H] in: weight
    rstd_ptr,     # [T] fp32 in: the forward's 1/rms
    dx_ptr,       # [T, H] out (contiguous): grad of x, x's dtype
    dw_part_ptr,  # [P, H] fp32 out: program p's sum over its rows of dy * normed (if HAS_DW)
    T, H, stride_dy, stride_x, rows_per_program,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < H
    w = tl.load(w_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    row0 = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row0 + rows_per_program, T)
    while row0 < row_end:  # BLOCK_T rows at a time, in order
        t = row0 + tl.arange(0, BLOCK_T)
        t_ok = t < row_end
        mask = t_ok[:, None] & h_ok[None, :]
        x = tl.load(x_ptr + t[:, None] * stride_x + h[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        dy = tl.load(dy_ptr + t[:, None] * stride_dy + h[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        rstd = tl.load(rstd_ptr + t, mask=t_ok, other=0.0)
        normed = x * rstd[:, None]
        # grad of normed: dy * w rounded to x's dtype (the reference's half-precision multiply)
        g = (dy * w[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
        # d/dx of x * rsqrt(mean(x^2) + eps) applied to g: rstd * (g - normed * mean(g * normed))
        c = tl.sum(g * normed, axis=1) / H
        dx = rstd[:, None] * (g - normed * c[:, None])
        tl.store(dx_ptr + t[:, None] * H + h[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DW:
            normed_x = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
            prod = (dy * normed_x).to(dy_ptr.dtype.element_ty).to(tl.float32)
            dw += tl.sum(prod, axis=0)
        row0 += BLOCK_T
    if HAS_DW:
        tl.store(dw_part_ptr + pid * H + h, dw, mask=h_ok)


@launch_cached
@triton.jit(do_not_specialize=["P"])  # row counts vary per step: one variant
def _rms_norm_dw_kernel(
    dw_part_ptr,    # [P, H] fp32 in: per-program partial weight grads
    dw_ptr,         # [H] out: their sum over P, the weight's dtype (only its dtype if INTO_MAIN)
    main_grad_ptr,  # [H] fp32 in/out (if INTO_MAIN): += the sum rounded to dw's dtype
    P, H,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, INTO_MAIN: tl.constexpr,
):
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    dw = sum_partial_rows(dw_part_ptr, P, H, h, BLOCK_P).to(dw_ptr.dtype.element_ty)
    if INTO_MAIN:
        main = tl.load(main_grad_ptr + h, mask=h < H, other=0.0)
        tl.store(main_grad_ptr + h, main + dw.to(tl.float32), mask=h < H)
    else:
        tl.store(dw_ptr + h, dw, mask=h < H)


def _unit_rows(t_TH: torch.Tensor) -> torch.Tensor:
    """t [T, H] with unit stride along H (a copy only when it has not)."""
    return t_TH if t_TH.stride(-1) == 1 or t_TH.shape[-1] <= 1 else t_TH.contiguous()


def _launch_fwd(x_TH, weight_H, eps):
    num_rows, hidden = x_TH.shape
    tile = rms_norm_tile(hidden)
    y_TH = torch.empty((num_rows, hidden), dtype=torch.promote_types(x_TH.dtype, weight_H.dtype),
                       device=x_TH.device)
    rstd_T = torch.empty(num_rows, dtype=torch.float32, device=x_TH.device)
    if num_rows > 0:
        _rms_norm_fwd_kernel[(cdiv(num_rows, tile.block_t),)](
            x_TH, weight_H, y_TH, rstd_T, num_rows, hidden, x_TH.stride(0), float(eps),
            BLOCK_T=tile.block_t, BLOCK_H=tile.block_h, num_warps=tile.num_warps)
    return y_TH, rstd_T


def _launch_bwd(dy_TH, x_TH, weight_H, rstd_T, need_dw, main_grad_H=None):
    """(dx, dw): dw None when not needed or added into `main_grad_H` (then adding zero rows'
    grad is left out)."""
    num_rows, hidden = x_TH.shape
    tile = rms_norm_tile(hidden)
    dx_TH = torch.empty((num_rows, hidden), dtype=x_TH.dtype, device=x_TH.device)
    if num_rows == 0:
        return dx_TH, torch.zeros_like(weight_H) if need_dw and main_grad_H is None else None
    blocks = cdiv(num_rows, tile.block_t)
    rows_per_program = cdiv(blocks, MAX_BWD_PROGRAMS) * tile.block_t
    programs = cdiv(num_rows, rows_per_program)
    dw_part_PH = torch.empty((programs, hidden) if need_dw else (1,), dtype=torch.float32,
                             device=x_TH.device)
    _rms_norm_bwd_kernel[(programs,)](
        dy_TH, x_TH, weight_H, rstd_T, dx_TH, dw_part_PH, num_rows, hidden, dy_TH.stride(0),
        x_TH.stride(0), rows_per_program, BLOCK_T=tile.block_t, BLOCK_H=tile.block_h,
        HAS_DW=need_dw, num_warps=tile.num_warps)
    if not need_dw:
        return dx_TH, None
    into_main = main_grad_H is not None
    dw_H = weight_H if into_main else torch.empty_like(weight_H)  # into main: its dtype only
    _rms_norm_dw_kernel[(cdiv(hidden, 32),)](
        dw_part_PH, dw_H, main_grad_H if into_main else dw_part_PH, programs, hidden,
        BLOCK_P=128, BLOCK_H=32, INTO_MAIN=into_main, num_warps=4)
    return dx_TH, None if into_main else dw_H


class _RMSNormTriton(torch.autograd.Function):
    """y = rms_norm(x, weight); saves x, weight and the per-row 1/rms (fp32 [T]); with a main
    grad the weight's grad is added there and none is returned."""

    @staticmethod
    def forward(ctx, x_TH, weight_H, eps, main_grad_H):
        y_TH, rstd_T = _launch_fwd(x_TH, weight_H, eps)
        ctx.save_for_backward(x_TH, weight_H, rstd_T)
        ctx.main_grad = main_grad_H
        return y_TH

    @staticmethod
    def backward(ctx, dy_TH):
        x_TH, weight_H, rstd_T = ctx.saved_tensors
        dx_TH, dw_H = _launch_bwd(_unit_rows(dy_TH), x_TH, weight_H, rstd_T,
                                  ctx.needs_input_grad[1], ctx.main_grad)
        return dx_TH if ctx.needs_input_grad[0] else None, dw_H, None, None


def rms_norm_triton(x_TH: torch.Tensor, weight_H: torch.Tensor, eps: float,
                    main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H] -> y [..., H] (contiguous).

    Same contract as `rmsnorm.rms_norm_torch` (y has x's dtype when the weight has it); any
    leading dims, any strides (rows are read in place when the last dim has unit stride).
    Differentiable in x and weight; with `main_grad` (fp32 [H], contiguous) the weight's grad
    is added there by the backward's second kernel and the weight gets none. Forward 1 launch,
    backward 2 (1 without weight grad); no host sync; deterministic. Needs H <= MAX_HIDDEN.
    """
    hidden = x_TH.shape[-1]
    if weight_H.shape != (hidden,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight_H.shape)}, x shape "
                         f"{tuple(x_TH.shape)}: weight must be ({hidden},)")
    if main_grad is not None and (main_grad.shape != (hidden,) or not main_grad.is_contiguous()
                                  or main_grad.dtype != torch.float32):
        raise ValueError(f"rms_norm: main grad {main_grad.dtype} {tuple(main_grad.shape)}: must "
                         f"be contiguous fp32 ({hidden},)")
    x_2d = _unit_rows(x_TH.reshape(-1, hidden))
    y_2d = _RMSNormTriton.apply(x_2d, weight_H.contiguous(), eps, main_grad)
    return y_2d.view(x_TH.shape)
