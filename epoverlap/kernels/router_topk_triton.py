"""Router top-k in Triton: score function + (group-limited) top-k + probs in one launch.

Owns `router_topk_triton` / `router_topk_with_counts_triton`, drop-in replacements of the torch
references in router_topk.py (same arguments, same outputs, same autograd), and their kernels:
  `_router_fwd_kernel`: one program per BLOCK_T tokens holding whole rows of E scores: score
    function in fp32, optional expert bias and group limit, iterative top-k, probs, routing map,
    and (optionally) per-expert token counts by integer atomics (deterministic). Each candidate
    is one int64 sort key (order-preserving image of its fp32 value, then the reversed expert
    index), so one max per chosen expert gives both the best value and the lowest expert holding
    it: ties go to the lower expert, -0.0 ties +0.0 and NaN ranks above +inf, as in the
    reference's stable sort. Group limit: when E is a power of two (no padding: E == BLOCK_E) the
    row is viewed as [G, E / G] and all groups are scored at once; else one masked pass per group.
  `_router_bwd_kernel`: grad of the logits through the chosen probs (softmax pre/post, sigmoid
    with sum normalization, scaling factor), scores recomputed from the logits.
  With a Switch aux loss (`router_topk.SwitchAuxLoss`): the forward also stores each program's
    column sums of the aux scores ([P, E] fp32, no atomics), `_router_aux_loss_kernel` (one
    program) sums them in a fixed order, weights them by the counts and adds the loss to the
    caller's running sum, and the backward adds the loss's grad to the logits' grad in its own
    launch. What the reference does in about ten autograd ops (aux_loss_scores,
    switch_aux_loss, attach_aux_loss) and ten backward nodes is one more launch forward and
    none backward.

Shape legend: T tokens, E experts, G expert groups.

Precision: fp32 inside, probs cast to the logits' dtype (as the reference). The routing map
matches the reference bit for bit whenever the scores have no near-ties; probs and grads agree to
fp32 rounding (different summation order of the softmax denominator and of the sigmoid
normalization, exp implementation). No host sync, static shapes, deterministic.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached
from .triton_reduce import sum_partial_rows
from .router_topk import SwitchAuxLoss, check_aux_loss_routing, check_router_args
from .triton_utils import cdiv, next_pow2, router_tile

SOFTMAX_PRE, SOFTMAX_POST, SIGMOID = 0, 1, 2
KEY_NONE = tl.constexpr(-(2**63))  # sort key of a non-candidate: below every real key


@triton.jit
def _sort_key(x, idx, BLOCK: tl.constexpr):
    """int64 keys ordering fp32 `x` by value, then by lower `idx` (0 <= idx < BLOCK).

    High word: an order-preserving int32 image of x (-0.0 and +0.0 map to the same image, as they
    compare equal; NaNs, all alike, above +inf, as torch's sort puts them); low word:
    BLOCK - 1 - idx. Keys of distinct idx are distinct, and every key (-inf's too) is above
    KEY_NONE, so one `tl.max` finds the best value and the lowest index holding it.
    """
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(x != x, 0x7FFFFFFF, tl.where(b >= 0, b, -(b & 0x7FFFFFFF)))
    return (b.to(tl.int64) << 32) | (BLOCK - 1 - idx)


@triton.jit
def _key_value(key):
    """The fp32 value a `_sort_key` key was made of (-0.0 as +0.0); -inf for KEY_NONE."""
    hi = (key >> 32).to(tl.int32)
    v = tl.where(hi >= 0, hi, -hi).to(tl.float32, bitcast=True)
    return tl.where(key == KEY_NONE, float("-inf"), tl.where(hi >= 0, v, -v))


@triton.jit
def _topk_keys(keys, K: tl.constexpr):
    """Take the K largest `_sort_key` keys along the last axis: they are replaced by KEY_NONE in
    the returned keys (so chosen = keys != returned keys). One reduction per step; a step that
    finds only KEY_NONE takes nothing. Also returns the sum of the taken values (-inf for a step
    that took nothing) in selection order, largest first, over the other axes.
    """
    total = tl.zeros(keys.shape[:-1], dtype=tl.float32)
    for _ in range(K):
        best = tl.max(keys, axis=len(keys.shape) - 1)
        keys = tl.where(keys == tl.expand_dims(best, len(keys.shape) - 1), KEY_NONE, keys)
        total += _key_value(best)
    return keys, total


@triton.jit
def _row_max(x, mask):
    """[BT, 1] max of x over `mask` per row; 0 for rows with nothing (no inf - inf = NaN)."""
    m = tl.max(tl.where(mask, x, float("-inf")), axis=1)[:, None]
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _denominator(ex):
    """Softmax denominator [BT, 1]. >= 1 on real rows (the max term is exp(0) = 1), so the
    clamp only turns padding rows' 0 / 0 into 0 / 1."""
    return tl.maximum(tl.sum(ex, axis=1)[:, None], 1.0)


@triton.jit
def _group_limit(keys, cols, NUM_GROUPS: tl.constexpr, GROUP_TOPK: tl.constexpr,
                 PER_GROUP: tl.constexpr, PER_GROUP_K: tl.constexpr, BLOCK_G: tl.constexpr,
                 GROUPS_3D: tl.constexpr):
    """`keys` [BT, BE] with KEY_NONE outside the GROUP_TOPK best groups; a group's score is the
    sum of its PER_GROUP_K best values (largest first). Ties between groups: lower group wins.

    GROUPS_3D (BLOCK_E == NUM_GROUPS * PER_GROUP, powers of two): the row viewed as
    [NUM_GROUPS, PER_GROUP], all groups at once. Else one masked pass over the row per group.
    """
    if GROUPS_3D:
        keys_3 = tl.reshape(keys, (keys.shape[0], NUM_GROUPS, PER_GROUP))
        _, group_score = _topk_keys(keys_3, PER_GROUP_K)
        gcols = tl.arange(0, NUM_GROUPS)[None, :]
        group_keys = _sort_key(group_score, gcols, NUM_GROUPS)
        kept_g = group_keys != _topk_keys(group_keys, GROUP_TOPK)[0]
        keep = tl.reshape(tl.broadcast_to(kept_g[:, :, None], keys_3.shape), keys.shape)
    else:
        group_of = cols // PER_GROUP
        gcols = tl.arange(0, BLOCK_G)[None, :]
        group_score = tl.zeros((keys.shape[0], BLOCK_G), dtype=tl.float32)
        for g in range(NUM_GROUPS):
            _, score = _topk_keys(tl.where(group_of == g, keys, KEY_NONE), PER_GROUP_K)
            group_score = tl.where(gcols == g, score[:, None], group_score)
        group_keys = tl.where(gcols < NUM_GROUPS, _sort_key(group_score, gcols, BLOCK_G), KEY_NONE)
        kept_g = group_keys != _topk_keys(group_keys, GROUP_TOPK)[0]
        keep = tl.zeros(keys.shape, dtype=tl.int1)
        for g in range(NUM_GROUPS):
            g_kept = tl.max(tl.where((gcols == g) & kept_g, 1, 0), axis=1)
            keep = keep | ((group_of == g) & (g_kept[:, None] > 0))
    return tl.where(keep, keys, KEY_NONE)


@triton.jit
def _aux_scores(x, valid, SIGMOID_SCORES: tl.constexpr):
    """The Switch aux loss's scores [BT, BE] fp32, 0 outside `valid`: softmax over E, or the
    sigmoid normalized by its row sum (+1e-20)."""
    if SIGMOID_SCORES:
        u = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
        return u / (tl.sum(u, axis=1)[:, None] + 1e-20)
    ex = tl.where(valid, tl.exp(x - _row_max(x, valid)), 0.0)
    return ex / _denominator(ex)


@triton.jit
def _aux_grad(x, valid, n, SIGMOID_SCORES: tl.constexpr):
    """d/dx of sum_e n_e * score_e per row (`_aux_scores`' scores, `n` [BT, BE] the counts)."""
    if SIGMOID_SCORES:
        u = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
        total = tl.sum(u, axis=1)[:, None] + 1e-20
        weighted = tl.sum(u * n, axis=1)[:, None]
        return u * (1.0 - u) * (n / total - weighted / (total * total))
    ex = tl.where(valid, tl.exp(x - _row_max(x, valid)), 0.0)
    s = ex / _denominator(ex)
    return s * (n - tl.sum(s * n, axis=1)[:, None])


@launch_cached
@triton.jit(do_not_specialize=["P"])  # program counts vary with the token count
def _router_aux_loss_kernel(
    aux_part_ptr,  # [P, E] fp32 in: per-program column sums of the aux scores
    counts_ptr,    # [E] int64 in: routed tokens per expert
    loss_sum_ptr,  # [] fp32 in/out: += the aux loss
    P, E, loss_scale,
    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):
    e = tl.arange(0, BLOCK_E)
    n = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.float32)
    loss = tl.sum(sum_partial_rows(aux_part_ptr, P, E, e, BLOCK_P) * n) * loss_scale
    tl.store(loss_sum_ptr, tl.load(loss_sum_ptr) + loss)


@launch_cached
@triton.jit(do_not_specialize=["T"])  # row counts vary per step: one variant
def _router_fwd_kernel(
    logits_ptr,       # [T, E] in: router logits (any float dtype)
    bias_ptr,         # [E] fp32 in: expert bias, added for the choice only (if HAS_BIAS)
    probs_ptr,        # [T, E] out: probs in the logits' dtype, 0 where not routed
    routing_map_ptr,  # [T, E] uint8 out: 1 where routed (bool storage)
    counts_ptr,       # [E] int64 in/out: += routed tokens per expert (if WITH_COUNTS)
    aux_part_ptr,     # [P, E] fp32 out: program p's sum over its rows of the aux-loss scores
    T, E, scale,
    K: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, WITH_COUNTS: tl.constexpr,
    HAS_AUX: tl.constexpr,
    NUM_GROUPS: tl.constexpr, GROUP_TOPK: tl.constexpr, PER_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
    GROUPS_3D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    cols = tl.arange(0, BLOCK_E)[None, :]
    valid = (rows < T) & (cols < E)
    offs = rows.to(tl.int64) * E + cols
    x = tl.load(logits_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if SCORE == 0:  # softmax over E, then top-k of the scores
        ex = tl.where(valid, tl.exp(x - _row_max(x, valid)), 0.0)
        scores = ex / _denominator(ex)
    elif SCORE == 1:  # top-k of the logits, softmax over the k
        scores = x
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    sel = scores
    if HAS_BIAS:
        # loaded as a [BT, BE] tile (+ 0 * rows): a [1, BE] load made the compiler lay the
        # whole tile out with warps across the columns, each row reduction through shared memory
        sel = scores + tl.load(bias_ptr + cols + 0 * rows, mask=valid, other=0.0)
    keys = tl.where(valid, _sort_key(sel, cols, BLOCK_E), KEY_NONE)
    if GROUP_TOPK > 0:
        keys = _group_limit(keys, cols, NUM_GROUPS, GROUP_TOPK, PER_GROUP, K // GROUP_TOPK,
                            BLOCK_G, GROUPS_3D)
    chosen = keys != _topk_keys(keys, K)[0]
    if SCORE == 1:
        ex = tl.where(chosen, tl.exp(x - _row_max(x, chosen)), 0.0)
        probs = ex / _denominator(ex)
    else:
        probs = tl.where(chosen, scores, 0.0)
        if SCORE == 2 and K > 1:
            probs = probs / (tl.sum(probs, axis=1)[:, None] + 1e-20)
    probs = probs * scale
    tl.store(probs_ptr + offs, probs.to(probs_ptr.dtype.element_ty), mask=valid)
    tl.store(routing_map_ptr + offs, chosen.to(tl.uint8), mask=valid)
    if HAS_AUX:
        if SCORE == 0:  # the routing's own scores are the aux scores
            aux = scores
        else:
            aux = _aux_scores(x, valid, SCORE == 2)
        e = tl.arange(0, BLOCK_E)
        tl.store(aux_part_ptr + tl.program_id(0) * E + e, tl.sum(aux, axis=0), mask=e < E)
    if WITH_COUNTS:
        counts = tl.sum(chosen.to(tl.int32), axis=0)
        e = tl.arange(0, BLOCK_E)
        # relaxed (no fences: only the sum matters), and none for experts this tile never chose
        tl.atomic_add(counts_ptr + e, counts.to(tl.int64), mask=(e < E) & (counts > 0),
                      sem="relaxed")


@launch_cached
@triton.jit(do_not_specialize=["T"])  # row counts vary per step: one variant
def _router_bwd_kernel(
    grad_probs_ptr,   # [T, E] in: grad of the dense probs (logits' dtype)
    logits_ptr,       # [T, E] in: the forward's logits
    routing_map_ptr,  # [T, E] uint8 in: the forward's choice
    grad_logits_ptr,  # [T, E] out: grad of the logits (logits' dtype)
    aux_counts_ptr,   # [E] int64 in: the counts the aux loss weighted its scores by (HAS_AUX)
    T, E, scale, aux_coeff,
    K: tl.constexpr, SCORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_AUX: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    cols = tl.arange(0, BLOCK_E)[None, :]
    valid = (rows < T) & (cols < E)
    offs = rows.to(tl.int64) * E + cols
    x = tl.load(logits_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    chosen = tl.load(routing_map_ptr + offs, mask=valid, other=0) != 0
    g = tl.load(grad_probs_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    g = tl.where(chosen, g, 0.0) * scale
    if SCORE == 0:  # d softmax over E
        ex = tl.where(valid, tl.exp(x - _row_max(x, valid)), 0.0)
        s = ex / _denominator(ex)
        grad = s * (g - tl.sum(g * s, axis=1)[:, None])
    elif SCORE == 1:  # d softmax over the chosen
        ex = tl.where(chosen, tl.exp(x - _row_max(x, chosen)), 0.0)
        p = ex / _denominator(ex)
        grad = p * (g - tl.sum(g * p, axis=1)[:, None])
    else:  # d sigmoid, through the sum normalization when K > 1
        s = 1.0 / (1.0 + tl.exp(-x))
        if K > 1:
            denom = tl.sum(tl.where(chosen, s, 0.0), axis=1)[:, None] + 1e-20
            g = g / denom - tl.sum(g * tl.where(chosen, s, 0.0), axis=1)[:, None] / (denom * denom)
        grad = tl.where(chosen, g * s * (1.0 - s), 0.0)
    if HAS_AUX:  # + aux_coeff x d(aux loss)/d(logits); the counts as a tile (see the bias load)
        n = tl.load(aux_counts_ptr + cols + 0 * rows, mask=valid, other=0).to(tl.float32)
        grad += aux_coeff * _aux_grad(x, valid, n, SCORE == 2)
    tl.store(grad_logits_ptr + offs, grad.to(grad_logits_ptr.dtype.element_ty), mask=valid)


def _groups_3d(num_experts: int, num_groups: int, block_e: int) -> bool:
    """Whether the group limit can view a row as [groups, experts per group]: no padding
    (E a power of two, hence so are the group count and size, which divide it)."""
    return num_groups > 0 and num_experts == block_e


def _score_code(score_function: str, use_pre_softmax: bool) -> int:
    if score_function == "softmax":
        return SOFTMAX_PRE if use_pre_softmax else SOFTMAX_POST
    return SIGMOID


class _RouterTopkTriton(torch.autograd.Function):
    """(probs [T, E], routing_map [T, E] bool, counts [E] int64 | None); grad flows to logits.
    With `aux` (a `SwitchAuxLoss`; needs counts), also the aux loss: its value added to
    `aux.loss_sum` by a second launch, its grad (x `aux.grad_scale`) added in the backward's."""

    @staticmethod
    def forward(ctx, logits_TE, bias_E, topk, score, group, scale, with_counts, aux):
        # The map and counts take no grad: without this, autograd would zero-fill a [T, E] and
        # an [E] grad for them (two launches) before every backward.
        ctx.set_materialize_grads(False)
        num_tokens, num_experts = logits_TE.shape
        block_t, block_e, num_warps = router_tile(num_experts)
        probs_TE = torch.empty_like(logits_TE)
        routing_map_TE = torch.empty(num_tokens, num_experts, dtype=torch.bool,
                                     device=logits_TE.device)
        counts_E = (torch.zeros(num_experts, dtype=torch.int64, device=logits_TE.device)
                    if with_counts else None)
        num_groups, group_topk = group
        programs = cdiv(num_tokens, block_t)
        aux_part_PE = (torch.empty(programs, num_experts, dtype=torch.float32,
                                   device=logits_TE.device) if aux is not None else None)
        if num_tokens:
            _router_fwd_kernel[(programs,)](
                logits_TE, bias_E if bias_E is not None else logits_TE, probs_TE,
                routing_map_TE.view(torch.uint8), counts_E if with_counts else logits_TE,
                aux_part_PE if aux is not None else logits_TE, num_tokens, num_experts, scale,
                K=topk, SCORE=score, HAS_BIAS=bias_E is not None, WITH_COUNTS=with_counts,
                HAS_AUX=aux is not None, NUM_GROUPS=num_groups, GROUP_TOPK=group_topk,
                PER_GROUP=num_experts // max(num_groups, 1),
                BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_G=next_pow2(num_groups),
                GROUPS_3D=_groups_3d(num_experts, num_groups, block_e), num_warps=num_warps)
        loss_scale = (_aux_loss_scale(aux.coeff, num_experts, topk, num_tokens)
                      if aux is not None and num_tokens else 0.0)
        if num_tokens and aux is not None:
            _router_aux_loss_kernel[(1,)](
                aux_part_PE, counts_E, aux.loss_sum, programs, num_experts, loss_scale,
                BLOCK_P=max(1, min(32, 4096 // block_e)), BLOCK_E=block_e, num_warps=4)
        ctx.save_for_backward(logits_TE, routing_map_TE, counts_E if aux is not None else None)
        aux_grad = aux.grad_scale * loss_scale if aux is not None else 0.0
        ctx.settings = (topk, score, scale, aux_grad, aux is not None)
        ctx.mark_non_differentiable(routing_map_TE)
        if with_counts:
            ctx.mark_non_differentiable(counts_E)
        return probs_TE, routing_map_TE, counts_E

    @staticmethod
    def backward(ctx, grad_probs_TE, _grad_map, _grad_counts):
        if grad_probs_TE is None:  # the probs were not used
            return None, None, None, None, None, None, None, None
        logits_TE, routing_map_TE, aux_counts_E = ctx.saved_tensors
        topk, score, scale, aux_grad, has_aux = ctx.settings
        num_tokens, num_experts = logits_TE.shape
        block_t, block_e, num_warps = router_tile(num_experts)
        grad_logits_TE = torch.empty_like(logits_TE)
        if num_tokens:
            _router_bwd_kernel[(cdiv(num_tokens, block_t),)](
                grad_probs_TE.contiguous(), logits_TE, routing_map_TE.view(torch.uint8),
                grad_logits_TE, aux_counts_E if has_aux else logits_TE, num_tokens, num_experts,
                scale, aux_grad, K=topk, SCORE=score, BLOCK_T=block_t, BLOCK_E=block_e,
                HAS_AUX=has_aux, num_warps=num_warps)
        return grad_logits_TE, None, None, None, None, None, None, None


def _aux_loss_scale(coeff: float, num_experts: int, topk: int, num_tokens: int) -> float:
    """The Switch aux loss = this x sum_e (sum_t score_te) x count_e (`switch_aux_loss`)."""
    return num_experts * coeff / (topk * num_tokens * num_tokens)


def _route(logits_TE, topk, with_counts, *, score_function="softmax", use_pre_softmax=False,
           num_groups=None, group_topk=None, scaling_factor=None, expert_bias=None,
           aux_loss: Optional[SwitchAuxLoss] = None):
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    num_experts = logits_TE.shape[1]
    check_router_args(num_experts, topk, score_function, num_groups, group_topk)
    if expert_bias is not None and tuple(expert_bias.shape) != (num_experts,):
        raise ValueError(f"expert_bias shape {tuple(expert_bias.shape)}: must be ({num_experts},)")
    if aux_loss is not None:
        check_aux_loss_routing(dict(group_topk=group_topk, expert_bias=expert_bias))
        _check_loss_sum(aux_loss.loss_sum, logits_TE.device)
    score = _score_code(score_function, use_pre_softmax)
    bias_E = None
    if score == SIGMOID and expert_bias is not None:
        bias_E = expert_bias.detach().to(torch.float32).contiguous()
    group = (num_groups, group_topk) if group_topk else (0, 0)
    scale = float(scaling_factor) if scaling_factor else 1.0
    return _RouterTopkTriton.apply(logits_TE.contiguous(), bias_E, topk, score, group, scale,
                                   with_counts, aux_loss)


def _check_loss_sum(loss_sum: torch.Tensor, device: torch.device) -> None:
    if (loss_sum.dtype != torch.float32 or loss_sum.dim() != 0 or loss_sum.device != device
            or loss_sum.requires_grad):
        raise ValueError(f"aux_loss.loss_sum: must be a 0-dim fp32 tensor on {device} without "
                         f"grad, got {tuple(loss_sum.shape)} {loss_sum.dtype} on "
                         f"{loss_sum.device}")


def router_topk_triton(
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
    """Route tokens: logits [T, E] -> (probs [T, E], 0 where not routed; routing_map [T, E] bool).

    Same contract as `router_topk.router_topk_torch` (see there for the score functions).
    One launch forward, one backward. Differentiable w.r.t. logits. Syncs no host.
    """
    probs_TE, routing_map_TE, _ = _route(
        logits_TE, topk, False, score_function=score_function, use_pre_softmax=use_pre_softmax,
        num_groups=num_groups, group_topk=group_topk, scaling_factor=scaling_factor,
        expert_bias=expert_bias)
    return probs_TE, routing_map_TE


def router_topk_with_counts_triton(logits_TE: torch.Tensor, topk: int, *,
                                   aux_loss: Optional[SwitchAuxLoss] = None, **routing_kwargs):
    """`router_topk_triton` plus tokens per expert [E] int64, counted in the same launch. With
    `aux_loss` (see `router_topk.SwitchAuxLoss`), also the Switch aux loss: its scores summed
    per program in the same launch, the loss by one more (one program), its grad inside the
    backward's launch."""
    return _route(logits_TE, topk, True, aux_loss=aux_loss, **routing_kwargs)
