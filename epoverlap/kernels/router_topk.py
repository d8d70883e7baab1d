"""Router top-k: score function + (group-limited) top-k selection, Megatron-core semantics.

Owns the torch reference `router_topk_torch`, which returns the same outputs as
Megatron-core's `topk_routing_with_score_function` (dense probs and a bool routing map), and
`expert_token_counts`, the per-expert routed-token counts used by the aux loss and the
aux-loss-free expert-bias update, and the Switch aux loss (`SwitchAuxLoss`, `switch_aux_loss`,
`attach_aux_loss`: the reference of what the Triton router fuses into its own launches).

Shape legend: T tokens, E experts, K top-k, G expert groups.

Precision: logits are converted to fp32 for the score function, every intermediate is fp32,
the returned probs are cast back to the logits' dtype (as Megatron-core does).
Ties: the lower expert index wins (a stable sort; torch.topk's tie order is unspecified).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def check_router_args(num_experts: int, topk: int, score_function: str,
                      num_groups: Optional[int], group_topk: Optional[int]) -> None:
    """Raise ValueError naming the argument when the routing settings are inconsistent."""
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function={score_function!r}: allowed {SCORE_FUNCTIONS}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk}: must be in [1, num_experts={num_experts}]")
    if group_topk:
        if not num_groups or num_experts % num_groups:
            raise ValueError(f"num_groups={num_groups}: must divide num_experts={num_experts}")
        if not 1 <= group_topk <= num_groups:
            raise ValueError(f"group_topk={group_topk}: must be in [1, num_groups={num_groups}]")
        if topk % group_topk:
            raise ValueError(f"topk={topk}: must be divisible by group_topk={group_topk}")
        if topk // group_topk > num_experts // num_groups:
            raise ValueError(f"topk/group_topk={topk // group_topk}: exceeds experts per group "
                             f"{num_experts // num_groups}")
        if topk > group_topk * (num_experts // num_groups):
            raise ValueError(f"topk={topk}: more than the experts of the {group_topk} kept groups")


def _topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the last dim, largest first; ties: the lower index wins.

    torch.topk leaves tie order unspecified (on CPU it does not prefer the lower index), so a
    stable descending sort is used: the tie rule is then the same on every device and backend,
    which matters for bf16 logits, where ties are common.
    """
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _group_limited_topk(scores_TE: torch.Tensor, topk: int, num_groups: int,
                        group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek group-limited top-k: keep the `group_topk` best groups, then top-k among them.

    A group's score is the sum of its best (topk // group_topk) expert scores.
    """
    num_tokens, num_experts = scores_TE.shape
    per_group = num_experts // num_groups
    group_scores_TG = (scores_TE.view(num_tokens, num_groups, per_group)
                       .topk(topk // group_topk, dim=-1)[0].sum(dim=-1))
    group_idx = _topk(group_scores_TG, group_topk)[1]
    group_mask_TG = torch.zeros_like(group_scores_TG).scatter_(1, group_idx, 1)
    score_mask_TE = (group_mask_TG.unsqueeze(-1).expand(num_tokens, num_groups, per_group)
                     .reshape(num_tokens, num_experts))
    masked_TE = scores_TE.masked_fill(~score_mask_TE.bool(), float("-inf"))
    return _topk(masked_TE, topk)


def _select_topk(scores_TE, topk, num_groups, group_topk):
    if group_topk:
        return _group_limited_topk(scores_TE, topk, num_groups, group_topk)
    return _topk(scores_TE, topk)


def router_topk_torch(
    logits_TE: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens: logits [T, E] -> (probs [T, E] zeros where not routed, routing_map [T, E] bool).

    softmax, pre: softmax over E in fp32, then top-k of the scores.
    softmax, post: top-k of the logits, then softmax over the k chosen.
    sigmoid: sigmoid scores in fp32; with `expert_bias` [E] the top-k is chosen on
    scores + bias but the unbiased scores are returned; for k > 1 the chosen scores are
    normalized by their sum (+1e-20).
    `scaling_factor` multiplies the final probs. Differentiable w.r.t. logits. Syncs no host.
    """
    num_tokens, num_experts = logits_TE.shape
    check_router_args(num_experts, topk, score_function, num_groups, group_topk)
    if score_function == "softmax":
        if use_pre_softmax:
            scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
            probs_TK, top_idx_TK = _select_topk(scores_TE, topk, num_groups, group_topk)
        else:
            top_logits_TK, top_idx_TK = _select_topk(logits_TE.float(), topk, num_groups,
                                                      group_topk)
            probs_TK = torch.softmax(top_logits_TK, dim=-1, dtype=torch.float32)
    else:
        scores_TE = torch.sigmoid(logits_TE.float())
        if expert_bias is not None:
            _, top_idx_TK = _select_topk(scores_TE + expert_bias.float(), topk, num_groups,
                                         group_topk)
            probs_TK = torch.gather(scores_TE, 1, top_idx_TK)
        else:
            probs_TK, top_idx_TK = _select_topk(scores_TE, topk, num_groups, group_topk)
        if topk > 1:
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs_TK = probs_TK * scaling_factor
    probs_TK = probs_TK.to(logits_TE.dtype)
    probs_TE = torch.zeros_like(logits_TE).scatter(1, top_idx_TK, probs_TK)
    routing_map_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, top_idx_TK, True)
    return probs_TE, routing_map_TE


