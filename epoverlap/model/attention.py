"""The attention block's layers: RMSNorm, the rotary tables and `Attention`, causal
grouped-query self-attention with rotary embeddings (torch SDPA), whose projection and output
are separate steps (`project`, `output`) so a layer can put a K/V exchange between them
(`model.context`, context parallelism).

Shape legend: B sequences, S sequence length (this rank's tokens under CP), T = B*S tokens,
H hidden, Q query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from epoverlap.config import ModelConfig
from epoverlap.kernels import MoEOps
from epoverlap.model.context import ContextParallel
from epoverlap.model.documents import Documents
from epoverlap.model.varlen import uses_varlen, varlen_document_attention
from epoverlap.model.dropout import causal_attention, grouped_kv
from epoverlap.model.linear import fused_main_grad, linear
from epoverlap.model.init import param_seed, seeded_normal_


class RMSNorm(nn.Module):
    """RMSNorm through the op table (fused Triton kernel on GPU, torch reference on CPU); its
    weight grad goes into the weight's fp32 main grad inside the op's backward wherever the
    GEMMs' do (`model.linear.fused_main_grad`)."""

    def __init__(self, hidden: int, eps: float, ops: MoEOps, dtype, device):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x_TH, self.weight, self.eps,
                                 main_grad=fused_main_grad(self.weight))


