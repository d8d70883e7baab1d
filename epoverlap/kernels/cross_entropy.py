"""Cross-entropy: the torch reference `cross_entropy_torch` (the model's loss, unchanged).

Shape legend: T rows (tokens), V vocabulary.

loss = mean over the rows whose label is not `IGNORE_INDEX` of (logsumexp(x32) - x32[label]),
x32 = logits.float(): torch's `F.cross_entropy` on the fp32 cast of the logits, so the loss is
fp32 whatever the logits' dtype, and the grad of the logits comes back in their dtype.
Differentiable in the logits through autograd; deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # torch's and Megatron-core's: a label that counts in neither sum nor mean


def check_cross_entropy_args(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> None:
    """Shapes and dtypes both implementations accept (ValueError naming the argument)."""
    if logits_TV.dim() != 2:
        raise ValueError(f"cross_entropy: logits shape {tuple(logits_TV.shape)}: must be [T, V]")
    if labels_T.shape != logits_TV.shape[:1]:
        raise ValueError(f"cross_entropy: labels shape {tuple(labels_T.shape)}: must be "
                         f"({logits_TV.shape[0]},) for logits {tuple(logits_TV.shape)}")
    if labels_T.dtype != torch.int64:
        raise ValueError(f"cross_entropy: labels dtype {labels_T.dtype}: must be torch.int64")


def cross_entropy_torch(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits [T, V] against labels [T] int64 -> fp32 scalar."""
    check_cross_entropy_args(logits_TV, labels_T)
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX)
