"""Named model and run sizes (`--preset NAME`): each sets config fields by name; flags given
explicitly win. `tiny` is the main job's model on CPUs."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # The main job's model on CPUs: a small byte-level MoE LM that trains in seconds on 2 ranks.
    "tiny": dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                 num_query_groups=2, seq_length=128, num_experts=8, moe_router_topk=2,
                 moe_ffn_hidden_size=128, moe_aux_loss_coeff=1e-2, micro_batch_size=4,
                 num_microbatches=4, train_iters=30, lr=3e-3, min_lr=3e-4, lr_warmup_iters=3),
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
    "mixtral-proxy": dict(num_layers=4, hidden_size=4096, ffn_hidden_size=14336,
                          num_attention_heads=32, num_query_groups=8, seq_length=2048,
                          num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336,
                          micro_batch_size=1, num_microbatches=4),
    "dsv3-proxy": dict(num_layers=2, hidden_size=7168, ffn_hidden_size=18432,
                       num_attention_heads=56, num_query_groups=8, seq_length=4096,
                       num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                       moe_shared_expert_intermediate_size=2048, moe_router_num_groups=8,
                       moe_router_group_topk=4, moe_router_score_function="sigmoid",
                       moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                       moe_first_k_dense_replace=0, micro_batch_size=1, num_microbatches=4),
}
