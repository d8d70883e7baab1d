"""SwiGLU activation in Triton: `swiglu_triton`, a drop-in replacement of `swiglu.swiglu_torch`.

Shape legend: M rows, F ffn width (h = [gate | up] is 2F wide).

Kernels (deterministic: the probs grad is a per-row sum in a fixed order, no atomics):
  `_swiglu_fwd_kernel`: BLOCK_M rows per program, BLOCK_F columns per step: reads gate, up
    (and the row's prob) once, writes act once. 1 launch.
  `_swiglu_bwd_kernel`: same tiles: reads h, grad act (and probs) once, recomputes silu, writes
    grad h = [grad gate | grad up] and the probs' grad sum_f(grad act * silu(gate) * up).
    1 launch.

fp32 math in the reference's order: silu(g) = g / (1 + exp(-g)) (torch's formula), times up,
times prob; the backward uses torch's silu_backward formula
sigmoid * (1 + g * (1 - sigmoid)). Differences come from exp / division ulps only (GPU exp is
an approximation: ~1e-6 relative in fp32). Under TRITON_INTERPRET the fp32 -> bf16 cast
truncates (GPU and torch round to nearest even): interpreted bf16 results can be one bf16 ulp
below the reference. Loops with run-time bounds are `while` loops (see permutation_triton.py).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached
from .triton_utils import cdiv, next_pow2


@functools.lru_cache(maxsize=64)
def swiglu_tile(ffn: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_F, num_warps): 4K-element tiles, 16 per thread (8 warps).

    F 4096 -> 1 x 4096; F 256 -> 16 x 256; F > 4096 loops over 4096-wide steps; a pure
    function of F (the probs-grad summation order depends on nothing else).
    """
    block_f = min(next_pow2(ffn), 4096)
    block_m = max(1, min(64, 4096 // block_f))
    return block_m, block_f, max(4, min(8, block_m * block_f // 512))


@launch_cached
@triton.jit(do_not_specialize=["M"])  # row counts vary per step: one variant
def _swiglu_fwd_kernel(
    h_ptr,      # [M, 2F] in: [gate | up], rows stride_h apart, unit stride along 2F
    probs_ptr,  # [M] in: per-row scale (if HAS_PROBS)
    act_ptr,    # [M, F] out (contiguous): silu(gate) * up [* prob], h's dtype
    M, F, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, HAS_PROBS: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    if HAS_PROBS:
        p = tl.load(probs_ptr + m, mask=m_ok, other=0.0).to(tl.float32)
    f0 = 0
    while f0 < F:
        f = f0 + tl.arange(0, BLOCK_F)
        mask = m_ok[:, None] & (f < F)[None, :]
        gate_ptrs = h_ptr + m[:, None] * stride_h + f[None, :]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + F, mask=mask, other=0.0).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        if HAS_PROBS:
            act = act * p[:, None]
        tl.store(act_ptr + m[:, None] * F + f[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=mask)
        f0 += BLOCK_F


@launch_cached
@triton.jit(do_not_specialize=["M"])  # row counts vary per step: one variant
def _swiglu_bwd_kernel(
    dact_ptr,    # [M, F] in: grad of act, rows stride_dact apart, unit stride along F
    h_ptr,       # [M, 2F] in: the forward's [gate | up], rows stride_h apart
    probs_ptr,   # [M] in (if HAS_PROBS)
    dh_ptr,      # [M, 2F] out (contiguous): [grad gate | grad up], h's dtype
    dprobs_ptr,  # [M] out: sum_f dact * silu(gate) * up, probs' dtype (if HAS_PROBS)
    M, F, stride_dact, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, HAS_PROBS: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    if HAS_PROBS:
        p = tl.load(probs_ptr + m, mask=m_ok, other=0.0).to(tl.float32)
        dp = tl.zeros((BLOCK_M,), dtype=tl.float32)
    f0 = 0
    while f0 < F:  # column steps in order: the probs grad sums in a fixed order
        f = f0 + tl.arange(0, BLOCK_F)
        mask = m_ok[:, None] & (f < F)[None, :]
        gate_ptrs = h_ptr + m[:, None] * stride_h + f[None, :]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + F, mask=mask, other=0.0).to(tl.float32)
        dt = tl.load(dact_ptr + m[:, None] * stride_dact + f[None, :], mask=mask, other=0.0)
        dt = dt.to(tl.float32)
        e = tl.exp(-gate)
        silu = gate / (1.0 + e)
        if HAS_PROBS:
            dp += tl.sum(dt * (silu * up), axis=1)
            dt = dt * p[:, None]
        sig = 1.0 / (1.0 + e)
        dgate = (dt * up) * sig * (1.0 + gate * (1.0 - sig))  # torch's silu_backward order
        dup = dt * silu
        dh_ptrs = dh_ptr + m[:, None] * (2 * F) + f[None, :]
        tl.store(dh_ptrs, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptrs + F, dup.to(dh_ptr.dtype.element_ty), mask=mask)
        f0 += BLOCK_F
    if HAS_PROBS:
        tl.store(dprobs_ptr + m, dp.to(dprobs_ptr.dtype.element_ty), mask=m_ok)


def _unit_rows(t_MX: torch.Tensor) -> torch.Tensor:
    """t [M, X] with unit stride along X (a copy only when it has not)."""
    return t_MX if t_MX.stride(-1) == 1 or t_MX.shape[-1] <= 1 else t_MX.contiguous()


class _SwiGLUTriton(torch.autograd.Function):
    """act = silu(gate) * up [* probs]; saves h and probs, recomputes silu in the backward."""

    @staticmethod
    def forward(ctx, h_M2F, probs_M):
        rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
        act_MF = torch.empty((rows, ffn), dtype=h_M2F.dtype, device=h_M2F.device)
        if rows > 0 and ffn > 0:
            block_m, block_f, num_warps = swiglu_tile(ffn)
            _swiglu_fwd_kernel[(cdiv(rows, block_m),)](
                h_M2F, probs_M if probs_M is not None else h_M2F, act_MF, rows, ffn,
                h_M2F.stride(0), BLOCK_M=block_m, BLOCK_F=block_f,
                HAS_PROBS=probs_M is not None, num_warps=num_warps)
        ctx.save_for_backward(h_M2F, probs_M)
        return act_MF

    @staticmethod
    def backward(ctx, dact_MF):
        h_M2F, probs_M = ctx.saved_tensors
        rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
        dh_M2F = torch.empty((rows, 2 * ffn), dtype=h_M2F.dtype, device=h_M2F.device)
        dprobs_M = None if probs_M is None else torch.empty_like(probs_M)
        if rows > 0 and ffn > 0:
            dact_MF = _unit_rows(dact_MF)
            block_m, block_f, num_warps = swiglu_tile(ffn)
            _swiglu_bwd_kernel[(cdiv(rows, block_m),)](
                dact_MF, h_M2F, probs_M if probs_M is not None else h_M2F, dh_M2F,
                dprobs_M if dprobs_M is not None else dh_M2F, rows, ffn, dact_MF.stride(0),
                h_M2F.stride(0), BLOCK_M=block_m, BLOCK_F=block_f,
                HAS_PROBS=probs_M is not None, num_warps=num_warps)
        elif dprobs_M is not None:
            dprobs_M.zero_()
        return dh_M2F, dprobs_M


def swiglu_triton(h_M2F: torch.Tensor, probs_M: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h [M, 2F] = [gate | up] (probs [M] fp32 or half, or None) -> act [M, F] in h's dtype.

    Same contract as `swiglu.swiglu_torch`. M may be 0 (an empty [0, F]); without probs h may
    have any leading dims ([..., 2F] -> [..., F]). Differentiable in h and probs (the probs' grad
    has probs' dtype). Forward 1 launch, backward 1; no host sync; deterministic.
    """
    if h_M2F.dim() < 1 or h_M2F.shape[-1] % 2:
        raise ValueError(f"swiglu: h shape {tuple(h_M2F.shape)}: last dim must be 2F (even)")
    two_f = h_M2F.shape[-1]
    if probs_M is not None:
        if h_M2F.dim() != 2 or tuple(probs_M.shape) != (h_M2F.shape[0],):
            raise ValueError(f"swiglu: probs shape {tuple(probs_M.shape)}, h shape "
                             f"{tuple(h_M2F.shape)}: with probs h must be [M, 2F], probs [M]")
        probs_M = probs_M.contiguous()
    h_2d = _unit_rows(h_M2F.reshape(-1, two_f))
    act_2d = _SwiGLUTriton.apply(h_2d, probs_M)
    return act_2d.view(*h_M2F.shape[:-1], two_f // 2)
