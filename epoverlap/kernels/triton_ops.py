"""Triton implementations of the routing ops under Megatron-core's names (the "triton" backend).

The signatures below are the implementations' own; the `MoEOps` table (`make_moe_ops`) serves
permute, unpermute, sort_chunks_by_idxs and topk_routing_with_score_function with
Megatron-core's exact signatures and keyword names over them (`megatron_api`).

router_topk(logits, topk, *, score_function, use_pre_softmax, num_groups, group_topk,
            scaling_factor, expert_bias) -> (probs [T, E], routing_map [T, E] bool)
router_topk_with_counts(logits, topk, **same) -> (probs, routing_map, tokens_per_expert [E] int64)
permute(tokens, routing_map, probs=None, num_out_tokens=None)
    -> (permuted_tokens [N, H], permuted_probs [N] | None, row_id_map [T, E] int32)
unpermute(permuted_tokens, row_id_map, restore_shape=None, probs=None, routing_map=None) -> [T, H]
sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None) -> (output, probs | None)
rms_norm(x [..., H], weight [H], eps, main_grad=None) -> [..., H]
embedding(tokens [T] int, weight [V, H], main_grad=None) -> [T, H] (weight[tokens])
    (main_grad fp32 of the weight's shape: the weight's grad is added there, none returned)
rotary(x [B, N, S, D], cos [S, D/2], sin [S, D/2]) -> [B, N, S, D]
swiglu(h [M, 2F], probs [M] | None = None) -> [M, F]
cross_entropy(logits [T, N], labels [T] int64, vocab=None) -> fp32 scalar (mean over labels
    != -100; softmax over the first vocab columns, all with None)
grouped_weight_grad(main_grad [E, I, O] fp32, x [N, I], grad [N, O], offsets [E] int32,
                    counts=None, sm_carveout=None) -> None (main_grad[e] += x_e^T @ grad_e)
gather_rows(src [X, ...], index [Y] int) -> [Y, ...] (src[index], a zero row where index < 0;
    a plain copy, not differentiable: `model.dispatch.rows.move_rows` is its autograd form)
zero_rows_from(x [M, ...], end [1] int) -> x with rows >= end zeroed, written into x when
    contiguous (differentiable)

Same signatures, outputs and row-id map format as `reference` (the torch backend), so a model
switches backends by config alone (`make_moe_ops`). Every op is differentiable like its
reference, deterministic, and syncs no host when `num_out_tokens` is given. Needs CUDA or
TRITON_INTERPRET=1 (see `epoverlap.kernels.triton_unavailable_reason`).
"""

from .cross_entropy_triton import cross_entropy_triton as cross_entropy
from .embedding_triton import embedding_triton as embedding
from .grouped_wgrad_triton import grouped_weight_grad_triton as grouped_weight_grad
from .permutation_triton import permute_triton as permute
from .permutation_triton import unpermute_triton as unpermute
from .rmsnorm_triton import rms_norm_triton as rms_norm
from .rows_triton import gather_rows_triton as gather_rows
from .rows_triton import zero_rows_from_triton as zero_rows_from
from .rotary_triton import rotary_triton as rotary
from .router_topk_triton import router_topk_triton as router_topk
from .router_topk_triton import router_topk_with_counts_triton as router_topk_with_counts
from .sort_chunks_triton import sort_chunks_by_idxs_triton as sort_chunks_by_idxs
from .swiglu_triton import swiglu_triton as swiglu

__all__ = ["router_topk", "router_topk_with_counts", "permute", "unpermute", "sort_chunks_by_idxs",
           "rms_norm", "embedding", "rotary", "swiglu", "cross_entropy", "grouped_weight_grad",
           "gather_rows", "zero_rows_from"]
