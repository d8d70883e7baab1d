"""Capacity, token dropping and padded permutation against megatron-core 0.16.1's own torch code
(`moe_utils.get_capacity`, `apply_router_token_dropping`, `permute` / `unpermute` with
`drop_and_pad=True`), called as its router and all-to-all dispatcher call them: the same flags
must give the same tokens, the same probs and the same rows, bit for bit, and the same grads.

Needs megatron-core (`pip install -e ".[peer]"`); without it those tests skip and only the
tests of our own contract run. Triton runs under TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from epoverlap.kernels import make_moe_ops
from epoverlap.kernels.capacity import (apply_router_token_dropping, dropped_pairs,
                                        get_capacity)

from kernel_test_utils import distinct_logits, random_like_rows
from test_megatron_signatures import _grads, _leaf, moe_utils  # noqa: F401  (fixture)

NUM_TOKENS, NUM_EXPERTS, TOPK, HIDDEN = 24, 6, 2, 16


def _routed(seed: int, ties: bool = False):
    """(probs [T, E] leaf, routing_map [T, E]) from megatron-core's own top-k, as its router
    hands them to the token dropping. `ties`: many equal probs (the top-k tie-break matters)."""
    ops = make_moe_ops("torch")
    logits = distinct_logits(NUM_TOKENS, NUM_EXPERTS, torch.float32, seed)
    if ties:
        logits = logits.clamp(min=-1 / 32, max=1 / 32)
    probs, routing_map = ops.topk_routing_with_score_function(logits, TOPK)
    return probs.detach(), routing_map


@pytest.mark.parametrize("num_tokens, factor, min_capacity", [
    (48, 1.0, None), (48, 1.25, None), (7, 0.3, None), (7, 0.3, 4), (100, 2.0, 1)])
def test_get_capacity_matches_megatron_core(moe_utils, num_tokens, factor, min_capacity):
    theirs = moe_utils.get_capacity(num_tokens, NUM_EXPERTS, factor, min_capacity)
    assert get_capacity(num_tokens, NUM_EXPERTS, factor, min_capacity) == theirs


# (factor, pad): a capacity above the token count only without padding (megatron-core's padded
# permute fails there; our config refuses it)
FACTORS = [(0.5, False), (0.5, True), (1.0, False), (1.0, True), (1.25, False), (1.25, True),
           (10.0, False)]


@pytest.mark.parametrize("factor, pad", FACTORS)
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("ties", [False, True])
def test_token_dropping_matches_megatron_core(moe_utils, factor, policy, pad, ties):
    probs_TE, routing_map_TE = _routed(seed=int(factor * 100), ties=ties)
    results = []
    for fn in (moe_utils.apply_router_token_dropping, apply_router_token_dropping):
        probs = _leaf(probs_TE, "cpu")
        final_probs, final_map = fn(probs, routing_map_TE, router_topk=TOPK,
                                    capacity_factor=factor, drop_policy=policy,
                                    pad_to_capacity=pad)
        results.append((final_probs.detach(), final_map, _grads([final_probs], [probs], 5)))
    (their_probs, their_map, their_grads), (probs, final_map, grads) = results
    assert torch.equal(final_map, their_map)
    assert torch.equal(probs, their_probs)
    assert torch.equal(grads[0], their_grads[0])


def test_dropped_pairs_counts_what_the_capacity_removed():
    probs_TE, routing_map_TE = _routed(seed=3)
    capacity = get_capacity(NUM_TOKENS * TOPK, NUM_EXPERTS, 0.5)
    _, final_map_TE = apply_router_token_dropping(probs_TE, routing_map_TE, TOPK, 0.5)
    kept_E = final_map_TE.sum(0)
    assert int(kept_E.max()) <= capacity
    assert int(dropped_pairs(routing_map_TE, final_map_TE)) == NUM_TOKENS * TOPK - int(
        kept_E.sum())
    _, padded_TE = apply_router_token_dropping(probs_TE, routing_map_TE, TOPK, 0.5,
                                               pad_to_capacity=True)
    assert padded_TE.sum(0).eq(capacity).all()  # every expert exactly at capacity
    assert torch.equal(dropped_pairs(routing_map_TE, padded_TE),
                       dropped_pairs(routing_map_TE, final_map_TE))


def _padded_inputs(policy: str):
    probs_TE, routing_map_TE = _routed(seed=11)
    probs_TE, padded_TE = apply_router_token_dropping(probs_TE, routing_map_TE, TOPK, 1.0,
                                                      drop_policy=policy, pad_to_capacity=True)
    capacity = get_capacity(NUM_TOKENS * TOPK, NUM_EXPERTS, 1.0)
    tokens_TH = random_like_rows(NUM_TOKENS, HIDDEN, torch.float32, 12)
    return tokens_TH, padded_TE, probs_TE, capacity * NUM_EXPERTS


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_padded_permute_and_unpermute_match_megatron_core(moe_utils, backend, policy):
    """As the all-to-all dispatcher calls them with moe_pad_expert_input_to_capacity: the
    permuted rows and probs, the restored tokens, and the grads of all of them."""
    ops, device = backend
    tokens_TH, padded_TE, probs_TE, num_out = _padded_inputs(policy)
    outputs = []
    for module, dev in ((moe_utils, "cpu"), (ops, device)):
        tokens, probs = _leaf(tokens_TH, dev), _leaf(probs_TE, dev)
        routing_map = padded_TE.to(dev)
        permuted, permuted_probs, mapping = module.permute(
            tokens, routing_map, probs=probs, num_out_tokens=num_out, fused=False,
            drop_and_pad=True)
        restored = module.unpermute(permuted * 2.0, mapping, restore_shape=tokens.shape,
                                    routing_map=routing_map, fused=False, drop_and_pad=True)
        results = (permuted, permuted_probs, restored)
        outputs.append(([r.detach().cpu() for r in results],
                        _grads(results, [tokens, probs], 9)))
    (theirs, their_grads), (ours, our_grads) = outputs
    for mine, other in zip(ours + our_grads, theirs + their_grads, strict=True):
        assert torch.equal(mine, other)


def test_padded_permute_refuses_a_map_that_is_not_at_capacity(backend):
    ops, device = backend
    tokens_TH, padded_TE, probs_TE, num_out = _padded_inputs("probs")
    uneven_TE = padded_TE.clone()
    uneven_TE[0] = ~uneven_TE[0]  # one token changes experts: counts no longer all equal
    if device != "cpu":
        pytest.skip("on CUDA this is a device assert, which ends the process")
    with pytest.raises(ValueError, match="exactly capacity"):
        ops.permute(tokens_TH, uneven_TE, probs=probs_TE, num_out_tokens=num_out,
                    drop_and_pad=True)
    with pytest.raises(ValueError, match="experts x capacity"):
        ops.permute(tokens_TH, padded_TE, num_out_tokens=num_out + 1, drop_and_pad=True)


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    if request.param == "torch":
        return make_moe_ops("torch"), "cpu"
    return make_moe_ops("triton"), request.getfixturevalue("triton_device")
