"""Per-document attention on GPUs by a variable-length flash-attention kernel.

Owns `document_segments` (each document's query and key ranges of a packed microbatch as the
kernel's cumulative tables, made on the device from the document ids with no host sync) and
`varlen_document_attention` (the attention of a block of queries over the keys before it, kept
inside each document: `torch.nn.attention.varlen.varlen_attn`, causal with the last query of a
document at its last key, which is the per-document mask of `model.documents` on these
ranges).

The tables hold `capacity` documents per sample (--max-documents-per-sample): a sample with
fewer documents has empty entries (a zero-length document the kernel skips), so the tables keep
one shape and a CUDA graph can hold them; the data is checked against the capacity on the host
(`Documents.check_capacity`) before a batch reaches the device. `max_q`/`max_k` are the block
lengths, an upper bound of every document's.

`uses_varlen` says when the kernel runs: 16-bit CUDA tensors with a head dimension flash
attention takes; elsewhere (CPU, fp32) the masked SDPA of `model.documents` is the reference.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch

MAX_HEAD_DIM = 256  # flash attention's largest head dimension


def uses_varlen(q: torch.Tensor) -> bool:
    """Whether attention over queries `q` [B, Q, n, D] runs the variable-length kernel."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] <= MAX_HEAD_DIM and q.shape[-1] % 8 == 0)


def document_segments(doc_BS: torch.Tensor, capacity: int, q_lo: int, q_hi: int, k_hi: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cumulative query and key tables (int32 [B x capacity + 1] each) of the queries at
    positions [q_lo, q_hi) over the keys at [0, k_hi) (k_hi >= q_hi), per document of each
    sample: document j of sample b has the queries of its positions inside [q_lo, q_hi) and
    the keys of its positions before k_hi, laid out sample after sample as the flattened
    [B x (q_hi - q_lo)] queries and [B x k_hi] keys are. `doc_BS`: each position's document
    index (`Documents.ids`), below `capacity`."""
    batch, device = doc_BS.shape[0], doc_BS.device
    counts_BJ = torch.zeros(batch, capacity, dtype=torch.int64, device=device)
    counts_BJ.scatter_add_(1, doc_BS, torch.ones_like(doc_BS))
    end_BJ = counts_BJ.cumsum(dim=1)
    start_BJ = end_BJ - counts_BJ
    q_len_BJ = (end_BJ.clamp(max=q_hi) - start_BJ.clamp(min=q_lo)).clamp(min=0)
    k_len_BJ = (end_BJ.clamp(max=k_hi) - start_BJ).clamp(min=0)
    return _cumulative(q_len_BJ), _cumulative(k_len_BJ)


def _cumulative(lengths_BJ: torch.Tensor) -> torch.Tensor:
    table = torch.zeros(lengths_BJ.numel() + 1, dtype=torch.int32, device=lengths_BJ.device)
    table[1:] = lengths_BJ.reshape(-1).cumsum(0)
    return table


def varlen_document_attention(q_BQnD: torch.Tensor, k_BGmD: torch.Tensor, v_BGmD: torch.Tensor,
                              doc_BS: torch.Tensor, capacity: int, q_lo: int = 0
                              ) -> torch.Tensor:
    """Queries at positions [q_lo, q_lo + n) over the keys at [0, m) of the same samples, each
    query seeing the earlier keys of its own document -> [B, Q, n, D]."""
    batch, heads, n, dim = q_BQnD.shape
    m = k_BGmD.shape[2]
    cu_q, cu_k = document_segments(doc_BS, capacity, q_lo, q_lo + n, m)
    q_TQD = q_BQnD.transpose(1, 2).reshape(batch * n, heads, dim)
    k_TGD = k_BGmD.transpose(1, 2).reshape(batch * m, k_BGmD.shape[1], dim)
    v_TGD = v_BGmD.transpose(1, 2).reshape(batch * m, v_BGmD.shape[1], dim)
    out_TQD = _varlen_attn()(q_TQD, k_TGD, v_TGD, cu_q, cu_k, n, m, **_causal_kwargs())
    return out_TQD.view(batch, n, heads, dim).transpose(1, 2)


@lru_cache(maxsize=1)
def _varlen_attn():
    from torch.nn.attention.varlen import varlen_attn  # torch 2.9 and later
    return varlen_attn


@lru_cache(maxsize=1)
def _causal_kwargs() -> dict:
    """Causal (bottom-right) in the installed torch's spelling: window_size=(-1, 0) where
    varlen_attn takes it (torch 2.11 and 2.13), else is_causal=True; grouped-query K/V asked
    for where the signature has enable_gqa (2.11's kernel takes them without it)."""
    params = inspect.signature(_varlen_attn()).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs
