"""AdamW over flat fp32 buffers in Triton: `adamw_flat_triton`, a drop-in replacement of
`adamw.adamw_flat_torch` (the math, the decay layout and why the two agree bitwise are in that
module's docstring).

Kernel `_adamw_flat_kernel`: one program per window of BLOCK values; it reads the window's decay
code (and, for a window holding both decayed and undecayed values, its row of flags), then
each value's master, grad and two moments once, and writes the master, the moments and the
bf16 parameter once: 30 bytes per value with a bf16 parameter (26 without), the optimizer's
memory bound. 1 launch per call.

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


@launch_cached
@triton.jit
def _adamw_flat_kernel(
    master_ptr,      # [n] fp32 in/out: the masters (in fp32 runs the parameters themselves)
    grad_ptr,        # [n] fp32 in: the main grads
    exp_avg_ptr,     # [n] fp32 in/out: Adam's first moment
    exp_avg_sq_ptr,  # [n] fp32 in/out: Adam's second moment
    param_ptr,       # [n] bf16 out: the parameters (if WRITE_PARAM; else any pointer)
    codes_ptr,       # [cdiv(n, BLOCK)] int32: per window DECAY (-1), NO_DECAY (-2) or a flags row
    flags_ptr,       # [mixed windows, BLOCK] int8: 1 where a value of a mixed window decays
    n,
    decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size,
    BLOCK: tl.constexpr, WRITE_PARAM: tl.constexpr,
):
    # the scalars are fp32 arguments on GPUs, Python floats under the interpreter
    decay = tl.cast(decay, tl.float32)
    one_minus_beta1 = tl.cast(one_minus_beta1, tl.float32)
    beta2 = tl.cast(beta2, tl.float32)
    one_minus_beta2 = tl.cast(one_minus_beta2, tl.float32)
    bias_correction2_sqrt = tl.cast(bias_correction2_sqrt, tl.float32)
    eps = tl.cast(eps, tl.float32)
    neg_step_size = tl.cast(neg_step_size, tl.float32)
    window = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    offs = window.to(tl.int64) * BLOCK + lanes
    ok = offs < n
    code = tl.load(codes_ptr + window)
    mixed = code >= 0
    flag = tl.load(flags_ptr + tl.maximum(code, 0).to(tl.int64) * BLOCK + lanes,
                   mask=ok & mixed, other=0)
    decays = (code == -1) | (flag != 0)
    p = tl.load(master_ptr + offs, mask=ok, other=0.0)
    g = tl.load(grad_ptr + offs, mask=ok, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=ok, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=ok, other=0.0)
    p = tl.where(decays, p * decay, p)
    m = _fma_fp64(one_minus_beta1, g - m, m)
    v = _fma_fp64(g * one_minus_beta2, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(m * neg_step_size, denom)
    tl.store(master_ptr + offs, p, mask=ok)
    tl.store(exp_avg_ptr + offs, m, mask=ok)
    tl.store(exp_avg_sq_ptr + offs, v, mask=ok)
    if WRITE_PARAM:
        tl.store(param_ptr + offs, _bf16_rne(p), mask=ok)


def num_warps_for(block: int) -> int:
    """4 warps up to 2048 values a window, else 8 (8 to 16 fp32 values a thread per buffer)."""
    return 4 if block <= 2048 else 8


def adamw_flat_triton(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, param, decay: DecayLayout,
                      s: AdamScalars) -> None:
    """`adamw.adamw_flat_torch` in one launch (same arguments, same bits)."""
    n = master.numel()
    if n == 0:
        return
    _adamw_flat_kernel[(cdiv(n, decay.block),)](
        master, grad, exp_avg, exp_avg_sq, master if param is None else param,
        decay.codes, decay.flags, n,
        s.decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2, s.bias_correction2_sqrt,
        s.eps, s.neg_step_size,
        BLOCK=decay.block, WRITE_PARAM=param is not None, num_warps=num_warps_for(decay.block),
        enable_fp_fusion=False)
