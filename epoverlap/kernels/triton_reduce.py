"""Device-side reduction helpers shared by the Triton kernels (imported only with triton).

Owns `sum_partial_rows`: the fixed-order sum over P rows of a [P, W] fp32 buffer of per-program
partial sums, the second half of every deterministic two-pass reduction here (RMSNorm's weight
grad, the router's aux-loss score sums): each program of the first pass writes its own row, no
atomics, so the result has the same bits on every run.
"""

import triton
import triton.language as tl


@triton.jit
def sum_partial_rows(part_ptr, P, W, cols, BLOCK_P: tl.constexpr):
    """sum over p < P of part[p, cols] (fp32 [len(cols)]; columns >= W read as 0): BLOCK_P-row
    tiles accumulated elementwise in order, then one fixed tree sum over the tile's rows."""
    acc = tl.zeros((BLOCK_P, cols.shape[0]), dtype=tl.float32)
    p0 = 0
    while p0 < P:
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & (cols < W)[None, :]
        acc += tl.load(part_ptr + p[:, None] * W + cols[None, :], mask=mask, other=0.0)
        p0 += BLOCK_P
    return tl.sum(acc, axis=0)
