"""The model's GEMM arithmetic, from its config alone: FLOPs per token of a training step
(`training_flops_per_token`, epoverlap's count, and `megatron_flops_per_token`, Megatron-LM's
formula for its logged TFLOP/s and the MFU), and the GEMM dimensions that tensor-core kernels
do not align (`unaligned_gemm_dims`, the start-up line). The logit GEMM is over the padded
vocabulary (`ModelConfig.padded_vocab_size`) in both.
"""

from __future__ import annotations

from epoverlap.config import ModelConfig, MoEConfig, moe_layer_pattern

GEMM_ALIGNMENT = 8  # elements: 16 bytes of bf16, what cuBLAS's tensor-core kernels align to


def unaligned_gemm_dims(m: ModelConfig, moe: MoEConfig) -> list[tuple[str, int, str]]:
    """The model's GEMM dimensions that are not multiples of GEMM_ALIGNMENT elements, as
    (what, size, the flags that set it): a tensor-core GEMM with such a leading dimension falls
    back to a kernel of narrower loads, several times slower (the logit GEMM at vocabulary
    151937 against 152064, for one)."""
    pattern = moe_layer_pattern(m.num_layers, moe)
    dims = [("hidden size", m.hidden_size, "--hidden-size"),
            ("head dim", m.head_dim, "--kv-channels" if m.kv_channels else
             "--hidden-size / --num-attention-heads")]
    if m.kv_heads != m.num_attention_heads:  # else the query width's
        dims.append(("key/value width", m.kv_heads * m.head_dim,
                     "--num-query-groups x head dim"))
    experts_take_ffn = any(pattern) and moe.moe_ffn_hidden_size is None
    if not all(pattern) or experts_take_ffn:  # a dense layer, or experts of that width
        dims.append(("FFN", m.ffn_hidden_size, "--ffn-hidden-size"))
    if any(pattern):
        if moe.moe_ffn_hidden_size is not None:
            dims.append(("expert FFN", moe.moe_ffn_hidden_size, "--moe-ffn-hidden-size"))
        dims.append(("router experts", moe.num_experts, "--num-experts"))
        if moe.moe_shared_expert_intermediate_size:
            dims.append(("shared expert FFN", moe.moe_shared_expert_intermediate_size,
                         "--moe-shared-expert-intermediate-size"))
    dims.append(("vocabulary", m.padded_vocab_size,
                 "the data's tokenizer, padded to a multiple of "
                 f"--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by}"))
    return [dim for dim in dims if dim[1] % GEMM_ALIGNMENT]


def training_flops_per_token(m: ModelConfig, moe: MoEConfig) -> float:
    """Matmul + attention FLOPs per token of one training step (3x forward; causal attention).
    Differs from `megatron_flops_per_token` only by the router GEMM (2 H E per token per MoE
    layer forward), which this counts and Megatron-LM does not; the causal attention (half the
    S x S scores) and the logit GEMM over the padded vocabulary are counted alike. Norms (the
    query/key norms of --qk-layernorm too), rotary and activations are elementwise: no GEMM
    FLOPs, in neither count."""
    attn_params = m.hidden_size * (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim \
        + m.num_attention_heads * m.head_dim * m.hidden_size
    attn_scores = 2 * m.seq_length * m.num_attention_heads * m.head_dim
    forward = 2 * m.padded_vocab_size * m.hidden_size
    for is_moe in moe_layer_pattern(m.num_layers, moe):
        if is_moe:
            ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size
            mlp = m.hidden_size * moe.num_experts + moe.moe_router_topk * 3 * m.hidden_size * ffn
            mlp += 3 * m.hidden_size * (moe.moe_shared_expert_intermediate_size or 0)
        else:
            mlp = 3 * m.hidden_size * m.ffn_hidden_size
        forward += 2 * (attn_params + mlp) + attn_scores
    return 3.0 * forward


def megatron_flops_per_token(m: ModelConfig, moe: MoEConfig) -> float:
    """FLOPs per token of one training step as Megatron-LM counts them (the TFLOP/s it logs):
    `num_floating_point_operations(args, batch_size) / (batch_size * seq_length)`, the
    `transformer_flops()` path of megatron/training/training.py at NVIDIA/Megatron-LM tag
    core_v0.16.1 (commit 55ac7082517c3878ae653c07c09c534b8aed49f6), for the parts this model
    has: GQA attention, SwiGLU dense and expert MLPs, top-k routed experts, a shared expert,
    the logit layer; no MLA, MTP, linear attention or attention output gate. With
    H hidden, S sequence, Q/G query/key-value heads, D head dim, F dense FFN, Fe expert FFN,
    k top-k, Fs shared FFN, V vocabulary, 3 (forward, wgrad, dgrad) x 2 (multiply-add):
      per layer  6 (H (Q + 2G) D + Q D S / 2 x 2 + Q D H)   (qkv, causal QK^T and AV, out)
      dense MLP  6 H x 3F;  MoE layer  6 H x 3 (k Fe + Fs)  (the router is not counted)
      logits     6 H V
    V is the padded vocabulary, `ModelConfig.padded_vocab_size` (the tokenizer's, + 1 for
    NullTokenizer, rounded up to --make-vocab-size-divisible-by), as Megatron-LM counts its
    `padded_vocab_size` (rounded up to --make-vocab-size-divisible-by x TP, TP 1 here): the
    logit GEMM runs over the padding rows too. At vocabulary 151937 that is 152064."""
    query, kv = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim
    attention = m.hidden_size * (query + 2 * kv) + query * m.seq_length / 2 * 2 \
        + query * m.hidden_size
    expert_ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size
    shared_ffn = moe.moe_shared_expert_intermediate_size or 0
    mlp = sum(3 * (moe.moe_router_topk * expert_ffn + shared_ffn) if is_moe
              else 3 * m.ffn_hidden_size for is_moe in moe_layer_pattern(m.num_layers, moe))
    return 3 * 2 * (m.hidden_size * mlp + m.num_layers * attention
                    + m.hidden_size * m.padded_vocab_size)
