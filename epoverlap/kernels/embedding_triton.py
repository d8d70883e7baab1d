"""Embedding lookup whose weight grad goes straight into the fp32 main grad: `embedding_triton`,
the Triton form of `embedding.embedding_torch`.

Shape legend: T tokens, V vocabulary rows (padded), H hidden.

Forward: weight[tokens] (torch's F.embedding). Backward with a main grad: the tokens sorted
(stable, so a vocabulary row's positions stay in order), each position's segment end found
(a segment is the run of positions holding one vocabulary row), then `_embedding_grad_kernel`,
one program per (position, block of H columns). The program at the first position of a
segment sums its output-grad rows in fp32: partial sums of PARTIAL_ROWS (10) rows each, every
one started from zero (its rows' loads issued together), then the partials summed in order
from zero; it rounds the sum to the grad's dtype and adds it to the main grad's row in fp32.
Every other program returns at once. A row held by many tokens is summed by one program: its
time grows with the row's count (tokens of real text: tens to hundreds). No atomics: each
element of the main grad is written by one program, so a run repeats its bits; rows no token
holds are neither read nor written (no dense [V, H] grad, no [V, H] add: the hook's cost it
replaces).

The order is torch's CUDA embedding backward's where that sorts (more than 3072 tokens a
call, aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu: a stable radix sort, partial sums of
NROWS_PER_THREAD = 10 rows, the partials summed in order, rounded once to the grad's dtype)
followed by the hook's fp32 add: the same bits as the unfused path there. Two reduction orders
differ by design: at most 3072 tokens torch's CUDA backward takes another kernel (it sums the
tokens in chunks of 32 and adds each chunk's sum to the grad in the grad's dtype), and torch
on CPU adds a row's tokens one at a time in position order in the grad's dtype (the same bits
in fp32 while no row holds more than 10 tokens of a call). Under TRITON_INTERPRET the fp32 -> bf16 cast
truncates (GPU and torch round to nearest even). Loops with run-time bounds are `while` loops
(see permutation_triton.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch_cache import launch_cached
from .triton_utils import cdiv, next_pow2

PARTIAL_ROWS = 10  # torch's NROWS_PER_THREAD: rows of one partial sum
MAX_BLOCK_H = 512


@launch_cached
@triton.jit(do_not_specialize=["T"])  # token counts vary: one variant
def _embedding_grad_kernel(
    ids_ptr,        # [T] int64 in: the tokens' vocabulary rows, sorted (stable)
    ends_ptr,       # [T] int64 in: the end of each sorted position's segment (its row's run)
    positions_ptr,  # [T] int64 in: the position (output-grad row) of each sorted id
    grad_ptr,       # [T, H] in: grad of the lookup's output, rows stride_g apart, unit stride
    main_grad_ptr,  # [V, H] fp32 in/out (contiguous): += each row's sum in the grad's dtype
    T, H, stride_g,
    PARTIAL: tl.constexpr, PARTIAL_POW2: tl.constexpr, BLOCK_H: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    row = tl.load(ids_ptr + start)
    before = tl.load(ids_ptr + start - 1, mask=start > 0, other=-1)
    if before != row:  # the first position of this row's segment
        end = tl.load(ends_ptr + start)
        slot = tl.arange(0, PARTIAL_POW2)
        total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        p = start
        while p < end:  # one partial sum of at most PARTIAL rows, from zero, in order
            positions = tl.load(positions_ptr + p + slot, mask=(slot < PARTIAL) & (p + slot < end),
                                other=0)
            part = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for i in tl.static_range(PARTIAL):  # the loads are independent: all in flight
                position = tl.sum(tl.where(slot == i, positions, 0), axis=0)
                # a row past the end adds +0.0, which changes no sum started from +0.0
                part += tl.load(grad_ptr + position * stride_g + h, mask=h_ok & (p + i < end),
                                other=0.0).to(tl.float32)
            total += part
            p += PARTIAL
        rounded = total.to(grad_ptr.dtype.element_ty).to(tl.float32)
        dst = main_grad_ptr + row * H + h
        tl.store(dst, tl.load(dst, mask=h_ok, other=0.0) + rounded, mask=h_ok)


def add_embedding_grad(main_grad_VH: torch.Tensor, tokens_T: torch.Tensor,
                       grad_TH: torch.Tensor) -> None:
    """main_grad[v] += (sum of grad[t] over the tokens t == v), each sum rounded to grad's dtype
    (the module docstring gives the order). 3 launches: the sort, each position's segment end
    (a binary search in the sorted ids), the kernel; no host sync."""
    num_tokens, hidden = grad_TH.shape
    if num_tokens == 0 or hidden == 0:
        return
    if grad_TH.stride(-1) != 1:
        grad_TH = grad_TH.contiguous()
    ids_T, positions_T = torch.sort(tokens_T.to(torch.int64), stable=True)
    ends_T = torch.searchsorted(ids_T, ids_T, right=True)
    block_h = min(next_pow2(hidden), MAX_BLOCK_H)
    _embedding_grad_kernel[(num_tokens, cdiv(hidden, block_h))](
        ids_T, ends_T, positions_T, grad_TH, main_grad_VH, num_tokens, hidden, grad_TH.stride(0),
        PARTIAL=PARTIAL_ROWS, PARTIAL_POW2=next_pow2(PARTIAL_ROWS), BLOCK_H=block_h,
        num_warps=4)


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """out = weight[tokens]; the backward adds the weight's grad into main_grad, returns none."""

    @staticmethod
    def forward(ctx, tokens_T, weight_VH, main_grad_VH):
        ctx.save_for_backward(tokens_T)
        ctx.main_grad = main_grad_VH
        return F.embedding(tokens_T, weight_VH)

    @staticmethod
    def backward(ctx, grad_TH):
        tokens_T, = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            add_embedding_grad(ctx.main_grad, tokens_T, grad_TH)
        return None, None, None


def embedding_triton(tokens_T: torch.Tensor, weight_VH: torch.Tensor,
                     main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """weight[tokens] -> [T, H] (tokens [T] int); with `main_grad` (fp32 [V, H], contiguous) the
    weight's grad goes there (the module docstring), else autograd's as F.embedding's."""
    if main_grad is None:
        return F.embedding(tokens_T, weight_VH)
    if (main_grad.shape != weight_VH.shape or main_grad.dtype != torch.float32
            or not main_grad.is_contiguous()):
        raise ValueError(f"embedding: main grad {main_grad.dtype} {tuple(main_grad.shape)}: must "
                         f"be contiguous fp32 of the weight's shape {tuple(weight_VH.shape)}")
    return _EmbeddingIntoMainGrad.apply(tokens_T, weight_VH, main_grad)
