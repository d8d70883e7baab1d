"""Rotary position embedding in Triton: `rotary_triton`, a drop-in for `rotary.rotary_torch`.

Shape legend: B batch, N heads, S sequence, D head dim, D2 = D / 2.

One kernel, `_rotary_kernel`: a program per (b, s) rotates all N heads of that position (cos /
sin rows loaded once, BLOCK_N heads x BLOCK_D2 pairs per step), reading x through its strides
(e.g. the [B, S, N, D] -> [B, N, S, D] transpose of a fused qkv projection, without a copy).
Forward rotates by +angle, backward by -angle (the inverse rotation): 1 launch each way.

Bit-exact with the reference where the output casts round: the kernels compile with
`enable_fp_fusion=False`, so x1 * cos - x2 * sin is two rounded products and a rounded
difference, as in torch's separate ops (the backward's two grad terms are summed the way
autograd sums them: IEEE addition commutes). Under TRITON_INTERPRET the fp32 -> bf16 cast
truncates (GPU and torch round to nearest even): interpreted bf16 outputs can be one bf16 ulp
below the reference.

Layouts: y is contiguous [B, N, S, D] like the reference's; the grad of x is allocated in x's
stride order (dense), so for x a transposed [B, S, N, D] view it is a dense [B, S, N, D] buffer
and autograd's view/transpose backward needs no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached
from .triton_utils import next_pow2


def rotary_tile(num_heads: int, half_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_D2, num_warps): up to 4K pairs per step, 8 pairs per thread (bf16: a
    16-byte vector per half).

    N 16, D 128 -> 16 x 64 heads x pairs, 4 warps; N 56 -> 64 x 64 (one step, 8 heads
    masked), 16 warps.
    """
    block_d2 = next_pow2(half_dim)
    block_n = min(next_pow2(num_heads), max(1, 4096 // block_d2))
    return block_n, block_d2, min(16, max(4, block_n * block_d2 // 256))


@launch_cached
@triton.jit
def _rotary_kernel(
    x_ptr,    # [B, N, S, D] in: strides stride_x*, unit stride along D
    cos_ptr,  # [S, D2] in (contiguous): cos of the angles
    sin_ptr,  # [S, D2] in (contiguous): sin of the angles
    y_ptr,    # [B, N, S, D] out: strides stride_y*, unit stride along D; y's dtype
    S, N,
    stride_xb, stride_xn, stride_xs, stride_yb, stride_yn, stride_ys,
    D2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr, INVERSE: tl.constexpr,
):
    pid = tl.program_id(0)  # position (b, s)
    b = (pid // S).to(tl.int64)
    s = (pid % S).to(tl.int64)
    d = tl.arange(0, BLOCK_D2)
    d_ok = d < D2
    cos = tl.load(cos_ptr + s * D2 + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + s * D2 + d, mask=d_ok, other=0.0).to(tl.float32)
    if INVERSE:  # rotate by -angle: the backward
        sin = -sin
    x_row = x_ptr + b * stride_xb + s * stride_xs
    y_row = y_ptr + b * stride_yb + s * stride_ys
    n0 = 0
    while n0 < N:
        n = n0 + tl.arange(0, BLOCK_N)
        mask = (n < N)[:, None] & d_ok[None, :]
        x_off = n[:, None].to(tl.int64) * stride_xn + d[None, :]
        y_off = n[:, None].to(tl.int64) * stride_yn + d[None, :]
        x1 = tl.load(x_row + x_off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + x_off + D2, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * cos[None, :] - x2 * sin[None, :]
        y2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(y_row + y_off, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_row + y_off + D2, y2.to(y_ptr.dtype.element_ty), mask=mask)
        n0 += BLOCK_N


def _dense_strides_in_order(shape, stride) -> tuple:
    """Strides of a dense tensor of `shape` with its dims laid out in the order of `stride`
    (largest outermost, ties in dim order, the last dim innermost): for a transposed
    [B, S, N, D] view, those of a dense [B, S, N, D] buffer seen as [B, N, S, D]."""
    last = len(shape) - 1  # stays innermost (the kernel's unit stride)
    order = sorted(range(last), key=lambda i: -stride[i]) + [last]  # stable sort
    dense = [0] * len(shape)
    step = 1
    for i in reversed(order):
        dense[i] = step
        step *= max(shape[i], 1)
    return tuple(dense)


def _launch_rotary(x_BNSD, cos_SD2, sin_SD2, y_BNSD, inverse):
    batch, heads, seq, dim = x_BNSD.shape
    if x_BNSD.numel() == 0:
        return y_BNSD
    block_n, block_d2, num_warps = rotary_tile(heads, dim // 2)
    sx, sy = x_BNSD.stride(), y_BNSD.stride()
    _rotary_kernel[(batch * seq,)](
        x_BNSD, cos_SD2, sin_SD2, y_BNSD, seq, heads, sx[0], sx[1], sx[2], sy[0], sy[1], sy[2],
        D2=dim // 2, BLOCK_N=block_n, BLOCK_D2=block_d2, INVERSE=inverse, num_warps=num_warps,
        enable_fp_fusion=False)
    return y_BNSD


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _RotaryTriton(torch.autograd.Function):
    """y = rotate(x, +angle); grad x = rotate(grad y, -angle). Saves only cos and sin."""

    @staticmethod
    def forward(ctx, x_BNSD, cos_SD2, sin_SD2):
        ctx.save_for_backward(cos_SD2, sin_SD2)
        ctx.dx_strides = _dense_strides_in_order(x_BNSD.shape, x_BNSD.stride())
        y_BNSD = torch.empty(x_BNSD.shape, dtype=x_BNSD.dtype, device=x_BNSD.device)
        return _launch_rotary(x_BNSD, cos_SD2, sin_SD2, y_BNSD, inverse=False)

    @staticmethod
    def backward(ctx, dy_BNSD):
        cos_SD2, sin_SD2 = ctx.saved_tensors
        dx_BNSD = torch.empty_strided(dy_BNSD.shape, ctx.dx_strides, dtype=dy_BNSD.dtype,
                                      device=dy_BNSD.device)
        return _launch_rotary(_unit_last(dy_BNSD), cos_SD2, sin_SD2, dx_BNSD,
                              inverse=True), None, None


def rotary_triton(x_BNSD: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor
                  ) -> torch.Tensor:
    """Rotate the two halves of each head of x [B, N, S, D] by cos/sin [S, D2] -> y [B, N, S, D].

    Same values as `rotary.rotary_torch` (y contiguous, x's dtype); x may be any strided view
    with unit stride along D (others are copied first). Differentiable in x only: cos / sin
    must not require grad. 1 launch forward, 1 backward; no host sync; deterministic.
    """
    if x_BNSD.dim() != 4 or x_BNSD.shape[-1] % 2:
        raise ValueError(f"rotary: x shape {tuple(x_BNSD.shape)}: must be [B, N, S, D], D even")
    seq, half = x_BNSD.shape[2], x_BNSD.shape[3] // 2
    for name, table in (("cos", cos_SD2), ("sin", sin_SD2)):
        if table.shape != (seq, half):
            raise ValueError(f"rotary: {name} shape {tuple(table.shape)}: must be ({seq}, {half})"
                             f" for x shape {tuple(x_BNSD.shape)}")
        if table.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"rotary: {name} requires grad; the Triton rotary is differentiable "
                             "in x only")
    return _RotaryTriton.apply(_unit_last(x_BNSD), cos_SD2.contiguous(), sin_SD2.contiguous())
