"""Megatron-core call compatibility: both backends' permute, unpermute, sort_chunks_by_idxs and
topk_routing_with_score_function, called exactly as megatron-core 0.16.1's dispatchers and
router call `moe_utils`, against moe_utils' own torch implementations (outputs and grads).

The comparison needs megatron-core (`pip install -e ".[peer]"`); without it those tests skip
and only the keyword-name and rejection tests run. Triton runs under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from epoverlap.kernels import make_moe_ops
from benchmarks.harness.bench_peer import bind_missing_te_names

from kernel_test_utils import (distinct_logits, grouped_logits, random_like_rows, random_probs,
                               random_routing_map)

OPS = ("permute", "unpermute", "sort_chunks_by_idxs", "topk_routing_with_score_function")


@pytest.fixture(scope="module")
def moe_utils():
    try:
        from megatron.core.transformer.moe import moe_utils as module
    except ImportError as error:
        pytest.skip(f"megatron-core is not installed (pip install -e '.[peer]'): {error}")
    bind_missing_te_names(module)  # as upstream's 0.17 does: the non-fused paths run without TE
    return module


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    """(op table, device) for each backend; Triton skips where it cannot run."""
    if request.param == "torch":
        return make_moe_ops("torch"), "cpu"
    device = request.getfixturevalue("triton_device")
    return make_moe_ops("triton"), device


def _leaf(tensor: torch.Tensor, device) -> torch.Tensor:
    return tensor.detach().clone().to(device).requires_grad_()


def _grads(outputs, inputs, seed: int):
    """Backward of sum(output * fixed random weights); -> grads of `inputs` on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((out.float() * torch.randn(out.shape, generator=gen).to(out.device)).sum()
               for out in outputs)
    return [g.cpu() for g in torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("name", OPS)
def test_parameters_match_megatron_core(moe_utils, name):
    """Same parameter names, order, kinds and defaults as megatron-core, on both backends."""
    theirs = inspect.signature(getattr(moe_utils, name)).parameters
    ours = inspect.signature(getattr(make_moe_ops("torch"), name)).parameters
    assert list(ours) == list(theirs)
    for param in theirs.values():
        if param.default is not inspect.Parameter.empty:
            assert ours[param.name].default == param.default, param.name
        assert ours[param.name].kind == param.kind, param.name


ROUTER_CASES = {  # as router.py passes its config
    "softmax": dict(use_pre_softmax=False, num_groups=None, group_topk=None,
                    scaling_factor=None, score_function="softmax"),
    "softmax_pre_scaled": dict(use_pre_softmax=True, num_groups=None, group_topk=None,
                               scaling_factor=2.0, score_function="softmax"),
    "sigmoid_bias": dict(use_pre_softmax=False, num_groups=None, group_topk=None,
                         scaling_factor=2.5, score_function="sigmoid", bias=True),
    "sigmoid_groups": dict(use_pre_softmax=False, num_groups=4, group_topk=2,
                           scaling_factor=None, score_function="sigmoid", bias=True),
}


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
def test_topk_routing_matches_megatron_core(moe_utils, backend, case):
    ops, device = backend
    kwargs = dict(ROUTER_CASES[case])
    num_tokens, num_experts, topk = 16, 8, 4
    make = grouped_logits if kwargs["num_groups"] else None
    logits_TE = (make(num_tokens, num_experts, kwargs["num_groups"], torch.float32, 1)
                 if make else distinct_logits(num_tokens, num_experts, torch.float32, 1))
    bias_E = (torch.linspace(-0.05, 0.05, num_experts) if kwargs.pop("bias", False) else None)
    results = []
    for fn, dev in ((moe_utils.topk_routing_with_score_function, "cpu"),
                    (ops.topk_routing_with_score_function, device)):
        logits = _leaf(logits_TE, dev)
        probs, routing_map = fn(logits, topk, **kwargs,
                                expert_bias=None if bias_E is None else bias_E.to(dev),
                                fused=False, router_replay=None)
        results.append((probs.detach().cpu(), routing_map.cpu(), _grads([probs], [logits], 7)))
    (their_probs, their_map, their_grads), (probs, routing_map, grads) = results
    assert torch.equal(routing_map, their_map)
    torch.testing.assert_close(probs, their_probs, rtol=2e-6, atol=2e-6)  # fp32 rounding
    torch.testing.assert_close(grads[0], their_grads[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
def test_reference_model_routing_and_router_losses_match_megatron_core(moe_utils, case):
    """tests/reference_model.py (the test_reference_model reference, written from the math)
    against megatron-core's own functions, in float64: routing, aux loss in its "megatron"
    counting mode, z-loss. Also pins the one difference from epoverlap: megatron-core counts
    the aux loss's tokens by a plain top-k of the aux scores, so with an expert bias or groups
    those counts differ from the routed experts' (epoverlap counts the routed ones)."""
    from reference_model import ReferenceHyper, route, switch_aux_loss, z_loss
    kwargs = dict(ROUTER_CASES[case])
    num_tokens, num_experts, topk = 64, 8, 4
    bias_E = (torch.linspace(-0.05, 0.05, num_experts, dtype=torch.float64)
              if kwargs.pop("bias", False) else None)
    logits_TE = torch.randn(num_tokens, num_experts, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(5))
    hyper = ReferenceHyper(heads=1, kv_heads=1, topk=topk, score_function=kwargs[
        "score_function"], pre_softmax=kwargs["use_pre_softmax"], num_groups=kwargs[
        "num_groups"], group_topk=kwargs["group_topk"], scaling_factor=kwargs["scaling_factor"],
        aux_loss_coeff=0.01, z_loss_coeff=0.001, norm_eps=1e-5, rotary_base=1e4,
        aux_counts="megatron")
    ours, theirs = _leaf(logits_TE, "cpu"), _leaf(logits_TE, "cpu")
    chosen_TE, gate_TE, margin = route(ours, hyper, bias_E)
    probs_TE, routing_map_TE = moe_utils.topk_routing_with_score_function(
        theirs, topk, **kwargs, expert_bias=bias_E, fused=False, router_replay=None)
    assert margin > 1e-6 and torch.equal(chosen_TE, routing_map_TE)
    aux_map_TE, aux_scores_TE = moe_utils.compute_routing_scores_for_aux_loss(
        theirs, topk, kwargs["score_function"])
    ours_out = [gate_TE, switch_aux_loss(ours, chosen_TE, hyper), z_loss(ours, 0.001)]
    theirs_out = [probs_TE, moe_utils.switch_load_balancing_loss_func(
        aux_scores_TE, aux_map_TE.sum(dim=0), num_tokens, topk, num_experts, 0.01),
        moe_utils.z_loss_func(theirs, 0.001)]
    for seed, (mine, upstream) in enumerate(zip(ours_out, theirs_out)):  # theirs: fp32 inside
        torch.testing.assert_close(mine, upstream.to(mine.dtype), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(_grads([mine], [ours], seed), _grads([upstream], [theirs], seed),
                                   rtol=1e-6, atol=1e-7)
    counts_differ = not torch.equal(aux_map_TE, routing_map_TE)
    assert counts_differ == (bias_E is not None or kwargs["group_topk"] is not None), case


def _routing_inputs(seed=0, num_tokens=12, num_experts=6, topk=2, hidden=24):
    routing_map_TE = random_routing_map(num_tokens, num_experts, topk, seed)
    tokens_TH = random_like_rows(num_tokens, hidden, torch.float32, seed + 1)
    probs_TE = random_probs(routing_map_TE, torch.float32, seed + 2)
    return tokens_TH, routing_map_TE, probs_TE, num_tokens * topk


def _permute_both(fn, device, with_probs: bool, tensor_count: bool):
    """permute as the all-to-all dispatcher calls it (probs) or as the all-gather one (no probs,
    num_out_tokens a tensor); -> (outputs, mapping, leaves)."""
    tokens_TH, routing_map_TE, probs_TE, num_out = _routing_inputs()
    tokens = _leaf(tokens_TH, device)
    routing_map = routing_map_TE.to(device)
    if with_probs:
        probs = _leaf(probs_TE, device)
        permuted, permuted_probs, mapping = fn(tokens, routing_map, probs=probs,
                                               num_out_tokens=num_out, fused=False,
                                               drop_and_pad=False)
        return (permuted, permuted_probs), mapping, (tokens, probs)
    count = routing_map.sum(dim=0).sum() if tensor_count else num_out
    permuted, permuted_probs, mapping = fn(tokens, routing_map, num_out_tokens=count,
                                           fused=False)
    assert permuted_probs is None
    return (permuted,), mapping, (tokens,)


@pytest.mark.parametrize("with_probs", [True, False])
def test_permute_matches_megatron_core(moe_utils, backend, with_probs):
    ops, device = backend
    theirs, _, their_leaves = _permute_both(moe_utils.permute, "cpu", with_probs, True)
    ours, _, our_leaves = _permute_both(ops.permute, device, with_probs, True)
    for mine, other in zip(ours, theirs, strict=True):
        assert torch.equal(mine.detach().cpu(), other.detach())
    for mine, other in zip(_grads(ours, our_leaves, 3), _grads(theirs, their_leaves, 3)):
        torch.testing.assert_close(mine, other, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_probs", [True, False])
def test_unpermute_matches_megatron_core(moe_utils, backend, with_probs):
    """unpermute of each side's own permute output, called as the dispatchers call it."""
    ops, device = backend
    outputs = []
    for module, dev in ((moe_utils, "cpu"), (ops, device)):
        tokens_TH, routing_map_TE, probs_TE, num_out = _routing_inputs(seed=5)
        routing_map = routing_map_TE.to(dev)
        permuted, _, mapping = module.permute(tokens_TH.to(dev), routing_map,
                                              num_out_tokens=num_out, fused=False)
        rows = _leaf(permuted * 1.5, dev)
        probs = _leaf(probs_TE, dev) if with_probs else None
        out = module.unpermute(rows, mapping, restore_shape=tokens_TH.shape, probs=probs,
                               routing_map=routing_map, fused=False, drop_and_pad=False)
        leaves = [rows] + ([probs] if with_probs else [])
        outputs.append((out.detach().cpu(), _grads([out], leaves, 4)))
    (theirs, their_grads), (ours, our_grads) = outputs
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=2e-6)
    for mine, other in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, other, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("with_probs", [True, False])
def test_sort_chunks_matches_megatron_core(moe_utils, backend, with_probs):
    """As the all-to-all dispatcher sorts received rows by local expert (and back)."""
    ops, device = backend
    ranks, local_experts, hidden = 3, 2, 16
    gen = torch.Generator().manual_seed(11)
    counts_RL = torch.randint(0, 4, (ranks, local_experts), generator=gen)
    sort_by_expert = torch.arange(ranks * local_experts).view(ranks, local_experts).T.ravel()
    rows_NH = torch.randn(int(counts_RL.sum()), hidden, generator=gen)
    probs_N = torch.rand(rows_NH.shape[0], generator=gen)
    outputs = []
    for fn, dev in ((moe_utils.sort_chunks_by_idxs, "cpu"), (ops.sort_chunks_by_idxs, device)):
        rows = _leaf(rows_NH, dev)
        if with_probs:
            probs = _leaf(probs_N, dev)
            out, out_probs = fn(rows, counts_RL.ravel().to(dev), sort_by_expert.to(dev),
                                probs=probs, fused=False)
            results, leaves = (out, out_probs), (rows, probs)
        else:
            out, none = fn(rows, counts_RL.ravel().to(dev), sort_by_expert.to(dev), fused=False)
            assert none is None
            results, leaves = (out,), (rows,)
        outputs.append(([r.detach().cpu() for r in results], _grads(results, leaves, 2)))
    (theirs, their_grads), (ours, our_grads) = outputs
    for mine, other in zip(ours + our_grads, theirs + their_grads, strict=True):
        assert torch.equal(mine, other)


# ------------------------------------------------- without megatron-core: keywords, rejections
def test_megatron_keyword_names_are_accepted(backend):
    ops, device = backend
    tokens_TH, routing_map_TE, probs_TE, num_out = _routing_inputs()
    tokens, routing_map = tokens_TH.to(device), routing_map_TE.to(device)
    permuted, permuted_probs, mapping = ops.permute(
        tokens=tokens, routing_map=routing_map, probs=probs_TE.to(device),
        num_out_tokens=torch.tensor(num_out), fused=True, drop_and_pad=False)
    restored = ops.unpermute(permuted_tokens=permuted, sorted_indices=mapping,
                             restore_shape=tokens.shape, probs=None, routing_map=routing_map)
    assert torch.allclose(restored.cpu(), tokens_TH * routing_map_TE.sum(1, keepdim=True))
    out, out_probs = ops.sort_chunks_by_idxs(
        input=permuted, split_sizes=routing_map.sum(0), sorted_idxs=torch.arange(6, device=device),
        probs=permuted_probs)
    assert torch.equal(out, permuted) and torch.equal(out_probs, permuted_probs)
    probs, chosen = ops.topk_routing_with_score_function(
        logits=distinct_logits(12, 6, torch.float32, 0, device), topk=2, score_function="softmax")
    assert chosen.sum(1).eq(2).all() and probs.shape == (12, 6)


def test_unsupported_megatron_modes_are_refused():
    ops = make_moe_ops("torch")
    tokens_TH, routing_map_TE, _, num_out = _routing_inputs()
    with pytest.raises(ValueError, match="drop_and_pad=True"):  # a dropless map is not padded
        ops.permute(tokens_TH, routing_map_TE, num_out_tokens=num_out, drop_and_pad=True)
    with pytest.raises(ValueError, match="router_replay"):
        ops.topk_routing_with_score_function(torch.zeros(4, 6), 2, router_replay=object())
    with pytest.raises(ValueError, match="num_experts"):
        ops.topk_routing_with_score_function(torch.zeros(2, 4, 6), 2)
