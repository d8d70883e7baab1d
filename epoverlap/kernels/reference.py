"""Torch reference ops under Megatron-core's names, so its users can swap ours in.

The signatures below are the implementations' own; the `MoEOps` table (`make_moe_ops`) serves
permute, unpermute, sort_chunks_by_idxs and topk_routing_with_score_function with
Megatron-core's exact signatures and keyword names over them (`megatron_api`).

router_topk(logits, topk, *, score_function, use_pre_softmax, num_groups, group_topk,
            scaling_factor, expert_bias) -> (probs [T, E], routing_map [T, E] bool)
permute(tokens, routing_map, probs=None, num_out_tokens=None)
    -> (permuted_tokens [N, H], permuted_probs [N] | None, row_id_map [T, E] int32)
unpermute(permuted_tokens, row_id_map, restore_shape, probs=None, routing_map=None) -> [T, H]
sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None) -> (output, probs | None)
router_topk_with_counts(logits, topk, **same) -> (probs, routing_map, tokens_per_expert [E] int64)
rms_norm(x [..., H], weight [H], eps, main_grad=None) -> [..., H]
embedding(tokens [T] int, weight [V, H], main_grad=None) -> [T, H] (weight[tokens])
    (main_grad fp32 of the weight's shape: the weight's grad is added there, none returned)
rotary(x [B, N, S, D], cos [S, D/2], sin [S, D/2]) -> [B, N, S, D]
swiglu(h [M, 2F], probs [M] | None = None) -> [M, F]
cross_entropy(logits [T, N], labels [T] int64, vocab=None) -> fp32 scalar (mean over labels
    != -100; softmax over the first vocab columns, all with None)
grouped_weight_grad(main_grad [E, I, O] fp32, x [N, I], grad [N, O], offsets [E] int32,
                    counts=None, sm_carveout=None) -> None (main_grad[e] += x_e^T @ grad_e)
gather_rows(src [X, ...], index [Y] int) -> [Y, ...] (src[index], a zero row where index < 0)
zero_rows_from(x [M, ...], end [1] int) -> x with rows >= end zeroed (differentiable)

Output order is expert-major, ascending source token within an expert.
"""

from .cross_entropy import cross_entropy_torch as cross_entropy
from .embedding import embedding_torch as embedding
from .grouped_wgrad import grouped_weight_grad_torch as grouped_weight_grad
from .permutation import permute_torch as permute
from .permutation import unpermute_torch as unpermute
from .rmsnorm import rms_norm_torch as rms_norm
from .rows import gather_rows_torch as gather_rows
from .rows import zero_rows_from_torch as zero_rows_from
from .rotary import rotary_torch as rotary
from .router_topk import router_topk_torch as router_topk
from .router_topk import router_topk_with_counts_torch as router_topk_with_counts
from .sort_chunks import sort_chunks_by_idxs_torch as sort_chunks_by_idxs
from .swiglu import swiglu_torch as swiglu

__all__ = ["router_topk", "router_topk_with_counts", "permute", "unpermute", "sort_chunks_by_idxs",
           "rms_norm", "embedding", "rotary", "swiglu", "cross_entropy", "grouped_weight_grad",
           "gather_rows", "zero_rows_from"]
