"""Cross-entropy: the torch reference `cross_entropy_torch` (the model's loss, unchanged).

Shape legend: T rows (tokens), V vocabulary (V_padded: the logits' columns, V or more).

loss = mean over the rows whose label is not `IGNORE_INDEX` of (logsumexp(x32) - x32[label]),
x32 = logits[:, :vocab].float(): torch's `F.cross_entropy` on the fp32 cast of the logits' first
`vocab` columns, so the loss is fp32 whatever the logits' dtype, and the grad of the logits
comes back in their dtype.
Differentiable in the logits through autograd; deterministic.

`vocab`: the real vocabulary. A model whose output layer is padded to an aligned row count
(--make-vocab-size-divisible-by) gives logits [T, V_padded] and the real V: the columns from V
on are left out of the softmax (as if -inf), so the loss is the unpadded model's, and their
grad is zero. None (or V_padded itself) takes every column, the unpadded model's bits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # torch's and Megatron-core's: a label that counts in neither sum nor mean


def check_cross_entropy_args(logits_TV: torch.Tensor, labels_T: torch.Tensor,
                             vocab: Optional[int] = None) -> int:
    """Shapes and dtypes both implementations accept (ValueError naming the argument) -> the
    real vocabulary: `vocab`, or the logits' columns when None."""
    if logits_TV.dim() != 2:
        raise ValueError(f"cross_entropy: logits shape {tuple(logits_TV.shape)}: must be [T, V]")
    if labels_T.shape != logits_TV.shape[:1]:
        raise ValueError(f"cross_entropy: labels shape {tuple(labels_T.shape)}: must be "
                         f"({logits_TV.shape[0]},) for logits {tuple(logits_TV.shape)}")
    if labels_T.dtype != torch.int64:
        raise ValueError(f"cross_entropy: labels dtype {labels_T.dtype}: must be torch.int64")
    columns = logits_TV.shape[1]
    if vocab is None:
        return columns
    if not 1 <= vocab <= columns:
        raise ValueError(f"cross_entropy: vocab {vocab}: must be in [1, {columns}] (the "
                         f"logits' columns)")
    return vocab


def cross_entropy_torch(logits_TV: torch.Tensor, labels_T: torch.Tensor,
                        vocab: Optional[int] = None) -> torch.Tensor:
    """Mean token cross-entropy of logits [T, V_padded] against labels [T] int64 -> fp32
    scalar, over the first `vocab` columns (the real vocabulary; None: all of them)."""
    vocab = check_cross_entropy_args(logits_TV, labels_T, vocab)
    if vocab < logits_TV.shape[1]:
        logits_TV = logits_TV[:, :vocab]  # the slice's backward gives the padding zero grads
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX)
