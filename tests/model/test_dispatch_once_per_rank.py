"""--moe-dispatch-once-per-rank on gloo (2 and 4 CPU ranks): each token crosses to a rank once,
not once per expert there. Against the dispatch that sends a row per (token, expert): the
experts receive the same rows and probs in the same order and their weights get the same
grads, bit for bit; the output and the token and prob grads match it and an independent
dense reference (out = x * 2 * sum_e p_e (e + 1)) to rounding; the rows sent to other ranks
are the (token, rank) pairs counted from the routing map, fewer than the (token, expert)
pairs; with the budget too. One process: a preprocess checked by hand, and the simulator's
row count against the preprocess's. Training with it: overlap on and off bitwise alike, the
budget's reruns, graphs (test_dispatch_modes)."""

from __future__ import annotations

import pytest
import torch

from epoverlap.config.dispatch import DispatchMode
from epoverlap.model.budget import DispatchBudget
from epoverlap.model.dispatch import TokenDispatcher, make_dispatcher
from epoverlap.model.dispatch.routing import cut_expert_pairs
from epoverlap.parallel.comm import ExpertComm
from epoverlap.kernels import make_moe_ops
from epoverlap.simulator.costs import A2aShape

from dist_helpers import run_ranks
from dispatch_workers import EXPERTS, once_per_rank_equivalence


def _local_dispatcher(ranks: int, experts: int, topk: int) -> TokenDispatcher:
    """A once-per-rank dispatcher laid out for `ranks` EP ranks, used only up to its
    preprocess (which communicates nothing)."""
    return make_dispatcher(ExpertComm(None, ranks), experts, topk, make_moe_ops("torch"),
                           torch.device("cpu"), DispatchMode(once_per_rank=True))


def test_the_budget_sizes_the_experts_rows_by_the_pairs_not_the_received_rows():
    """100 tokens a rank, top-4 of 8 experts on 2 ranks (L = 4), budget 1.25: a block holds 125
    of a rank's 200 possible rows, and the local experts get ceil(1.25 x 100 x 4) = 500 rows,
    not every received row times min(4, L) = 1,000. At the top level (2.0) the chunk holds
    every row and the experts every pair of both ranks (800). A level holds a step when it
    holds both demands."""
    budget = DispatchBudget(1.25, 2, 200, torch.device("cpu"), pairs_per_dispatch=400,
                            pairs_per_row=4)
    assert budget.levels == (1.25, 2.0)
    assert (budget.block_rows_at(0), budget.expert_rows_at(0)) == (125, 500)
    assert (budget.block_rows_at(1), budget.expert_rows_at(1)) == (200, 800)
    assert budget.rerun_level([125, 500]) is None
    assert budget.rerun_level([125, 501]) == 1 and budget.rerun_level([126, 0]) == 1
    per_expert = DispatchBudget(1.25, 2, 400, torch.device("cpu"))
    assert per_expert.expert_rows is None and per_expert.rerun_level([250, 10**6]) is None


def test_the_experts_pairs_past_the_budget_are_cut_in_permute_order_and_recorded():
    """4 received rows, 2 local experts; the second permute numbers the pairs expert-major:
    expert 0's rows 0, 2, 3, then expert 1's rows 0, 1. A budget of 4 pairs keeps the first
    four (expert 1 keeps row 0 only) and records the 5 wanted; pairs that fit are not cut."""
    budget = DispatchBudget(0.5, 2, 4, torch.device("cpu"), pairs_per_dispatch=4,
                            pairs_per_row=2)
    probs_ML = torch.tensor([[0.5, 0.5], [-1.0, 0.9], [0.8, -1.0], [0.3, -1.0]])
    cut = cut_expert_pairs(budget, probs_ML, 4, topk=2)
    assert torch.equal(cut, torch.tensor([[0.5, 0.5], [-1.0, -1.0], [0.8, -1.0],
                                          [0.3, -1.0]]))
    assert int(budget.demand_expert_rows) == 5
    assert torch.equal(cut_expert_pairs(budget, probs_ML, 5, topk=2), probs_ML)


def test_preprocess_sends_each_token_once_per_rank_by_hand():
    """3 tokens, 4 experts on 2 ranks (2 each): token 0 -> experts 0, 1 (rank 0 only), token 1
    -> experts 1, 2 (both ranks), token 2 -> experts 2, 3 (rank 1 only). Rank 0 gets tokens 0,
    1; rank 1 gets tokens 1, 2: 4 rows (not 6), rank-major, tokens in order, each with the
    probs of its rank's two experts and -1 where the token did not choose one."""
    dispatcher = _local_dispatcher(2, 4, 2)
    hidden_TH = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    routing_map_TE = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    probs_TE = torch.tensor([[0.6, 0.4, 0, 0], [0, 0.7, 0.3, 0], [0, 0, 0.1, 0.9]])
    rows_NH, probs_NL, row_id_map_TR = dispatcher.preprocess(hidden_TH, probs_TE,
                                                             routing_map_TE)
    assert rows_NH.shape == (6, 2)  # static: 3 tokens x min(topk 2, 2 ranks)
    assert rows_NH[:4].tolist() == [[1, 10], [2, 20], [2, 20], [3, 30]]
    assert rows_NH[4:].abs().sum() == 0  # past the routed rows: zeros, never sent
    assert torch.equal(probs_NL[:4], torch.tensor([[0.6, 0.4], [-1, 0.7], [0.3, -1],
                                                   [0.1, 0.9]]))
    assert row_id_map_TR.tolist() == [[0, -1], [1, 2], [-1, 3]]


