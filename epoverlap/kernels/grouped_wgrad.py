"""Experts' weight grads added into their fp32 main grad: the torch reference
`grouped_weight_grad_torch` of `grouped_wgrad_triton.grouped_weight_grad_triton`.

Shape legend: N rows (sorted by expert), I input features, O output features, E experts.

For each expert e: main_grad[e] += x_e^T @ grad_e, where x_e and grad_e are the rows
offsets[e-1] .. offsets[e]-1 (`offsets_E`: int32 cumulative row ends, on the device; rows past
the last end are padding that nothing reads). The product is formed in fp32 (bf16 and fp16
values are exact in fp32) and added to main_grad once; an expert with no rows is not touched.
This is the weight grad of `model.linear.grouped_gemm` (weights [E, I, O]) with
Megatron-LM's gradient-accumulation fusion: the fp32 main grad is the GEMM's accumulator, no
half-precision product is written and no separate add runs.

The Triton kernel computes the same sums; results differ from this reference only in the order
of the fp32 additions inside the product (tests: fp32 tolerance). Both are deterministic: each
element of main_grad is summed by one program in a fixed order, so a run repeats its bits.
The reference reads the offsets on the host when `counts` is not given (one device sync);
`sm_carveout` is taken for the op table's one signature and ignored (no kernel of its own).
"""

from __future__ import annotations

from itertools import accumulate as running_sum
from typing import Optional

import torch


def grouped_weight_grad_torch(main_grad_EIO: torch.Tensor, x_NI: torch.Tensor,
                              grad_NO: torch.Tensor, offsets_E: torch.Tensor,
                              counts: Optional[list[int]] = None,
                              sm_carveout: Optional[int] = None,
                              more: Optional[tuple] = None, accumulate: bool = True) -> None:
    """main_grad [E, I, O] (fp32) += per expert x_e^T @ grad_e; x [N, I], grad [N, O] of one
    dtype; offsets [E] int32 (counts [E] on the host, when known, spare the read). `more`
    (x2, grad2, offsets2): a second source added after the first, as a second call would;
    `accumulate` False: main_grad is overwritten (zeroed first)."""
    if not accumulate:
        main_grad_EIO.zero_()
    _add_source(main_grad_EIO, x_NI, grad_NO, offsets_E, counts)
    if more is not None:
        _add_source(main_grad_EIO, *more, None)


def _add_source(main_grad_EIO, x_NI, grad_NO, offsets_E, counts) -> None:
    ends = offsets_E.tolist() if counts is None else list(running_sum(counts))
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            product_IO = x_NI[start:end].t().float() @ grad_NO[start:end].float()
            main_grad_EIO[e].add_(product_IO)
        start = end