def rotary_tables(seq_len: int, head_dim: int, base: float, device) -> tuple:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles_SD = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles_SD.cos(), angles_SD.sin()


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings; with --qk-layernorm an
    RMSNorm over each head's query (`q_norm`) and key (`k_norm`) before rotary, one weight
    [D] each shared by the heads, as Megatron-core's q_layernorm / k_layernorm."""

    def __init__(self, m: ModelConfig, seed: int, layer: int, ops: MoEOps, *, dtype, device,
                 queue, context: Optional[ContextParallel] = None,
                 documents: Optional[Documents] = None):
        """`seed`: the run's (--seed), each parameter's init drawn from it. `context`: this
        layer's view of the CP group (None without CP): the rotary positions are its chunks'
        and the core attention exchanges K/V over it. `documents`: the packed samples' rules
        (--reset-position-ids, --reset-attention-mask; None: neither): the forward then takes
        the microbatch's tokens, where the documents end."""
        super().__init__()
        self.ops, self.context, self.documents = ops, context, documents
        self.heads, self.kv_heads, self.head_dim = m.num_attention_heads, m.kv_heads, m.head_dim
        self.seq_length, self.queue = m.seq_length // (context.size if context else 1), queue
        self.layer, self.dropout_p = layer, m.attention_dropout
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv = nn.Parameter(torch.empty(qkv_out, m.hidden_size, dtype=dtype, device=device))
        self.proj = nn.Parameter(torch.empty(m.hidden_size, self.heads * self.head_dim,
                                             dtype=dtype, device=device))
        std = m.init_method_std
        seeded_normal_(self.qkv, std, param_seed(seed, "qkv", layer))
        seeded_normal_(self.proj, std / math.sqrt(2 * m.num_layers), param_seed(seed, "proj",
                                                                                 layer))
        self.q_norm = self.k_norm = None
        if m.qk_layernorm:
            self.q_norm = RMSNorm(self.head_dim, m.norm_epsilon, ops, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, m.norm_epsilon, ops, dtype, device)
        cos_SD, sin_SD = rotary_tables(m.seq_length, m.head_dim, m.rotary_base, device)
        self.per_token = ((documents is not None and documents.reset_positions)
                          or (context is not None and context.dynamic))
        if context is not None and not self.per_token:  # [s, D]: this rank's positions' rows
            cos_SD, sin_SD = cos_SD[context.positions], sin_SD[context.positions]
        self.register_buffer("cos_SD", cos_SD, persistent=False)
        self.register_buffer("sin_SD", sin_SD, persistent=False)

    def forward(self, x_TH: torch.Tensor, dropout_seed: Optional[int] = None,
                tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`dropout_seed`: the microbatch's (`model.dropout`), read with attention dropout in
        training only; `tokens` [B, S]: the microbatch's whole sequences (with `documents`)."""
        q_BQSD, k_BGSD, v_BGSD = self.project(x_TH, tokens)
        # grouped-query attention inside SDPA where a fused kernel takes it (16-bit on GPUs):
        # expanding K/V with repeat_interleave first materializes the repeated keys and values
        # (more GPU time and more host launches) for the same output bits
        if self.context is not None:  # S is this rank's s tokens (model.context)
            out_BQSD = self.context.attention(q_BQSD, k_BGSD, v_BGSD, tokens)
        elif self.documents is not None and self.documents.reset_mask:
            out_BQSD = document_attention(q_BQSD, k_BGSD, v_BGSD, self.documents, tokens)
        else:
            out_BQSD = causal_attention(q_BQSD, k_BGSD, v_BGSD, layer=self.layer,
                                        seed=dropout_seed,
                                        p=self.dropout_p if self.training else 0.0)
        return self.output(out_BQSD)

    def project(self, x_TH: torch.Tensor, tokens: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [B, Q, S, D], k and v [B, G, S, D]: projected, normed, rotated."""
        seq, dim = self.seq_length, self.head_dim
        batch = x_TH.shape[0] // seq
        qkv_TX = linear(x_TH, self.qkv, self.queue)
        q, k, v = qkv_TX.split([self.heads * dim, self.kv_heads * dim, self.kv_heads * dim], -1)
        q_BSQD = q.view(batch, seq, self.heads, dim)
        k_BSGD = k.view(batch, seq, self.kv_heads, dim)
        if self.q_norm is not None:  # over D of each head, before rotary (Megatron-core's order)
            q_BSQD, k_BSGD = self.q_norm(q_BSQD), self.k_norm(k_BSGD)
        q_BQSD, k_BGSD = q_BSQD.transpose(1, 2), k_BSGD.transpose(1, 2)
        v_BGSD = v.view(batch, seq, self.kv_heads, dim).transpose(1, 2)
        positions_BS = self._positions(tokens)
        return self._rotate(q_BQSD, positions_BS), self._rotate(k_BGSD, positions_BS), v_BGSD

    def _positions(self, tokens: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """[B, S] each local token's rotary position where they restart per document or
        dynamic CP picks the segment (None: the table's rows are the positions)."""
        if not self.per_token:
            return None
        if self.context is not None:
            return self.context.rotary_positions(tokens, self.documents)
        return self.documents.positions(tokens)

    def _rotate(self, x_BNSD: torch.Tensor, positions_BS: Optional[torch.Tensor]):
        if positions_BS is None:
            return self.ops.rotary(x_BNSD, self.cos_SD, self.sin_SD)
        batch, heads, seq, dim = x_BNSD.shape  # the sequences side by side: one [B*S] table
        rows = positions_BS.reshape(-1)
        flat = x_BNSD.transpose(0, 1).reshape(1, heads, batch * seq, dim)
        out = self.ops.rotary(flat, self.cos_SD[rows], self.sin_SD[rows])
        return out.view(heads, batch, seq, dim).transpose(0, 1)

    def output(self, out_BQSD: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [B, Q, S, D] -> the output projection's [T, H]."""
        batch, _, seq, _ = out_BQSD.shape
        out_TX = out_BQSD.transpose(1, 2).reshape(batch * seq, self.heads * self.head_dim)
        return linear(out_TX, self.proj, self.queue)


def document_attention(q_BQSD, k_BGSD, v_BGSD, documents: Documents, tokens_BS):
    """Causal attention kept inside each document (--reset-attention-mask): on GPUs in 16 bits
    the variable-length kernel (`model.varlen`), else SDPA with the explicit [B, 1, S, S]
    mask of `Documents.visible` (the reference)."""
    doc_BS = documents.ids(tokens_BS)
    if uses_varlen(q_BQSD):
        return varlen_document_attention(q_BQSD, k_BGSD, v_BGSD, doc_BS, documents.capacity)
    k_BGSD, v_BGSD, gqa = grouped_kv(q_BQSD, k_BGSD, v_BGSD)
    positions = torch.arange(q_BQSD.shape[2], device=q_BQSD.device)
    mask = documents.visible(doc_BS, positions, positions)
    return F.scaled_dot_product_attention(q_BQSD, k_BGSD, v_BGSD, attn_mask=mask,
                                          enable_gqa=gqa)
