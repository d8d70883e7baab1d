"""AdamW over flat fp32 buffers, the torch form: `adamw_flat_torch`, the reference of
`adamw_triton.adamw_flat_triton` and what the flat optimizer runs on CPUs; `adam_scalars`, the
host-side numbers of one step; `decay_layout`, which values decay, in the two forms the two
implementations read.

One call updates n values held in flat buffers of the same layout: the fp32 masters, the fp32
grads, Adam's two fp32 moments, and writes the low-precision parameters (optional) from the new
masters. Weight decay applies to some ranges of the n values (the matrices) and not to the rest.

The math is torch's `_single_tensor_adam` (decoupled weight decay, torch 2.13), in its order of
operations, with each scalar rounded to fp32 as torch's CPU kernels round it:

    p = p * (1 - lr * wd)                              (decayed values only, as torch's group)
    m = fma(1 - beta1, g - m, m)                       (lerp_(g, 1 - beta1): weight < 0.5)
    v = fma((1 - beta2) * g, g, v * beta2)             (mul_(beta2).addcmul_(g, g, 1 - beta2))
    d = sqrt(v) / sqrt(1 - beta2 ** step) + eps
    p = p + (-(lr / (1 - beta1 ** step)) * m) / d      (addcdiv_(m, d, value=-step_size))
    param = p rounded to nearest even in bf16

Every operation is IEEE-rounded and the two fused multiply-adds are computed in fp64 then
rounded to fp32 (the product of two fp32 values is exact in fp64, so the only departure from a
true fp32 fma is a double rounding, where the fp64 sum lands on an fp32 halfway point: about
one value in 2**29). The Triton kernel computes exactly the same, so the two agree bitwise.
torch's own CPU AdamW takes its square root from MKL, which is not correctly rounded (one ulp
off for about a fifth of the values here): the moments agree with it bitwise (but for those
double roundings; torch's lerp and addcmul are true fp32 fmas), about 1% of the masters do not, each within 2 fp32 epsilons of |master| + lr (tests/kernels/test_adamw.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

DECAY, NO_DECAY = -1, -2  # a window's code where all its values decay, or none


@dataclass(frozen=True)
class AdamScalars:
    """One step's scalars (Python floats; the kernels see them rounded to fp32)."""

    decay: float  # 1 - lr * weight_decay: the decayed masters' factor
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    bias_correction2_sqrt: float  # sqrt(1 - beta2 ** step)
    eps: float
    neg_step_size: float  # -(lr / (1 - beta1 ** step))
    grad_scale: float = 1.0  # the clip's factor, applied to each grad as it is read


def adam_scalars(lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
                 step: float, grad_scale: float = 1.0) -> AdamScalars:
    """torch's `_single_tensor_adam` host arithmetic (fp64) for step `step` (1-based); the
    grads are multiplied by `grad_scale` (fp32) as they are read: the bits of a clip that
    scaled the grad buffers in place before the step."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    return AdamScalars(1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2,
                       bias_correction2 ** 0.5, eps, -step_size, grad_scale)


@dataclass(frozen=True)
class DecayLayout:
    """Which of n values decay. `ranges`: the decayed [start, end) ranges (the torch form).
    `codes` [cdiv(n, block)] int32: per window of `block` values DECAY, NO_DECAY, or, for a
    window with both, its row in `flags` [mixed windows, block] int8 (1 where a value decays):
    the Triton form, one load per window beside the values' 30 bytes."""

    ranges: tuple[tuple[int, int], ...]
    block: int
    codes: torch.Tensor
    flags: torch.Tensor


def decay_layout(ranges: list[tuple[int, int]], n: int, block: int,
                 device: torch.device) -> DecayLayout:
    """The layout of n values of which `ranges` ([start, end), sorted, disjoint) decay."""
    windows = -(-n // block)
    if windows == 0:
        return DecayLayout((), block, torch.zeros(0, dtype=torch.int32, device=device),
                           torch.zeros((1, block), dtype=torch.int8, device=device))
    decayed = torch.zeros(windows, dtype=torch.int64)  # decayed values per window
    for start, end in ranges:
        first, last = start // block, (end - 1) // block
        decayed[first:last + 1] += block
        decayed[first] -= start - first * block
        decayed[last] -= (last + 1) * block - end
    sizes = torch.full((windows,), block, dtype=torch.int64)
    sizes[-1] = n - (windows - 1) * block
    mixed = ((decayed > 0) & (decayed < sizes)).nonzero().flatten().tolist()
    codes = torch.where(decayed == sizes, DECAY, NO_DECAY).to(torch.int32)
    codes[mixed] = torch.arange(len(mixed), dtype=torch.int32)
    flags = torch.zeros((max(len(mixed), 1), block), dtype=torch.int8)
    for start, end in ranges:  # a mixed window holds one end of a range or a whole one
        for window in {start // block, (end - 1) // block}:
            if codes[window] >= 0:
                low = window * block
                flags[codes[window], max(start, low) - low:min(end, low + block) - low] = 1
    return DecayLayout(tuple(ranges), block, codes.to(device), flags.to(device))


def _fma_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a * b + out (fp32): the product exact in fp64, the sum rounded to fp64 then fp32."""
    out.copy_(a.double() * b.double() + out.double())


def _scalar(x: float, like: torch.Tensor) -> torch.Tensor:
    """x rounded to fp32, as a 0-d tensor beside `like`."""
    return torch.tensor(x, dtype=torch.float32, device=like.device)


@torch.no_grad()
def adamw_flat_torch(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor, param: Optional[torch.Tensor],
                     decay: DecayLayout, s: AdamScalars) -> None:
    """One AdamW step over flat [n] fp32 buffers in place (module docstring); `param` [n]
    (bf16) written from the new masters, or None. Scalars are divided through 0-d tensors, as
    CUDA divides by a host scalar with a reciprocal: the same bits on either device."""
    if s.grad_scale != 1.0:
        grad = grad * s.grad_scale
    for start, end in decay.ranges:
        master[start:end].mul_(s.decay)
    _fma_(exp_avg, _scalar(s.one_minus_beta1, grad), grad - exp_avg)
    exp_avg_sq.mul_(s.beta2)
    _fma_(exp_avg_sq, grad * s.one_minus_beta2, grad)
    denom = exp_avg_sq.double().sqrt_().float().div_(_scalar(s.bias_correction2_sqrt, grad))
    denom.add_(s.eps)
    master.add_((exp_avg * s.neg_step_size).div_(denom))
    if param is not None:
        param.copy_(master)
