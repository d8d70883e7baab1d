"""Torch reference ops under Megatron-core's names, so its users can swap ours in.

permute, unpermute, sort_chunks_by_idxs and topk_routing_with_score_function take
Megatron-core's signatures and keyword names (`megatron_api`); the rest:

router_topk(logits, topk, *, score_function, use_pre_softmax, num_groups, group_topk,
            scaling_factor, expert_bias) -> (probs [T, E], routing_map [T, E] bool)
router_topk_with_counts(logits, topk, **same) -> (probs, routing_map, tokens_per_expert [E] int64)
rms_norm(x [..., H], weight [H], eps) -> [..., H]
rotary(x [B, N, S, D], cos [S, D/2], sin [S, D/2]) -> [B, N, S, D]
swiglu(h [M, 2F], probs [M] | None = None) -> [M, F]

Output order is expert-major, ascending source token within an expert.
"""

from . import megatron_api
from .permutation import permute_torch, unpermute_torch
from .rmsnorm import rms_norm_torch as rms_norm
from .rotary import rotary_torch as rotary
from .router_topk import router_topk_torch as router_topk
from .router_topk import router_topk_with_counts_torch as router_topk_with_counts
from .sort_chunks import sort_chunks_by_idxs_torch
from .swiglu import swiglu_torch as swiglu

permute = megatron_api.permute_entry(permute_torch)
unpermute = megatron_api.unpermute_entry(unpermute_torch)
sort_chunks_by_idxs = megatron_api.sort_chunks_entry(sort_chunks_by_idxs_torch)
topk_routing_with_score_function = megatron_api.topk_routing_entry(router_topk)

__all__ = ["router_topk", "router_topk_with_counts", "topk_routing_with_score_function",
           "permute", "unpermute", "sort_chunks_by_idxs", "rms_norm", "rotary", "swiglu"]