@pytest.mark.parametrize("experts,topk,ranks", [(8, 8, 2), (32, 4, 2), (64, 8, 8)])
def test_simulator_counts_the_rows_the_preprocess_makes(experts, topk, ranks):
    """The simulator's bytes (`sim_costs.A2aShape.rows`, a formula) against the rows the
    preprocess really makes for evenly spread top-k routing (4096 tokens, uniform scores)."""
    tokens = 4096
    dispatcher = _local_dispatcher(ranks, experts, topk)
    scores_TE = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(0))
    routing_map_TE = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map_TE.scatter_(1, scores_TE.topk(topk, dim=1).indices, True)
    _, _, row_id_map_TR = dispatcher.preprocess(torch.zeros(tokens, 4), scores_TE,
                                                routing_map_TE)
    made = int((row_id_map_TR >= 0).sum())
    predicted = A2aShape(tokens, topk, 4, experts, 2, ranks, once_per_rank=True).rows
    assert made == pytest.approx(predicted, rel=0.02)
    assert made < tokens * topk or topk == 1


CASES = {"dropless": [], "capacity": ["--moe-expert-capacity-factor", "1.0"],
         "top4": ["--moe-router-topk", "4"],
         "budget": ["--moe-dispatch-budget", "4.0"]}  # blocks that hold any routing (<= 4 ranks)


def _reference(x_TH, probs_TE, routing_map_TE, grad_TH):
    """out[t] = x[t] * 2 * sum over t's experts e of p[t, e] * (e + 1), and its prob grads."""
    weight_TE = routing_map_TE * 2.0 * torch.arange(1, EXPERTS + 1, dtype=x_TH.dtype)
    out_TH = x_TH * (probs_TE * weight_TE).sum(dim=1, keepdim=True)
    grad_probs_TE = weight_TE * (x_TH * grad_TH).sum(dim=1, keepdim=True)
    return out_TH, grad_probs_TE


def close_to_both(got: list, other: list) -> None:
    """A dispatch's output, token grads and prob grads (a worker's result list) match another
    dispatch's and the dense reference's to rounding."""
    probs, routing_map, out, grad_x, grad_probs, x_TH = (got[0], got[1], got[4], got[5],
                                                         got[6], got[10])
    for mine, theirs in ((out, other[4]), (grad_x, other[5]), (grad_probs, other[6])):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    grad_TH = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    out_ref, grad_probs_ref = _reference(x_TH, probs, routing_map, grad_TH)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_probs, grad_probs_ref, rtol=1e-5, atol=1e-5)


def _remote_rows(routing_map_TE, rank, ranks, once):
    """Rows this rank's dispatch sends to each other rank, counted from the routing map."""
    per_rank_TRL = routing_map_TE.view(routing_map_TE.shape[0], ranks, -1)
    per_rank_TR = per_rank_TRL.any(dim=2) if once else per_rank_TRL.sum(dim=2)
    return [int(per_rank_TR[:, r].sum()) for r in range(ranks) if r != rank]


@pytest.mark.parametrize("ranks,backend", [(2, "torch"), (4, "torch"), (2, "triton")])
def test_once_per_rank_matches_the_dispatch_per_expert(ranks, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    per_rank = run_ranks(once_per_rank_equivalence, ranks, list(CASES.values()), backend,
                         timeout_s=600)
    fewer = 0
    for rank, cases in enumerate(per_rank):
        for case, (plain, once) in zip(CASES, cases):
            (probs, routing_map, rows, rows_probs, out, grad_x, grad_probs, grad_w,
             per_expert, splits, x_TH) = once
            where = (ranks, backend, rank, case)
            assert torch.equal(probs, plain[0]) and torch.equal(routing_map, plain[1]), where
            assert per_expert == plain[8], where
            routed = sum(per_expert)  # the budget's static row counts differ; past them: zeros
            assert torch.equal(rows[:routed], plain[2][:routed]), where
            assert torch.equal(rows_probs[:routed], plain[3][:routed]), where
            assert rows[routed:].abs().sum() == 0 and plain[2][routed:].abs().sum() == 0
            assert torch.equal(grad_w, plain[7]), where  # the experts' grads: same bits
            close_to_both(once, plain)
            if case == "budget":  # equal blocks: the splits are not the rows
                continue
            for all_to_alls, once_per_rank in ((splits, True), (plain[9], False)):
                dispatch = [n for r, n in enumerate(all_to_alls[0]) if r != rank]
                assert dispatch == _remote_rows(routing_map, rank, ranks, once_per_rank), where
            fewer += sum(splits[0]) < sum(plain[9][0])
    assert fewer >= len(per_rank)  # the point: fewer rows cross (top-2 of 8 shares ranks)
