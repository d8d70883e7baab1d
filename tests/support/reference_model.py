"""An independently written float64 forward/backward of epoverlap's MoE language model.

Owns `ReferenceHyper` (the hyperparameters the math needs, read off a RunConfig) and
`reference_loss_and_grads`, the reference that the executor tests compare against. It is
written from the math (textbook / Megatron-core semantics), in plain torch, and reads only the
model's PARAMETERS (and the router's `expert_bias` buffer) by name: nothing of epoverlap's
model, kernels, nodes, linear or dispatcher code is imported or called, there is no permute /
unpermute (every expert sees its tokens through an index mask, in a loop), top-k is a rank
count rather than a sort, and so on. A mutation of epoverlap's model math therefore shows up
as a mismatch here (the bitwise executor tests compare node callables with themselves).

Facts taken from epoverlap's code (names, layouts, choices a reader could not guess):
  * Parameter names and layouts (`MoEModel.named_parameters()`):
    embedding [P, H]; head [P, H] (untied; P >= V the vocabulary padded, rows from V on out of
    the softmax); layers.i.input_norm.weight, .pre_mlp_norm.weight,
    final_norm.weight [H]; layers.i.attention.qkv [(Q + 2G) * D, H] with rows
    [all Q query heads | G key heads | G value heads], each head D contiguous rows (Megatron
    interleaves q/k/v per query group instead: a checkpoint converter must reorder, the math is
    the same); attention.proj [H, Q * D]; with --qk-layernorm attention.q_norm.weight and
    .k_norm.weight [D], an RMSNorm over each query / key head before rotary. Dense /
    shared-expert SwiGLU: fc1 [2F, H] applied as x @ fc1.T, its rows [gate | up]; fc2 [H, F].
    Routed experts: experts.fc1 [E, H, 2F] applied
    as x @ fc1[e], columns [gate | up]; experts.fc2 [E, F, H]. router.weight [E, H].
    A layer is MoE iff it has `router.weight`; it has a shared expert iff `shared_expert.fc1`.
  * With expert parallelism, EP rank r holds global experts r*L .. r*L + L - 1 (L = E / EP):
    the global expert tensors are the ranks' shards concatenated along dim 0.
  * Token order: a microbatch [B, S] is flattened row-major (token t = b * S + s), so the
    rotary position of token t is t mod S; attention never crosses sequences.
  * Rotary: GPT-NeoX half rotation (not interleaved pairs), angle(s, i) = s * base^(-2i/D),
    y = [x1 cos - x2 sin, x2 cos + x1 sin]; applied to q and k of every head.
  * GQA: query head h reads key/value head h // (Q / G).
  * The routing prob is applied inside the expert activation: act = silu(gate) * up * prob,
    then fc2 (equal in exact arithmetic to scaling the expert output, since fc2 has no bias;
    NOT equal to scaling the expert input, Megatron's moe_apply_probs_on_input).
  * The aux-loss token counts are, as in Megatron-core since 0.13 (MR !3279 "Fix MoE Aux
    loss", 2025-06; 0.16.1 too), those of a plain top-k of the aux scores, ignoring groups and
    bias: `aux_counts="megatron"`. `aux_counts="routed"` counts the actual routing (after
    group limiting and expert bias) instead; they differ only with groups or an expert bias
    (test_reference_model.py::test_aux_loss_counts_follow_megatron_not_the_routed_experts).
  * Loss scaling: the executor scales each microbatch's cross-entropy by 1/M (M microbatches
    per rank) and the aux / z losses' grads by the same 1/M (Router.aux_loss_scale, as Megatron's
    MoEAuxLossAutoScaler.set_loss_scale(1 / num_microbatches)); grads are then averaged over the W
    data-parallel ranks (training/optimizer/grads.py: dense all-reduce / W, expert sum over
    expert-data-parallel / W). So the objective is
        J = 1/(W M) * sum over ranks r, microbatches m of [CE(r, m) + sum_layers (aux + z)(r, m)],
    each aux / z loss computed over the T tokens of its own microbatch.
Everything else is the plain math: pre-norm residual blocks, RMSNorm with eps inside the root,
causal softmax attention scaled by 1/sqrt(D), softmax / sigmoid routing scores, DeepSeek group-
limited top-k (a group's score is the sum of its best k / group_topk expert scores), sigmoid
probs renormalized over the chosen k (k > 1) plus 1e-20, the Switch aux loss
E * coeff * sum_e f_e P_e (f_e = tokens routed to e / (k T), P_e = mean score of e), the z-loss
coeff * mean_t logsumexp_t^2, token-mean cross-entropy.
Not modelled: --moe-router-force-load-balancing (a benchmark mode: random logits), the
per-step expert-bias update (it happens after the grads; the reference reads the bias buffer).

Shape legend: B sequences, S sequence length, T = B * S tokens, H hidden, V vocab, Q query
heads, G key/value heads, D head dim, E experts, K top-k, N groups, F ffn width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

DTYPE = torch.float64


@dataclass(frozen=True)
class ReferenceHyper:
    heads: int
    kv_heads: int
    topk: int
    score_function: str
    pre_softmax: bool
    num_groups: Optional[int]
    group_topk: Optional[int]
    scaling_factor: Optional[float]
    aux_loss_coeff: float
    z_loss_coeff: float
    norm_eps: float
    rotary_base: float
    aux_counts: str = "megatron"  # or "routed": see the module docstring
    vocab: Optional[int] = None  # the real vocabulary (None: every row of the head)

    @classmethod
    def from_run_config(cls, cfg, aux_counts: str = "megatron") -> "ReferenceHyper":
        """Read the hyperparameters off an epoverlap RunConfig (attributes only)."""
        m, moe = cfg.model, cfg.moe
        return cls(heads=m.num_attention_heads, kv_heads=m.num_query_groups or
                   m.num_attention_heads, topk=moe.moe_router_topk,
                   score_function=moe.moe_router_score_function,
                   pre_softmax=moe.moe_router_pre_softmax, num_groups=moe.moe_router_num_groups,
                   group_topk=moe.moe_router_group_topk,
                   scaling_factor=moe.moe_router_topk_scaling_factor,
                   aux_loss_coeff=moe.moe_aux_loss_coeff, z_loss_coeff=moe.moe_z_loss_coeff or 0.0,
                   norm_eps=m.norm_epsilon, rotary_base=m.rotary_base, aux_counts=aux_counts,
                   vocab=m.vocab_size)


@dataclass
class ReferenceResult:
    ce_losses: list[float]  # cross-entropy of every microbatch, in the order given
    objective: float  # J of the module docstring
    grads: dict[str, torch.Tensor]  # d J / d param, float64, by parameter name
    routing_margin: float  # smallest score gap at any top-k (or group) decision boundary


# ----------------------------------------------------------------------------- layers
def rms_norm(x_TH, weight_H, eps):
    return x_TH / torch.sqrt((x_TH * x_TH).mean(dim=-1, keepdim=True) + eps) * weight_H


def rotary_neox(x_BSXD, base):
    """NeoX rotary on the last dim of x [B, S, heads, D] by position s."""
    seq, dim = x_BSXD.shape[1], x_BSXD.shape[-1]
    half = dim // 2
    freq_I = base ** (-2.0 * torch.arange(half, dtype=DTYPE) / dim)
    angle_SI = torch.arange(seq, dtype=DTYPE)[:, None] * freq_I[None, :]
    cos, sin = angle_SI.cos()[None, :, None, :], angle_SI.sin()[None, :, None, :]
    first, second = x_BSXD[..., :half], x_BSXD[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def causal_gqa_attention(x_TH, qkv_W, proj_W, hyper: ReferenceHyper, batch: int, seq: int,
                         qk_norms=None):
    """`qk_norms`: (query weight [D], key weight [D]) of an RMSNorm over each head's query and
    key before rotary (--qk-layernorm), or None."""
    q_heads, kv_heads = hyper.heads, hyper.kv_heads
    dim = qkv_W.shape[0] // (q_heads + 2 * kv_heads)
    proj_TX = x_TH @ qkv_W.T
    q_BSQD = proj_TX[:, :q_heads * dim].reshape(batch, seq, q_heads, dim)
    k_BSGD = proj_TX[:, q_heads * dim:(q_heads + kv_heads) * dim].reshape(batch, seq, kv_heads,
                                                                           dim)
    v_BSGD = proj_TX[:, (q_heads + kv_heads) * dim:].reshape(batch, seq, kv_heads, dim)
    if qk_norms is not None:
        q_BSQD = rms_norm(q_BSQD, qk_norms[0], hyper.norm_eps)
        k_BSGD = rms_norm(k_BSGD, qk_norms[1], hyper.norm_eps)
    q_BSQD = rotary_neox(q_BSQD, hyper.rotary_base)
    k_BSGD = rotary_neox(k_BSGD, hyper.rotary_base)
    kv_of_head = torch.arange(q_heads) // (q_heads // kv_heads)
    k_BSQD, v_BSQD = k_BSGD[:, :, kv_of_head], v_BSGD[:, :, kv_of_head]
    scores_BQSS = torch.einsum("bihd,bjhd->bhij", q_BSQD, k_BSQD) / math.sqrt(dim)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)
    weights_BQSS = scores_BQSS.masked_fill(future, float("-inf")).softmax(dim=-1)
    out_BSQD = torch.einsum("bhij,bjhd->bihd", weights_BQSS, v_BSQD)
    return out_BSQD.reshape(batch * seq, q_heads * dim) @ proj_W.T


def swiglu_mlp(x_TH, fc1_W, fc2_W):
    """Dense layout: fc1 [2F, H] rows [gate | up], fc2 [H, F]."""
    width = fc2_W.shape[1]
    h_T2F = x_TH @ fc1_W.T
    return (F.silu(h_T2F[:, :width]) * h_T2F[:, width:]) @ fc2_W.T


# ----------------------------------------------------------------------------- routing
def top_k_mask(scores_TE, k):
    """Chosen [T, E] bool: e is chosen iff fewer than k experts beat it (higher score, or equal
    score and lower index). Also the per-token gap between the worst chosen and the best
    unchosen score (inf when nothing is left out)."""
    experts = scores_TE.shape[-1]
    mine_TE1, other_T1E = scores_TE[:, :, None], scores_TE[:, None, :]
    lower_index_EE = torch.arange(experts)[None, :] < torch.arange(experts)[:, None]
    beaten_TEE = (other_T1E > mine_TE1) | ((other_T1E == mine_TE1) & lower_index_EE)
    chosen_TE = beaten_TEE.sum(dim=-1) < k
    worst_in = scores_TE.masked_fill(~chosen_TE, float("inf")).amin(dim=-1)
    best_out = scores_TE.masked_fill(chosen_TE, float("-inf")).amax(dim=-1)
    return chosen_TE, worst_in - best_out


def choose_experts(selection_TE, hyper: ReferenceHyper):
    """Top-k of selection scores, group-limited when group_topk is set. -> (chosen, margin)."""
    k = hyper.topk
    if not hyper.group_topk:
        chosen_TE, gap_T = top_k_mask(selection_TE, k)
        return chosen_TE, float(gap_T.detach().min())
    tokens, experts = selection_TE.shape
    groups = hyper.num_groups
    per_group = experts // groups
    grouped_TNP = selection_TE.detach().reshape(tokens * groups, per_group)
    best_in_group, _ = top_k_mask(grouped_TNP, k // hyper.group_topk)
    group_score_TN = (grouped_TNP * best_in_group).sum(dim=-1).reshape(tokens, groups)
    kept_TN, group_gap_T = top_k_mask(group_score_TN, hyper.group_topk)
    kept_TE = kept_TN.repeat_interleave(per_group, dim=1)
    chosen_TE, gap_T = top_k_mask(selection_TE.masked_fill(~kept_TE, float("-inf")), k)
    return chosen_TE, float(torch.minimum(gap_T, group_gap_T).detach().min())


def route(logits_TE, hyper: ReferenceHyper, expert_bias_E):
    """-> (chosen [T, E] bool, gate [T, E] routing probs, zero off the chosen, margin)."""
    if hyper.score_function == "softmax":
        if hyper.pre_softmax:
            scores_TE = logits_TE.softmax(dim=-1)
            chosen_TE, margin = choose_experts(scores_TE, hyper)
            gate_TE = scores_TE * chosen_TE
        else:
            chosen_TE, margin = choose_experts(logits_TE, hyper)
            gate_TE = logits_TE.masked_fill(~chosen_TE, float("-inf")).softmax(dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
        selection = scores_TE if expert_bias_E is None else scores_TE + expert_bias_E
        chosen_TE, margin = choose_experts(selection, hyper)
        gate_TE = scores_TE * chosen_TE
        if hyper.topk > 1:
            gate_TE = gate_TE / (gate_TE.sum(dim=-1, keepdim=True) + 1e-20)
    if hyper.scaling_factor:
        gate_TE = gate_TE * hyper.scaling_factor
    return chosen_TE, gate_TE, margin


def switch_aux_loss(logits_TE, chosen_TE, hyper: ReferenceHyper):
    """E * coeff * sum_e f_e * P_e; f_e = share of the T*k routings that went to e."""
    tokens, experts = logits_TE.shape
    if hyper.score_function == "softmax":
        scores_TE = logits_TE.softmax(dim=-1)
    else:
        sig_TE = torch.sigmoid(logits_TE)
        scores_TE = sig_TE / (sig_TE.sum(dim=-1, keepdim=True) + 1e-20)
    if hyper.aux_counts == "megatron":
        chosen_TE, _ = top_k_mask(scores_TE.detach(), hyper.topk)
    fraction_E = chosen_TE.sum(dim=0).to(DTYPE) / (hyper.topk * tokens)
    mean_score_E = scores_TE.mean(dim=0)
    return experts * hyper.aux_loss_coeff * (fraction_E * mean_score_E).sum()


def z_loss(logits_TE, coeff):
    return coeff * torch.logsumexp(logits_TE, dim=-1).pow(2).mean()


# ----------------------------------------------------------------------------- MoE layer
def moe_mlp(x_TH, params: dict, prefix: str, hyper: ReferenceHyper, expert_bias_E):
    """-> (output [T, H], aux + z loss of this layer, routing margin)."""
    logits_TE = x_TH @ params[prefix + "router.weight"].T
    extra = x_TH.new_zeros(())
    if hyper.z_loss_coeff:
        extra = extra + z_loss(logits_TE, hyper.z_loss_coeff)
    chosen_TE, gate_TE, margin = route(logits_TE, hyper, expert_bias_E)
    if hyper.aux_loss_coeff > 0:
        extra = extra + switch_aux_loss(logits_TE, chosen_TE, hyper)
    fc1_EH2F, fc2_EFH = params[prefix + "experts.fc1"], params[prefix + "experts.fc2"]
    width = fc2_EFH.shape[1]
    out_TH = torch.zeros_like(x_TH)
    for expert in range(fc1_EH2F.shape[0]):
        rows = chosen_TE[:, expert].nonzero().squeeze(1)
        h_R2F = x_TH[rows] @ fc1_EH2F[expert]
        act_RF = F.silu(h_R2F[:, :width]) * h_R2F[:, width:] * gate_TE[rows, expert, None]
        out_TH = out_TH.index_add(0, rows, act_RF @ fc2_EFH[expert])
    if prefix + "shared_expert.fc1" in params:
        out_TH = out_TH + swiglu_mlp(x_TH, params[prefix + "shared_expert.fc1"],
                                     params[prefix + "shared_expert.fc2"])
    return out_TH, extra, margin


# ----------------------------------------------------------------------------- model
def num_layers(params: dict) -> int:
    return 1 + max(int(name.split(".")[1]) for name in params if name.startswith("layers."))


def microbatch_losses(params: dict, biases: dict, tokens_BS, labels_BS, hyper: ReferenceHyper):
    """-> (cross-entropy, sum of the aux and z losses of all MoE layers, routing margin)."""
    batch, seq = tokens_BS.shape
    hidden_TH = params["embedding"][tokens_BS.reshape(-1)]
    extra_total, margin = hidden_TH.new_zeros(()), float("inf")
    for layer in range(num_layers(params)):
        p = f"layers.{layer}."
        normed_TH = rms_norm(hidden_TH, params[p + "input_norm.weight"], hyper.norm_eps)
        qk_norms = ((params[p + "attention.q_norm.weight"], params[p + "attention.k_norm.weight"])
                    if p + "attention.q_norm.weight" in params else None)
        hidden_TH = hidden_TH + causal_gqa_attention(normed_TH, params[p + "attention.qkv"],
                                                     params[p + "attention.proj"], hyper,
                                                     batch, seq, qk_norms)
        normed_TH = rms_norm(hidden_TH, params[p + "pre_mlp_norm.weight"], hyper.norm_eps)
        if p + "router.weight" in params:
            mlp_TH, extra, layer_margin = moe_mlp(normed_TH, params, p, hyper,
                                                  biases.get(p + "router.expert_bias"))
            extra_total, margin = extra_total + extra, min(margin, layer_margin)
        else:
            mlp_TH = swiglu_mlp(normed_TH, params[p + "dense_mlp.fc1"], params[p + "dense_mlp.fc2"])
        hidden_TH = hidden_TH + mlp_TH
    logits_TV = rms_norm(hidden_TH, params["final_norm.weight"], hyper.norm_eps) \
        @ params["head"][:hyper.vocab].T
    log_probs_TV = logits_TV.log_softmax(dim=-1)
    ce = -log_probs_TV.gather(1, labels_BS.reshape(-1, 1)).mean()
    return ce, extra_total, margin


def reference_loss_and_grads(params: dict, microbatches_per_rank: list, hyper: ReferenceHyper,
                             biases: Optional[dict] = None) -> ReferenceResult:
    """Loss and grads of J (module docstring) over W ranks' microbatches, in float64.

    `params`: name -> tensor of the GLOBAL model (expert tensors hold all E experts);
    `microbatches_per_rank`: W lists of M dicts with "tokens" / "labels" [B, S];
    `biases`: name -> router expert-bias buffer (e.g. "layers.1.router.expert_bias").
    """
    leaves = {name: t.detach().to(DTYPE).clone().requires_grad_() for name, t in params.items()}
    bias64 = {name: b.detach().to(DTYPE) for name, b in (biases or {}).items()}
    ranks, per_rank = len(microbatches_per_rank), len(microbatches_per_rank[0])
    objective, ce_losses, margin = torch.zeros((), dtype=DTYPE), [], float("inf")
    for rank_batches in microbatches_per_rank:
        assert len(rank_batches) == per_rank, "every rank runs the same number of microbatches"
        for mb in rank_batches:
            ce, extra, mb_margin = microbatch_losses(leaves, bias64, mb["tokens"], mb["labels"],
                                                     hyper)
            objective = objective + (ce + extra) / (ranks * per_rank)
            ce_losses.append(float(ce.detach()))
            margin = min(margin, mb_margin)
    objective.backward()
    grads = {name: (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
             for name, leaf in leaves.items()}
    return ReferenceResult(ce_losses, float(objective.detach()), grads, margin)
