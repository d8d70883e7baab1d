"""Named model and run sizes (`--preset NAME`): each sets config fields by name; flags given
explicitly win. `tiny` is the main job's model on CPUs."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # The main job's model on CPUs: a small byte-level MoE LM that trains in seconds on 2 ranks.
    # Init std 0.1 (about 1 / sqrt(hidden)) and aux loss 0.1: at std 0.02 and aux 0.01 the
    # first steps at lr 3e-3 made every token's router input nearly the same (their mean 0.95
    # of a token's norm by step 4) and the router sent all tokens to 2 experts (imbalance
    # 3.96-4.00, the most top-2 of 8 can reach) in steps 3-11; now 2.5-3.9 there, ~1.4 at the
    # end, and a lower final loss.
    "tiny": dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                 num_query_groups=2, seq_length=128, num_experts=8, moe_router_topk=2,
                 moe_ffn_hidden_size=128, moe_aux_loss_coeff=0.1, init_method_std=0.1,
                 micro_batch_size=4, num_microbatches=4, train_iters=30, lr=3e-3, min_lr=3e-4,
                 lr_warmup_iters=3),
    # A GPU-sized small model. Byte-level text collapses the router at init; an aux-loss
    # coefficient of 5e-2 keeps the experts' load near balanced.
    "small": dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
                  num_query_groups=4, seq_length=1024, num_experts=16, moe_router_topk=2,
                  moe_ffn_hidden_size=1024, moe_shared_expert_intermediate_size=1024,
                  moe_aux_loss_coeff=5e-2, micro_batch_size=4, num_microbatches=4,
                  train_iters=50, lr=1e-3, min_lr=1e-4, lr_warmup_iters=5),
    # The shape epoverlap is compared with Megatron-core at (e32 top-4, balanced routing).
    "megatron-cmp": dict(num_layers=4, hidden_size=2048, ffn_hidden_size=8192,
                         num_attention_heads=16, seq_length=2048, num_experts=32,
                         moe_router_topk=4, moe_ffn_hidden_size=1024, micro_batch_size=2,
                         num_microbatches=8, moe_router_force_load_balancing=True),
    # Mixtral-8x7B's layer (hidden 4096, 32 heads / 8 KV heads, expert FFN 14336, 8 experts
    # top-2, all layers MoE) at 4 layers; its rotary base 1e6, vocabulary 32000 and 32k context
    # are not set (rotary base 1e4, the data's vocabulary, seq 2048).
    "mixtral-proxy": dict(num_layers=4, hidden_size=4096, ffn_hidden_size=14336,
                          num_attention_heads=32, num_query_groups=8, seq_length=2048,
                          num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336,
                          micro_batch_size=1, num_microbatches=4),
    # DeepSeek-V3's MoE layer (hidden 7168, 256 routed experts top-8 of expert FFN 2048, one
    # shared expert of 2048, 8 groups top-4, sigmoid with expert bias, scaling 2.5; dense FFN
    # 18432) at 2 layers, all MoE (V3's first 3 layers are dense). Its attention is MLA with 128
    # heads, which epoverlap does not have: GQA 56 heads x head dim 128 / 8 KV heads instead
    # (the head dim is hidden / heads here, and 128 heads would make it 56).
    "dsv3-proxy": dict(num_layers=2, hidden_size=7168, ffn_hidden_size=18432,
                       num_attention_heads=56, num_query_groups=8, seq_length=4096,
                       num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                       moe_shared_expert_intermediate_size=2048, moe_router_num_groups=8,
                       moe_router_group_topk=4, moe_router_score_function="sigmoid",
                       moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                       moe_first_k_dense_replace=0, micro_batch_size=1, num_microbatches=4),
    # Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts top-8 of expert FFN 768, softmax,
    # no shared expert, every layer MoE) at 6 of its 48 layers, seq 4096, on mock data at its
    # vocabulary (NullTokenizer 151936: the model's is 151937, its embedding and output layer
    # 152064 rows by --make-vocab-size-divisible-by 128). Qwen3 has 32 query heads / 4 KV
    # heads of head dim 128 (query width 4096 != hidden 2048); epoverlap's head dim is hidden /
    # heads, so this keeps head dim 128 and the 4 KV heads (KV width 512, as Qwen3's) with 16
    # query heads (query width 2048: half Qwen3's attention projections and core attention).
    # Its router's aux loss (1e-3) is Qwen3's, and its learning rate one of Qwen3's size: the
    # default 3e-3 collapses this router on mock data.
    # Estimated (training/setup/memory.py, EP = GPUs) 64 GiB per GPU at 2 GPUs, 51 at 4 (66 and 53
    # with --overlap-moe-expert-parallel-comm); 8 layers would be 78 GiB at 2.
    "qwen3-30b-a3b-proxy": dict(num_layers=6, hidden_size=2048, ffn_hidden_size=6144,
                                num_attention_heads=16, num_query_groups=4, seq_length=4096,
                                num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                                moe_router_score_function="softmax", moe_aux_loss_coeff=1e-3,
                                lr=3e-4, min_lr=3e-5, mock_data=True,
                                tokenizer_type="NullTokenizer", vocab_size=151936,
                                micro_batch_size=1, num_microbatches=4),
    # The one-GPU peer benchmark's two other shapes (benchmarks/peer.md: torchtitan beside
    # epoverlap on one H200, 8192 tokens a step: micro-batch 1 x 2 of seq 4096), on mock data.
    # Few large experts: Mixtral-8x7B's layer (hidden 4096, 32 / 8 heads of 128, 8 experts
    # top-2 of FFN 14336, softmax, aux loss 0.02, every layer MoE) at 3 layers, its vocabulary
    # 32000; its rotary base 1e6 is not set. About 6 GiB of bf16 weights a layer: the AdamW
    # states of 4.6B parameters (about 85 GiB estimated with activations) fit one H200, where
    # 4 layers (about 112) would leave little room for the peer's own.
    "mixtral-1gpu-proxy": dict(num_layers=3, hidden_size=4096, ffn_hidden_size=14336,
                               num_attention_heads=32, num_query_groups=8, seq_length=4096,
                               num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336,
                               moe_aux_loss_coeff=2e-2, lr=3e-4, min_lr=3e-5, mock_data=True,
                               tokenizer_type="NullTokenizer", vocab_size=32000,
                               micro_batch_size=1, num_microbatches=2),
    # Shared experts: DeepSeek's fine-grained MoE layer as torchtitan ships it at 16B (hidden
    # 2048, 64 routed experts top-6 of FFN 1408, 2 shared experts as one FFN of 2816, softmax
    # over all experts before the top-k with no renormalization, the first layer dense with FFN
    # 10944) at 6 layers, DeepSeek-V3's vocabulary 129280, GQA 16 / 4 heads of 128 in place of
    # MLA (epoverlap has no MLA). About 74 GiB estimated on one GPU.
    "dsv3-1gpu-proxy": dict(num_layers=6, hidden_size=2048, ffn_hidden_size=10944,
                            num_attention_heads=16, num_query_groups=4, seq_length=4096,
                            num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408,
                            moe_shared_expert_intermediate_size=2816,
                            moe_router_pre_softmax=True, moe_first_k_dense_replace=1,
                            moe_aux_loss_coeff=1e-3, lr=3e-4, min_lr=3e-5, mock_data=True,
                            tokenizer_type="NullTokenizer", vocab_size=129280,
                            micro_batch_size=1, num_microbatches=2),
}
