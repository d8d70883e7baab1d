"""Cross-entropy in Triton: `cross_entropy_triton`, a drop-in for
`cross_entropy.cross_entropy_torch`.

Shape legend: T rows (tokens), V vocabulary, N the logits' columns (V, or more where the
output layer is padded: --make-vocab-size-divisible-by), P forward programs.

`cross_entropy_triton` (the op table's) runs the fused kernels (`fused_cross_entropy`) from
FUSED_MIN_VOCAB up and the reference below it. At a small vocabulary the reference's GPU time
is tiny and its chain of C++ ops costs the host less per forward + backward than one autograd
Function with a Python backward; at a large one the fused loss needs a fraction of the
reference's GPU time and memory (it never writes a T x V fp32 tensor, below). Which one runs
is a pure function of V, so every rank, microbatch and schedule of a run computes the same
bits; V is the real vocabulary, so a padded output layer takes the unpadded one's path.

What it replaces: the reference casts the [T, V] logits to fp32 (a new T x V fp32 tensor),
takes their log-softmax (another, saved for the backward) and gathers the labels' entries; its
backward writes a T x V fp32 grad twice (the gather's scatter, then the log-softmax's) and casts
it back. Here the logits are read in their own dtype and nothing T x V is written forward:
  `_ce_fwd_kernel`: BLOCK_T rows per program, walking V in BLOCK_V column steps with an online
    max / sum of exponentials in fp32: per row the logsumexp (kept for the backward, fp32 [T]) and
    lse - x[label]; per program the sum of its rows' losses and its count of counted rows
    (fp32 [2, P], no atomics).
  `_ce_mean_kernel`: one program sums the P partials in a fixed order: the mean loss (fp32
    scalar), and 1 / count for the backward.
  `_ce_bwd_kernel`: grad x = (exp(x - lse) - [v == label]) * grad_loss / count, written once in
    the logits' dtype (0 on ignored rows, and on the padding columns V..N-1, which the forward
    never reads: they are out of the softmax). grad_loss is read on the device: no host sync.
Forward 2 launches, backward 1; deterministic (fixed summation orders, a pure function of V for
the tiles). Saved for the backward: the logits (the reference saves an fp32 T x V log-softmax,
twice their size in bf16) and the fp32 [T] logsumexp.

Precision: fp32 inside; the loss agrees with the reference to fp32 rounding (summation order,
exp / log ulps), the grad to one rounding of the logits' dtype. A row whose label is outside
[0, V) (a padding column included) and not IGNORE_INDEX gets a NaN loss (the reference raises;
a device check would need a host sync or a debug build): `--check-for-nan-in-loss-and-grad`
stops such a step.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .cross_entropy import IGNORE_INDEX, check_cross_entropy_args, cross_entropy_torch
from .launch_cache import launch_cached
from .triton_utils import cdiv, next_pow2

TILE_ELEMENTS = 4096  # logits per program and column step: 16 fp32 per thread at 8 warps
FUSED_MIN_VOCAB = 4096  # smaller vocabularies take the reference (module docstring)
MEAN_BLOCK = 1024     # partials per step of the mean kernel


@functools.lru_cache(maxsize=64)
def cross_entropy_tile(vocab: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_V, num_warps): whole rows in one step up to V = 4096, several rows per
    program for small V (V 257 -> 8 x 512), one row in 4096-column steps above (V 151936 -> 38
    steps). A pure function of V, so every rank and run sums in the same order."""
    block_v = min(next_pow2(vocab), TILE_ELEMENTS)
    block_t = max(1, min(64, TILE_ELEMENTS // block_v))
    return block_t, block_v, 8 if block_t * block_v >= 4096 else 4


@triton.jit
def _row_logits(logits_ptr, rows, row_ok, stride_t, cols, V):
    """[BLOCK_T, BLOCK_V] fp32 logits of `rows` at `cols`: -inf past V, 0 on rows past T (so a
    padding row's max stays finite and its sums never see inf - inf)."""
    mask = row_ok[:, None] & (cols < V)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)
    return tl.where((cols < V)[None, :], x.to(tl.float32), float("-inf"))


@launch_cached
@triton.jit(do_not_specialize=["T", "P"])  # token counts vary between models and stages
def _ce_fwd_kernel(
    logits_ptr,   # [T, N] in: rows stride_t apart, unit stride along N; columns < V read
    labels_ptr,   # [T] int64 in
    lse_ptr,      # [T] fp32 out: logsumexp of each row
    part_ptr,     # [2, P] fp32 out: per program, its rows' loss sum, then its counted rows
    T, V, stride_t, P,
    IGNORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    run_max = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    v0 = 0
    while v0 < V:  # column steps in order: the sums have one order per V
        x = _row_logits(logits_ptr, rows, row_ok, stride_t, v0 + tl.arange(0, BLOCK_V), V)
        new_max = tl.maximum(run_max, tl.max(x, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + \
            tl.sum(tl.exp(x - new_max[:, None]), axis=1)
        run_max = new_max
        v0 += BLOCK_V
    lse = run_max + tl.log(run_sum)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    label = tl.load(labels_ptr + rows, mask=row_ok, other=IGNORE)
    counted = row_ok & (label != IGNORE)
    in_range = (label >= 0) & (label < V)
    target = tl.load(logits_ptr + rows * stride_t + label, mask=counted & in_range, other=0.0)
    loss = tl.where(in_range, lse - target.to(tl.float32), float("nan"))
    tl.store(part_ptr + pid, tl.sum(tl.where(counted, loss, 0.0), axis=0))
    tl.store(part_ptr + P + pid, tl.sum(counted.to(tl.float32), axis=0))


@launch_cached
@triton.jit(do_not_specialize=["P"])
def _ce_mean_kernel(
    part_ptr,   # [2, P] fp32 in
    loss_ptr,   # [] fp32 out: the mean loss
    scale_ptr,  # [1] fp32 out: 1 / counted rows (for the backward)
    P, BLOCK: tl.constexpr,
):
    loss_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    count_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    p0 = 0
    while p0 < P:  # blocks accumulated elementwise in order, then one fixed tree sum
        p = p0 + tl.arange(0, BLOCK)
        loss_acc += tl.load(part_ptr + p, mask=p < P, other=0.0)
        count_acc += tl.load(part_ptr + P + p, mask=p < P, other=0.0)
        p0 += BLOCK
    inv_count = 1.0 / tl.sum(count_acc, axis=0)  # inf with no counted row: the mean is NaN
    tl.store(loss_ptr, tl.sum(loss_acc, axis=0) * inv_count)
    tl.store(scale_ptr, inv_count)


@launch_cached
@triton.jit(do_not_specialize=["T"])
def _ce_bwd_kernel(
    logits_ptr,  # [T, N] in: rows stride_t apart; columns < V read
    labels_ptr,  # [T] int64 in
    lse_ptr,     # [T] fp32 in
    scale_ptr,   # [1] fp32 in: 1 / counted rows (the forward's)
    grad_ptr,    # [] in: grad of the mean loss
    dx_ptr,      # [T, N] out (contiguous): the logits' dtype; 0 from column V on
    T, V, N, stride_t,
    IGNORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    label = tl.load(labels_ptr + rows, mask=row_ok, other=IGNORE)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    scale = tl.load(grad_ptr).to(tl.float32) * tl.load(scale_ptr)
    row_scale = tl.where(label != IGNORE, scale, 0.0)
    v0 = 0
    while v0 < N:  # past V, x is -inf and the label never there: exp(-inf) - 0 gives 0
        cols = v0 + tl.arange(0, BLOCK_V)
        x = _row_logits(logits_ptr, rows, row_ok, stride_t, cols, V)
        onehot = (cols[None, :] == label[:, None]).to(tl.float32)
        dx = (tl.exp(x - lse[:, None]) - onehot) * row_scale[:, None]
        mask = row_ok[:, None] & (cols < N)[None, :]
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
        v0 += BLOCK_V


class _CrossEntropyTriton(torch.autograd.Function):
    """Mean cross-entropy over the first `vocab` columns; saves the logits, labels, logsumexp
    and 1 / count."""

    @staticmethod
    def forward(ctx, logits_TV, labels_T, vocab):
        rows = logits_TV.shape[0]
        block_t, block_v, num_warps = cross_entropy_tile(vocab)
        programs = cdiv(rows, block_t)
        device = logits_TV.device
        # one fp32 buffer: lse [T], 1 / count [1], partials [2, P]
        buf = torch.empty(rows + 1 + 2 * programs, dtype=torch.float32, device=device)
        lse_T, scale_1, part_2P = buf[:rows], buf[rows:rows + 1], buf[rows + 1:]
        loss = torch.empty((), dtype=torch.float32, device=device)
        if programs:
            _ce_fwd_kernel[(programs,)](
                logits_TV, labels_T, lse_T, part_2P, rows, vocab, logits_TV.stride(0), programs,
                IGNORE=IGNORE_INDEX, BLOCK_T=block_t, BLOCK_V=block_v, num_warps=num_warps)
        _ce_mean_kernel[(1,)](part_2P, loss, scale_1, programs, BLOCK=MEAN_BLOCK, num_warps=4)
        ctx.save_for_backward(logits_TV, labels_T, lse_T, scale_1)
        ctx.vocab = vocab
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits_TV, labels_T, lse_T, scale_1 = ctx.saved_tensors
        rows, columns = logits_TV.shape
        dx_TV = torch.empty((rows, columns), dtype=logits_TV.dtype, device=logits_TV.device)
        if rows:
            block_t, block_v, num_warps = cross_entropy_tile(ctx.vocab)
            _ce_bwd_kernel[(cdiv(rows, block_t),)](
                logits_TV, labels_T, lse_T, scale_1, grad_loss.contiguous(), dx_TV, rows,
                ctx.vocab, columns, logits_TV.stride(0), IGNORE=IGNORE_INDEX, BLOCK_T=block_t,
                BLOCK_V=block_v, num_warps=num_warps)
        return dx_TV, None, None


def fused_cross_entropy(logits_TV: torch.Tensor, labels_T: torch.Tensor,
                        vocab: Optional[int] = None) -> torch.Tensor:
    """Mean token cross-entropy of logits [T, N] (fp32 or half) against labels [T] int64 ->
    fp32 scalar, by the Triton kernels at any V; rows labelled IGNORE_INDEX count in neither
    the sum nor the mean. `vocab`: the real vocabulary V <= N (None: N); columns V..N-1 (an
    output layer's padding) are left out of the softmax and get zero grad.

    Same contract as `cross_entropy.cross_entropy_torch` but for labels outside [0, V) (module
    docstring). Differentiable in the logits (their grad in their dtype). Forward 2 launches,
    backward 1; no host sync; deterministic.
    """
    vocab = check_cross_entropy_args(logits_TV, labels_T, vocab)
    if logits_TV.stride(-1) != 1:
        logits_TV = logits_TV.contiguous()
    return _CrossEntropyTriton.apply(logits_TV, labels_T.contiguous(), vocab)


def cross_entropy_triton(logits_TV: torch.Tensor, labels_T: torch.Tensor,
                         vocab: Optional[int] = None) -> torch.Tensor:
    """The op table's loss over the first `vocab` columns (the real vocabulary; None: all):
    `fused_cross_entropy` from V = FUSED_MIN_VOCAB up, the torch reference below (module
    docstring)."""
    real = vocab if vocab is not None else logits_TV.shape[-1]
    if logits_TV.dim() == 2 and real >= FUSED_MIN_VOCAB:
        return fused_cross_entropy(logits_TV, labels_T, vocab)
    return cross_entropy_torch(logits_TV, labels_T, vocab)
