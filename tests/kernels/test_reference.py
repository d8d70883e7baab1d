"""The torch references against naive Python loops (the spec written out), and their grads
against finite differences (float64 gradcheck). Includes empty experts, k = 1, padding tokens,
every token on one expert, and the tie rule."""

import math

import pytest
import torch

from epoverlap.kernels.permutation import build_row_id_map, permute_torch, unpermute_torch
from epoverlap.kernels.router_topk import expert_token_counts, router_topk_torch
from epoverlap.kernels.sort_chunks import sort_chunks_by_idxs_torch

from kernel_test_utils import (assert_bits_equal, distinct_logits, generator, grouped_logits,
                               random_like_rows, random_probs, random_routing_map)


# ----------------------------------------------------------------------------- naive specs

def _naive_topk(values: list, k: int, allowed=None) -> list:
    """Indices of the k largest values, largest first; ties: lower index first."""
    allowed = range(len(values)) if allowed is None else allowed
    return sorted(allowed, key=lambda e: (-values[e], e))[:k]


def _naive_route(row: list, topk: int, score_function="softmax", use_pre_softmax=False,
                 num_groups=None, group_topk=None, scaling_factor=None, bias=None):
    """One token: (probs per expert, chosen experts), in float64."""
    num_experts = len(row)
    if score_function == "softmax":
        top = max(row)
        exps = [math.exp(x - top) for x in row]
        scores = [v / sum(exps) for v in exps] if use_pre_softmax else list(row)
    else:
        scores = [1 / (1 + math.exp(-x)) for x in row]
    select = [s + (bias[e] if bias is not None else 0) for e, s in enumerate(scores)]
    allowed = range(num_experts)
    if group_topk:
        per = num_experts // num_groups
        group_score = [sum(sorted(select[g * per:(g + 1) * per], reverse=True)[:topk // group_topk])
                       for g in range(num_groups)]
        kept = _naive_topk(group_score, group_topk)
        allowed = [e for e in range(num_experts) if e // per in kept]
    chosen = _naive_topk(select, topk, allowed)
    if score_function == "softmax" and not use_pre_softmax:
        top = max(row[e] for e in chosen)
        exps = {e: math.exp(row[e] - top) for e in chosen}
        probs = {e: exps[e] / sum(exps.values()) for e in chosen}
    else:
        probs = {e: scores[e] for e in chosen}
        if score_function == "sigmoid" and topk > 1:
            total = sum(probs.values()) + 1e-20
            probs = {e: p / total for e, p in probs.items()}
    scale = scaling_factor or 1.0
    return [probs.get(e, 0.0) * scale for e in range(num_experts)], chosen


ROUTINGS = [
    dict(score_function="softmax", use_pre_softmax=True),
    dict(score_function="softmax"),
    dict(score_function="sigmoid"),
    dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.0, bias=True),
    dict(score_function="softmax", use_pre_softmax=True, num_groups=2, group_topk=1),
]


# topk must be divisible by group_topk: only the pairs where it is
@pytest.mark.parametrize("routing, topk", [
    (routing, topk) for topk in (1, 2, 4) for routing in range(len(ROUTINGS))
    if not (ROUTINGS[routing].get("group_topk") and topk % ROUTINGS[routing]["group_topk"])])
def test_router_reference_matches_naive(routing, topk):
    settings = dict(ROUTINGS[routing])
    use_bias = settings.pop("bias", False)
    num_experts = 8
    logits_TE = (grouped_logits(9, num_experts, settings["num_groups"], torch.float32, topk)
                 if settings.get("num_groups") else distinct_logits(9, num_experts,
                                                                   torch.float32, topk))
    bias_E = torch.arange(num_experts, dtype=torch.float32) / 64 if use_bias else None
    probs_TE, map_TE = router_topk_torch(logits_TE, topk, expert_bias=bias_E, **settings)
    for t, row in enumerate(logits_TE.tolist()):
        probs, chosen = _naive_route(row, topk, bias=None if bias_E is None else bias_E.tolist(),
                                     **settings)
        assert sorted(chosen) == map_TE[t].nonzero().flatten().tolist(), f"token {t}"
        # fp32 reference vs float64 spec
        torch.testing.assert_close(probs_TE[t].double(), torch.tensor(probs, dtype=torch.float64),
                                   rtol=1e-6, atol=1e-7)


def test_router_reference_ties_and_one_expert():
    logits_TE = torch.zeros(4, 6)
    logits_TE[:, 3] = 5.0  # every token's best is expert 3; the rest tie
    _, map_TE = router_topk_torch(logits_TE, 3)
    assert map_TE.sum(0).tolist() == [4, 4, 0, 4, 0, 0]  # ties: lower experts
    _, map_TE = router_topk_torch(logits_TE, 1, score_function="sigmoid")
    assert expert_token_counts(map_TE).tolist() == [0, 0, 0, 4, 0, 0]


@pytest.mark.parametrize("routing", range(len(ROUTINGS)))
def test_router_reference_grad(routing):
    settings = dict(ROUTINGS[routing])
    settings.pop("bias", None)
    logits_TE = (grouped_logits(5, 8, settings["num_groups"], torch.float64, 1)
                 if settings.get("num_groups") else distinct_logits(5, 8, torch.float64, 1))
    logits_TE.requires_grad_()
    # the reference computes in fp32 by design (even for float64 logits): finite differences
    # of fp32 math need a large step and loose tolerances
    assert torch.autograd.gradcheck(lambda x: router_topk_torch(x, 2, **settings)[0],
                                    (logits_TE,), eps=1e-3, atol=1e-3, rtol=1e-2)


# ----------------------------------------------------------------------------- permutation

def _naive_row_id_map(routing_map_TE):
    num_tokens, num_experts = routing_map_TE.shape
    rows, next_row = [[-1] * num_experts for _ in range(num_tokens)], 0
    for e in range(num_experts):
        for t in range(num_tokens):
            if routing_map_TE[t, e]:
                rows[t][e], next_row = next_row, next_row + 1
    return torch.tensor(rows, dtype=torch.int32).reshape(num_tokens, num_experts)


MAPS = {
    "k2_padding_empty": dict(num_tokens=9, num_experts=5, topk=2, num_padding=2,
                             empty_experts=(1,)),
    "k1": dict(num_tokens=7, num_experts=4, topk=1),
    "k5_of_5": dict(num_tokens=4, num_experts=5, topk=5),
}


def _map(name):
    spec = dict(MAPS[name])
    return random_routing_map(spec.pop("num_tokens"), spec.pop("num_experts"), spec.pop("topk"),
                              3, **spec)


@pytest.mark.parametrize("name", sorted(MAPS))
def test_permute_reference_matches_naive(name):
    routing_map_TE = _map(name)
    tokens_TH = random_like_rows(routing_map_TE.shape[0], 6, torch.float32, 1)
    probs_TE = random_probs(routing_map_TE, torch.float32, 2)
    num_routed = int(routing_map_TE.sum())
    permuted_NH, probs_N, row_id_map_TE = permute_torch(tokens_TH, routing_map_TE, probs_TE,
                                                        num_out_tokens=num_routed + 2)
    assert_bits_equal(row_id_map_TE, _naive_row_id_map(routing_map_TE), "row map")
    assert_bits_equal(build_row_id_map(routing_map_TE), row_id_map_TE, "build_row_id_map")
    want_rows, want_probs = [], []
    for e in range(routing_map_TE.shape[1]):
        for t in range(routing_map_TE.shape[0]):
            if routing_map_TE[t, e]:
                want_rows.append(tokens_TH[t])
                want_probs.append(float(probs_TE[t, e]))
    want_rows += [torch.zeros(6)] * 2
    assert_bits_equal(permuted_NH, torch.stack(want_rows), "permuted")
    assert_bits_equal(probs_N, torch.tensor(want_probs + [0.0, 0.0]), "permuted probs")


def test_all_tokens_on_one_expert():
    routing_map_TE = torch.zeros(5, 3, dtype=torch.bool)
    routing_map_TE[:, 2] = True
    tokens_TH = random_like_rows(5, 4, torch.float32, 0)
    permuted_NH, _, row_id_map_TE = permute_torch(tokens_TH, routing_map_TE, num_out_tokens=5)
    assert row_id_map_TE[:, 2].tolist() == [0, 1, 2, 3, 4]
    assert_bits_equal(permuted_NH, tokens_TH, "one expert")
    assert_bits_equal(unpermute_torch(permuted_NH, row_id_map_TE), tokens_TH, "back")


@pytest.mark.parametrize("name", sorted(MAPS))
@pytest.mark.parametrize("merge", [False, True])
def test_unpermute_reference_matches_naive(name, merge):
    routing_map_TE = _map(name)
    num_tokens, num_experts = routing_map_TE.shape
    row_id_map_TE = build_row_id_map(routing_map_TE)
    rows_NH = random_like_rows(int(routing_map_TE.sum()), 6, torch.float32, 4)
    probs_TE = random_probs(routing_map_TE, torch.float32, 5) if merge else None
    out_TH = unpermute_torch(rows_NH, row_id_map_TE, probs=probs_TE)
    for t in range(num_tokens):
        acc = torch.zeros(6)  # fp32, in expert order
        for e in range(num_experts):
            row = int(row_id_map_TE[t, e])
            if row >= 0:
                acc = acc + rows_NH[row] * (probs_TE[t, e] if merge else 1.0)
        assert_bits_equal(out_TH[t], acc, f"token {t}")


def test_permutation_reference_grads():
    routing_map_TE = _map("k2_padding_empty")
    tokens_TH = random_like_rows(9, 3, torch.float64, 1).requires_grad_()
    probs_TE = random_probs(routing_map_TE, torch.float64, 2).requires_grad_()
    merge_TE = random_probs(routing_map_TE, torch.float64, 3).requires_grad_()

    def round_trip(x, p, m):
        permuted, permuted_probs, row_map = permute_torch(x, routing_map_TE, p, num_out_tokens=17)
        return unpermute_torch(permuted * permuted_probs[:, None] ** 2, row_map, probs=m)
    # unpermute accumulates in fp32 by design, even for float64 rows: loose finite differences
    assert torch.autograd.gradcheck(round_trip, (tokens_TH, probs_TE, merge_TE), eps=1e-3,
                                    atol=1e-3, rtol=1e-2)


# ----------------------------------------------------------------------------- chunk sort

def test_sort_chunks_reference_matches_naive():
    sizes = [2, 0, 3, 1, 4]
    order = [3, 0, 4, 2, 1]
    rows_NH = random_like_rows(sum(sizes) + 2, 3, torch.float32, 6)
    probs_N = torch.rand(rows_NH.shape[0], generator=generator(7))
    out_NH, out_N = sort_chunks_by_idxs_torch(rows_NH, torch.tensor(sizes), torch.tensor(order),
                                              probs_N)
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    index = [starts[c] + i for c in order for i in range(sizes[c])]
    index += list(range(sum(sizes), rows_NH.shape[0]))  # rows past the total stay
    assert_bits_equal(out_NH, rows_NH[index], "rows")
    assert_bits_equal(out_N, probs_N[index], "probs")


def test_sort_chunks_reference_grad():
    rows_NH = random_like_rows(7, 2, torch.float64, 1).requires_grad_()
    probs_N = torch.rand(7, generator=generator(2), dtype=torch.float64).requires_grad_()
    sizes, order = torch.tensor([3, 0, 4]), torch.tensor([2, 1, 0])
    assert torch.autograd.gradcheck(
        lambda x, p: sort_chunks_by_idxs_torch(x, sizes, order, p), (rows_NH, probs_N))
