"""AdamW over flat fp32 buffers in Triton: `adamw_flat_triton`, a drop-in replacement of
`adamw.adamw_flat_torch` (the math, the decay layout and why the two agree bitwise are in that
module's docstring).

Kernel `_adamw_flat_kernel`: one program per window of BLOCK values; it reads the window's decay
code (and, for a window holding both decayed and undecayed values, its row of flags), then
each value's master, grad and two moments once, and writes the master, the moments and the
bf16 parameter once: 30 bytes per value with a bf16 parameter (28 without), the optimizer's
memory bound. 1 launch per call over the whole windows, and a second of one program for a last,
partial window (the only code with masks).

Exactness: division and square root are the IEEE-rounded `div_rn` / `sqrt_rn` (Triton's `/`
and `sqrt` are approximations on GPUs), the two fused multiply-adds go through fp64 (exact
products), the bf16 rounding is spelled out in integer arithmetic (round to nearest even, NaN
to 0x7FC0, as c10::BFloat16; the interpreter's own cast truncates), and the launch turns the
compiler's fp contraction off (it would fuse the decay's product into the update's sum). Every
operation is then one IEEE operation, so the GPU, the interpreter and the torch form give the
same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .adamw import AdamScalars, DecayLayout
from .launch_cache import launch_cached
from .triton_utils import cdiv


@triton.jit
def _fma_fp64(a, b, c):
    """a * b + c of fp32 values: the product exact in fp64, one fp64 rounding, then fp32."""
    return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, rounded to nearest even (NaN -> 0x7FC0)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _load(ptr, ok, MASKED: tl.constexpr):
    if MASKED:
        value = tl.load(ptr, mask=ok, other=0)
    else:
        value = tl.load(ptr)
    return value


@triton.jit
def _store(ptr, value, ok, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, value, mask=ok)
    else:
        tl.store(ptr, value)


@triton.jit
def _adamw_window(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_ptr, flags_ptr,
                  code, offs, lanes, ok, decay, one_minus_beta1, beta2, one_minus_beta2,
                  bias_correction2_sqrt, eps, neg_step_size, grad_scale,
                  BLOCK: tl.constexpr, WRITE_PARAM: tl.constexpr, MASKED: tl.constexpr):
    """One window's update (the values `offs`; `ok` where they exist if MASKED): its decay
    code, the flags if it is mixed, the values."""
    mixed = code >= 0
    flag = tl.load(flags_ptr + tl.maximum(code, 0).to(tl.int64) * BLOCK + lanes,
                   mask=(ok & mixed) if MASKED else mixed, other=0)
    decays = (code == -1) | (flag != 0)
    p = _load(master_ptr + offs, ok, MASKED)
    g = _load(grad_ptr + offs, ok, MASKED) * grad_scale  # the clip (1.0: the same bits)
    m = _load(exp_avg_ptr + offs, ok, MASKED)
    v = _load(exp_avg_sq_ptr + offs, ok, MASKED)
    p = tl.where(decays, p * decay, p)
    m = _fma_fp64(one_minus_beta1, g - m, m)
    v = _fma_fp64(g * one_minus_beta2, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(m * neg_step_size, denom)
    _store(master_ptr + offs, p, ok, MASKED)
    _store(exp_avg_ptr + offs, m, ok, MASKED)
    _store(exp_avg_sq_ptr + offs, v, ok, MASKED)
    if WRITE_PARAM:
        _store(param_ptr + offs, _bf16_rne(p), ok, MASKED)


@launch_cached
@triton.jit(do_not_specialize=["first_window"])
def _adamw_flat_kernel(
    master_ptr,      # [n] fp32 in/out: the masters (in fp32 runs the parameters themselves)
    grad_ptr,        # [n] fp32 in: the main grads
    exp_avg_ptr,     # [n] fp32 in/out: Adam's first moment
    exp_avg_sq_ptr,  # [n] fp32 in/out: Adam's second moment
    param_ptr,       # [n] bf16 out: the parameters (if WRITE_PARAM; else any pointer)
    codes_ptr,       # [cdiv(n, BLOCK)] int32: per window DECAY (-1), NO_DECAY (-2) or a flags row
    flags_ptr,       # [mixed windows, BLOCK] int8: 1 where a value of a mixed window decays
    n, first_window,  # the values; the window of program 0
    decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size,
    grad_scale,
    BLOCK: tl.constexpr, WRITE_PARAM: tl.constexpr, MASKED: tl.constexpr,
):
    # the scalars are fp32 arguments on GPUs, Python floats under the interpreter
    decay = tl.cast(decay, tl.float32)
    one_minus_beta1 = tl.cast(one_minus_beta1, tl.float32)
    beta2 = tl.cast(beta2, tl.float32)
    one_minus_beta2 = tl.cast(one_minus_beta2, tl.float32)
    bias_correction2_sqrt = tl.cast(bias_correction2_sqrt, tl.float32)
    eps = tl.cast(eps, tl.float32)
    neg_step_size = tl.cast(neg_step_size, tl.float32)
    grad_scale = tl.cast(grad_scale, tl.float32)
    window = first_window + tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    offs = window.to(tl.int64) * BLOCK + lanes
    _adamw_window(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_ptr, flags_ptr,
                  tl.load(codes_ptr + window), offs, lanes, offs < n, decay, one_minus_beta1,
                  beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size,
                  grad_scale, BLOCK, WRITE_PARAM, MASKED)


def num_warps_for(block: int) -> int:
    """4 warps up to 2048 values a window, else 8 (8 to 16 fp32 values a thread per buffer)."""
    return 4 if block <= 2048 else 8


def adamw_flat_triton(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, param, decay: DecayLayout,
                      s: AdamScalars) -> None:
    """`adamw.adamw_flat_torch` (same arguments, same bits): one launch over the whole windows
    and one program for a last, partial one (so that the whole windows' code has no mask: one
    from an n not divisible by 16 would cost the 16-byte accesses and double the registers)."""
    n, block = master.numel(), decay.block
    whole = n // block
    for first, programs, masked in ((0, whole, False), (whole, cdiv(n, block) - whole, True)):
        if programs:
            _adamw_flat_kernel[(programs,)](
                master, grad, exp_avg, exp_avg_sq, master if param is None else param,
                decay.codes, decay.flags, n, first,
                s.decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
                s.bias_correction2_sqrt, s.eps, s.neg_step_size, s.grad_scale,
                BLOCK=block, WRITE_PARAM=param is not None, MASKED=masked,
                num_warps=num_warps_for(block), enable_fp_fusion=False)
