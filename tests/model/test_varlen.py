"""Per-document attention's variable-length tables (`model.varlen`) against the explicit mask of
`Documents.visible`; on a GPU (marker `gpu`) the kernel's output and grads against the masked
SDPA reference, whole sequences and CP chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epoverlap.model.documents import Documents
from epoverlap.model.varlen import document_segments, varlen_document_attention

EOD = 7


def _tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOD, (batch, seq), generator=gen)
    ends = torch.rand(batch, seq, generator=gen) < 0.15
    return tokens.masked_fill(ends, EOD)


def _mask_of_tables(cu_q, cu_k, n: int, m: int, batch: int, q_lo: int) -> torch.Tensor:
    """[B, 1, n, m] who sees whom by the tables alone: within an entry, causal with the
    entry's last query at its last key (the kernel's bottom-right rule)."""
    mask = torch.zeros(batch, 1, n, m, dtype=torch.bool)
    for j in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = (int(cu_q[j]), int(cu_q[j + 1]), int(cu_k[j]), int(cu_k[j + 1]))
        if q1 == q0:
            continue
        b = q0 // n
        assert b == (q1 - 1) // n and (k1 == k0 or b == (k1 - 1) // m), "entry crosses samples"
        for qi in range(q0, q1):
            last_key = k1 - (q1 - qi)  # bottom-right: the entry's last query sees k1 - 1
            mask[b, 0, qi - b * n, k0 - b * m:last_key - b * m + 1] = True
    return mask


@pytest.mark.parametrize("q_lo,n,m", [(0, 48, 48), (12, 12, 24), (36, 12, 48), (0, 12, 12)])
def test_the_tables_see_what_the_document_mask_sees(q_lo, n, m):
    docs = Documents(EOD, reset_positions=False, reset_mask=True, capacity=48)
    tokens = _tokens(3, 48, seed=q_lo + n)
    doc_BS = docs.ids(tokens)
    cu_q, cu_k = document_segments(doc_BS, docs.capacity, q_lo, q_lo + n, m)
    assert cu_q.dtype == torch.int32 and cu_q.numel() == 3 * 48 + 1
    assert int(cu_q[-1]) == 3 * n and int(cu_k[-1]) == 3 * m
    expected = docs.visible(doc_BS, torch.arange(q_lo, q_lo + n), torch.arange(m))
    assert torch.equal(_mask_of_tables(cu_q, cu_k, n, m, 3, q_lo), expected)


def test_a_sample_over_the_capacity_stops_the_run_naming_the_flag():
    tokens = torch.tensor([[1, EOD, 2, EOD, 3, 4]])
    Documents(EOD, False, True, capacity=3).check_capacity(tokens)  # 3 documents fit
    with pytest.raises(ValueError, match=r"--max-documents-per-sample=2: a sample holds 3"):
        Documents(EOD, False, True, capacity=2).check_capacity(tokens)
    Documents(EOD, True, False, capacity=1).check_capacity(tokens)  # no per-document mask


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("q_lo,n,m", [(0, 1024, 1024), (256, 256, 512), (768, 256, 1024)])
def test_the_kernel_matches_masked_sdpa_on_a_gpu(q_lo, n, m):
    """bf16, grouped-query (8 query heads over 2 K/V heads): output and the three grads
    within bf16 rounding of the masked SDPA in fp32."""
    docs = Documents(EOD, reset_positions=False, reset_mask=True, capacity=256)
    tokens = _tokens(2, 1024, seed=5).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, n, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    k = torch.randn(2, 2, m, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    v = torch.randn(2, 2, m, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    doc_BS = docs.ids(tokens)
    out = varlen_document_attention(q, k, v, doc_BS, docs.capacity, q_lo=q_lo)
    mask = docs.visible(doc_BS, torch.arange(q_lo, q_lo + n, device="cuda"),
                        torch.arange(m, device="cuda"))
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1),
                                         v.float().repeat_interleave(4, 1), attn_mask=mask)
    # a query that sees no key (none here: every query sees itself) would differ
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.float())
    for a, b in zip(got, want):
        assert torch.allclose(a.float(), b.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_one_document_table_is_the_lower_right_causal_sdpa_on_a_gpu():
    """CP's gathered attention without documents: queries of the last chunk over every key."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 8, 256, 128, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1, 2, 1024, 128, device="cuda", generator=gen).bfloat16()
    v = torch.randn(1, 2, 1024, 128, device="cuda", generator=gen).bfloat16()
    out = varlen_document_attention(q, k, v, torch.zeros(1, 1024, dtype=torch.int64,
                                                         device="cuda"), 1, q_lo=768)
    visible = torch.ones(256, 1024, dtype=torch.bool, device="cuda").tril(diagonal=768)
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1),
                                         v.float().repeat_interleave(4, 1), attn_mask=visible)
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)