def router_topk_with_counts_torch(logits_TE: torch.Tensor, topk: int, *,
                                  aux_loss: Optional["SwitchAuxLoss"] = None, **routing_kwargs):
    """`router_topk_torch` plus the per-expert routed-token counts [E] int64 (aux loss, bias).
    With `aux_loss`, also the Switch load-balancing loss of this routing (`SwitchAuxLoss`)."""
    probs_TE, routing_map_TE = router_topk_torch(logits_TE, topk, **routing_kwargs)
    counts_E = expert_token_counts(routing_map_TE)
    if aux_loss is not None:
        check_aux_loss_routing(routing_kwargs)
        scores_TE = aux_loss_scores(logits_TE, routing_kwargs.get("score_function", "softmax"))
        value = switch_aux_loss(scores_TE, counts_E, topk, aux_loss.coeff)
        probs_TE = attach_aux_loss(probs_TE, value, aux_loss.grad_scale)
        aux_loss.loss_sum.add_(value.detach())
    return probs_TE, routing_map_TE, counts_E


@dataclass(frozen=True)
class SwitchAuxLoss:
    """The Switch load-balancing loss, computed inside `router_topk_with_counts`:
    E * coeff / (topk * T^2) * sum_e (sum_t score_te) * count_e (Megatron-core's formula; the
    scores are `aux_loss_scores`, the counts the routing's own). It never joins the returned
    values: its value is added to `loss_sum` (fp32, 0-dim, on the logits' device; the caller's
    running sum for logging), and the probs' backward adds `grad_scale` x its grad to the
    logits' grad, as if `grad_scale` x the loss had been added to the training loss. Only
    without group-limited routing and expert bias: Megatron-core counts the aux loss's tokens
    with a plain top-k there (`plain_topk_counts`), not with the routing's counts."""

    coeff: float
    grad_scale: float
    loss_sum: torch.Tensor


def check_aux_loss_routing(routing_kwargs: dict) -> None:
    if routing_kwargs.get("group_topk") or routing_kwargs.get("expert_bias") is not None:
        raise ValueError("aux_loss: only without group_topk and expert_bias (the aux loss then "
                         "counts tokens by a plain top-k: compute it apart, switch_aux_loss)")


def switch_aux_loss(scores_TE: torch.Tensor, counts_E: torch.Tensor, topk: int,
                    coeff: float, counted_tokens: Optional[int] = None) -> torch.Tensor:
    """Switch load-balancing loss: E * sum_e f_e * P_e * coeff (Megatron-core's formula); f_e
    from `counts_E` over `counted_tokens` (default: the T tokens of `scores_TE`; under context
    parallelism the whole sequence's counts, over its tokens), P_e over the T tokens."""
    num_tokens, num_experts = scores_TE.shape
    counted = counted_tokens or num_tokens
    scale = num_experts * coeff / (topk * num_tokens * counted)
    return torch.sum(scores_TE.sum(dim=0) * counts_E.to(scores_TE.dtype)) * scale


def seq_aux_loss(scores_TE: torch.Tensor, topk: int, coeff: float,
                 seq_length: int) -> torch.Tensor:
    """The per-sequence Switch loss (Megatron-core's seq_aux_loss, DeepSeek-V3's): the Switch
    loss of each sequence's tokens alone, with their own plain top-k counts, averaged over the
    sequences. `scores_TE`: `aux_loss_scores`, tokens sequence by sequence ([B x S, E])."""
    num_experts = scores_TE.shape[1]
    scores_BSE = scores_TE.view(-1, seq_length, num_experts)
    top_BSK = torch.topk(scores_BSE, k=topk, dim=2).indices
    counts_BE = torch.zeros_like(scores_BSE, dtype=torch.bool).scatter(2, top_BSK, True).sum(
        dim=1, dtype=torch.int64)
    scale = num_experts * coeff / (topk * seq_length * seq_length * scores_BSE.shape[0])
    return torch.sum(scores_BSE.sum(dim=1) * counts_BE.to(scores_TE.dtype)) * scale


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `x`; its backward also starts the aux loss's backward with grad `scale`."""

    @staticmethod
    def forward(ctx, x, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad_x):
        (aux_loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(aux_loss, ctx.scale), None


def attach_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """x, whose backward also backpropagates `aux_loss` with grad `grad_scale`."""
    return _AttachAuxLoss.apply(x, aux_loss, grad_scale)


def expert_token_counts(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """Tokens routed to each expert: [T, E] bool -> [E] int64 (on the map's device, no sync)."""
    return routing_map_TE.sum(dim=0, dtype=torch.int64)


def plain_topk_counts(scores_TE: torch.Tensor, topk: int) -> torch.Tensor:
    """Tokens per expert of a plain top-k of `scores_TE` (no groups, no bias): the counts
    Megatron-core's Switch aux loss uses (`compute_routing_scores_for_aux_loss`)."""
    top_indices_TK = torch.topk(scores_TE, k=topk, dim=1).indices
    map_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter(1, top_indices_TK, True)
    return expert_token_counts(map_TE)


def aux_loss_scores(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """Scores the Switch aux loss uses: softmax over E, or sum-normalized sigmoid (fp32)."""
    if score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    scores_TE = torch.sigmoid(logits_TE.float())
    return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
