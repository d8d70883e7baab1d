"""Triton router top-k against the torch reference: routing map and counts bit for bit, probs
and logit grads to fp32 rounding, ties, determinism, edge shapes. Small T: under the CPU
interpreter each program and op costs."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels.router_topk import check_router_args, router_topk_with_counts_torch
from epoverlap.kernels.router_topk_triton import (router_topk_triton,
                                                  router_topk_with_counts_triton)

from kernel_test_utils import (INTERPRETED, assert_bits_equal, assert_same_run, close_tolerance,
                               distinct_logits, generator, grouped_logits)

NUM_TOKENS = 21  # not a multiple of any BLOCK_T

VARIANTS = {
    "softmax_pre": dict(score_function="softmax", use_pre_softmax=True),
    "softmax_post": dict(score_function="softmax"),
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid_bias": dict(score_function="sigmoid", bias=True),
    "sigmoid_bias_groups_scaled": dict(score_function="sigmoid", bias=True, num_groups=4,
                                       group_topk=2, scaling_factor=2.5),
    "softmax_pre_groups": dict(score_function="softmax", use_pre_softmax=True, num_groups=3,
                               group_topk=3),
    "softmax_post_groups_scaled": dict(score_function="softmax", num_groups=4, group_topk=1,
                                       scaling_factor=0.5),
}


def _kwargs(variant: str, num_experts: int, device) -> dict:
    kwargs = dict(VARIANTS[variant])
    if kwargs.pop("bias", False):
        # multiples of 1/64 keep scores + bias free of new ties
        bias = torch.randint(-8, 8, (num_experts,), generator=generator(7)).float() / 64
        kwargs["expert_bias"] = bias.to(device)
    return kwargs


def _logits(variant, num_experts, dtype, seed, device):
    groups = VARIANTS[variant].get("num_groups")
    if groups:
        return grouped_logits(NUM_TOKENS, num_experts, groups, dtype, seed, device)
    return distinct_logits(NUM_TOKENS, num_experts, dtype, seed, device)


def _run(fn, logits_TE, topk, kwargs, seed=3):
    logits_TE = logits_TE.detach().clone().requires_grad_()
    probs_TE, routing_map_TE, counts_E = fn(logits_TE, topk, **kwargs)
    grad_TE = torch.randn(probs_TE.shape, generator=generator(seed)).to(probs_TE)
    (probs_TE.float() * grad_TE.float()).sum().backward()
    return probs_TE.detach(), routing_map_TE, counts_E, logits_TE.grad


def _compare(variant, num_experts, topk, dtype, device, seed=0):
    kwargs = _kwargs(variant, num_experts, device)
    logits_TE = _logits(variant, num_experts, dtype, seed, device)
    ref = _run(router_topk_with_counts_torch, logits_TE, topk, kwargs)
    out = _run(router_topk_with_counts_triton, logits_TE, topk, kwargs)
    assert_bits_equal(out[1], ref[1], "routing_map")
    assert_bits_equal(out[2], ref[2], "tokens_per_expert")
    tol = close_tolerance(dtype, interpreted=INTERPRETED)
    # probs: softmax denominators summed in another order, exp/sigmoid implementations differ
    torch.testing.assert_close(out[0], ref[0], **tol)
    # grads: the same plus the recomputed (not saved) scores; a few ulp of the score scale
    torch.testing.assert_close(out[3], ref[3], rtol=tol["rtol"] * 4, atol=tol["atol"] * 4)
    assert out[0].dtype == dtype and out[3].dtype == dtype
    return out


def _valid_routing(variant: str, topk: int) -> bool:
    settings = VARIANTS[variant]
    try:
        check_router_args(12, topk, settings["score_function"], settings.get("num_groups"),
                          settings.get("group_topk"))
    except ValueError:
        return False
    return True


# only the valid (variant, topk) pairs: test_router_rejects_bad_arguments has refusals
@pytest.mark.parametrize("variant, topk", [(variant, topk) for topk in (1, 2, 6)
                                           for variant in sorted(VARIANTS)
                                           if _valid_routing(variant, topk)])
def test_router_matches_reference_fp32(triton_device, variant, topk):
    _compare(variant, 12, topk, torch.float32, triton_device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["softmax_pre", "softmax_post", "sigmoid_bias_groups_scaled"])
def test_router_matches_reference_half(triton_device, variant, dtype):
    _compare(variant, 12, 4, dtype, triton_device)


@pytest.mark.parametrize("num_experts,topk,variant", [
    (1, 1, "softmax_post"),        # a single expert
    (7, 7, "sigmoid"),             # every expert chosen, non-power-of-two E
    (40, 9, "softmax_pre"),        # k > 8
    (64, 8, "sigmoid_bias"),       # DeepSeek-like top-8
    (48, 8, "sigmoid_bias_groups_scaled"),
])
def test_router_shapes(triton_device, num_experts, topk, variant):
    out = _compare(variant, num_experts, topk, torch.float32, triton_device)
    assert int(out[1].sum()) == NUM_TOKENS * topk
    assert out[2].dtype == torch.int64 and out[2].shape == (num_experts,)


def test_router_ties_go_to_lower_expert(triton_device):
    logits_TE = torch.zeros(5, 10)
    logits_TE[1, [2, 5, 7]] = 1.0  # three-way tie for the top, then 7 tied zeros
    logits_TE[2] = torch.tensor([1.0, 1, 0, 1, 0, 1, 1, 0, 0, 1])
    logits_TE = logits_TE.to(triton_device)
    for variant in ("softmax_pre", "softmax_post", "sigmoid"):
        kwargs = dict(VARIANTS[variant])
        _, map_ref = router_topk_with_counts_torch(logits_TE, 4, **kwargs)[:2]
        _, map_out = router_topk_triton(logits_TE, 4, **kwargs)
        expected = torch.zeros(5, 10, dtype=torch.bool)
        expected[[0, 3, 4], :4] = True
        expected[1, [0, 2, 5, 7]] = True
        expected[2, [0, 1, 3, 5]] = True
        assert_bits_equal(map_out.cpu(), expected, f"{variant} triton")
        assert_bits_equal(map_ref.cpu(), expected, f"{variant} reference")


def test_router_deterministic(triton_device):
    kwargs = _kwargs("sigmoid_bias_groups_scaled", 16, triton_device)
    logits_TE = grouped_logits(NUM_TOKENS, 16, 4, torch.float32, 5, triton_device)
    first = _run(router_topk_with_counts_triton, logits_TE, 4, kwargs)
    second = _run(router_topk_with_counts_triton, logits_TE, 4, kwargs)
    assert_same_run(first, second, "router")


def test_router_no_tokens(triton_device):
    logits_TE = torch.zeros(0, 6, device=triton_device, requires_grad=True)
    probs_TE, map_TE, counts_E = router_topk_with_counts_triton(logits_TE, 2)
    assert probs_TE.shape == (0, 6) and map_TE.shape == (0, 6)
    assert counts_E.tolist() == [0] * 6
    probs_TE.sum().backward()
    assert logits_TE.grad.shape == (0, 6)


@pytest.mark.parametrize("bad,match", [
    (dict(score_function="relu"), "score_function"),
    (dict(num_groups=5, group_topk=2), "num_groups"),
    (dict(num_groups=4, group_topk=3), "must be divisible by group_topk"),  # topk 2
    (dict(num_groups=8, group_topk=1), "exceeds experts per group"),
    (dict(expert_bias=torch.zeros(3), score_function="sigmoid"), "expert_bias"),
])
def test_router_rejects_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        router_topk_triton(torch.zeros(4, 8), 2, **bad)



# ---------------------------------------------------------------- the Switch aux loss, fused
AUX_COEFF, AUX_GRAD_SCALE = 0.01, 0.25
AUX_VARIANTS = ["softmax_pre", "softmax_post", "sigmoid"]


def _run_aux(fn, logits_TE, topk, kwargs, seed=3):
    """_run with the aux loss: (probs, map, counts, logits grad, the loss added to a sum)."""
    from epoverlap.kernels.router_topk import SwitchAuxLoss

    loss_sum = torch.full((), 0.5, device=logits_TE.device)  # a running sum: the loss adds
    aux = SwitchAuxLoss(AUX_COEFF, AUX_GRAD_SCALE, loss_sum)
    out = _run(lambda *a, **k: fn(*a, aux_loss=aux, **k), logits_TE, topk, kwargs, seed)
    return out + (loss_sum - 0.5,)


def _independent_aux_loss(logits_TE, counts_E, topk, score_function):
    """The Switch aux loss in float64, written from its definition (Megatron-core's
    switch_load_balancing_loss_func): E * coeff / (k * T^2) * sum_e (sum_t p_te) * f_e."""
    x = logits_TE.double()
    if score_function == "softmax":
        scores = torch.exp(x - x.max(dim=1, keepdim=True).values)
        scores = scores / scores.sum(dim=1, keepdim=True)
    else:
        scores = 1 / (1 + torch.exp(-x))
        scores = scores / (scores.sum(dim=1, keepdim=True) + 1e-20)
    tokens, experts = x.shape
    return (experts * AUX_COEFF / (topk * tokens * tokens)
            * (scores.sum(dim=0) * counts_E.double()).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("variant", AUX_VARIANTS)
def test_router_aux_loss_matches_reference(triton_device, variant, topk, dtype):
    """The fused aux loss: its value against the reference chain and a float64 formula
    written here; the logits' grad (probs' grad + grad_scale x the loss's grad) against the
    reference's autograd through switch_aux_loss and attach_aux_loss."""
    kwargs = _kwargs(variant, 12, triton_device)
    logits_TE = _logits(variant, 12, dtype, 1, triton_device)
    ref = _run_aux(router_topk_with_counts_torch, logits_TE, topk, kwargs)
    out = _run_aux(router_topk_with_counts_triton, logits_TE, topk, kwargs)
    assert_bits_equal(out[2], ref[2], "tokens_per_expert")
    expected = _independent_aux_loss(logits_TE.cpu(), ref[2].cpu(), topk,
                                     VARIANTS[variant]["score_function"])
    torch.testing.assert_close(out[4].double().cpu(), expected, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(out[4], ref[4], rtol=1e-5, atol=1e-9)
    tol = close_tolerance(dtype, interpreted=INTERPRETED)
    torch.testing.assert_close(out[3], ref[3], rtol=tol["rtol"] * 4, atol=tol["atol"] * 4)
    # the loss's grad is really there: without it the logits' grad differs
    plain = _run(router_topk_with_counts_triton, logits_TE, topk, kwargs)
    assert (plain[3].float() - out[3].float()).abs().max() > 0


def test_router_aux_loss_deterministic_and_no_tokens(triton_device):
    kwargs = _kwargs("softmax_post", 16, triton_device)
    logits_TE = _logits("softmax_post", 16, torch.float32, 2, triton_device)
    first = _run_aux(router_topk_with_counts_triton, logits_TE, 2, kwargs)
    second = _run_aux(router_topk_with_counts_triton, logits_TE, 2, kwargs)
    assert_same_run(first, second, "router with aux loss")
    empty = torch.zeros(0, 6, device=triton_device)
    out = _run_aux(router_topk_with_counts_triton, empty, 2, {})
    assert float(out[4]) == 0.0 and out[3].shape == (0, 6)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("bad,match", [
    (dict(num_groups=4, group_topk=2), "group_topk and expert_bias"),
    (dict(expert_bias=torch.zeros(8), score_function="sigmoid"), "group_topk and expert_bias"),
])
def test_router_aux_loss_refuses_routings_it_does_not_count(kernel, bad, match):
    from epoverlap.kernels.router_topk import SwitchAuxLoss

    fn = router_topk_with_counts_torch if kernel == "torch" else router_topk_with_counts_triton
    with pytest.raises(ValueError, match=match):
        fn(torch.zeros(4, 8), 2, aux_loss=SwitchAuxLoss(0.01, 1.0, torch.zeros(())), **bad)


def test_router_aux_loss_refuses_a_bad_loss_sum():
    from epoverlap.kernels.router_topk import SwitchAuxLoss

    bad = SwitchAuxLoss(0.01, 1.0, torch.zeros((), dtype=torch.float64))
    with pytest.raises(ValueError, match="aux_loss.loss_sum: must be a 0-dim fp32"):
        router_topk_with_counts_triton(torch.zeros(4, 8), 2, aux_loss=bad)
