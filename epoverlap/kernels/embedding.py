"""Embedding lookup: the torch reference `embedding_torch` (F.embedding), whose weight grad can go
into an fp32 main grad.

Shape legend: T tokens, V vocabulary rows (padded), H hidden.

out[t] = weight[tokens[t]]. With `main_grad`, the weight's grad (autograd's dense [V, H] in the
weight's dtype: each row the sum of its tokens' output grads) is added to the main grad in the
backward (`main_grad.into_main_grad`) and the weight gets none: the bits of the grad buffers'
hook. The Triton form (`embedding_triton`) adds only the rows the tokens hold, in torch's CUDA
order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .main_grad import into_main_grad


def embedding_torch(tokens_T: torch.Tensor, weight_VH: torch.Tensor,
                    main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """weight[tokens] -> [T, H]; with `main_grad` (fp32 [V, H]) the weight's grad is added there."""
    return F.embedding(tokens_T, weight_VH if main_grad is None
                       else into_main_grad(weight_VH, main_grad))
