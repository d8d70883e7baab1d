"""--moe-dispatch-hierarchy node on gloo: 4 CPU ranks as 2 hosts of 2, and 2 as 2 hosts of 1.
Against the flat once-per-rank dispatch: the experts receive the same rows and probs in the
same order and their weights get the same grads, bit for bit; the output and the token and prob
grads match it to rounding (the combine sums per host first) and an independent dense reference
(out = x * 2 * sum_e p_e (e + 1)); with one rank per host nothing is summed apart, so every
result is the same bits. Between hosts each rank sends one row per (token, other host), counted
from the routing map, fewer than once per rank. One process: the split sizes of `HostRoute`
against a brute-force walk of a random routing."""

from __future__ import annotations

import math
import random

import pytest
import torch

from epoverlap.model.budget import ByHostBudget, DispatchBudget
from epoverlap.model.dispatch.by_host import HostRoute

from dist_helpers import run_ranks
from dispatch_workers import by_host_budget_equivalence, by_host_equivalence
from test_dispatch_once_per_rank import CASES, close_to_both

BY_HOST_CASES = {case: CASES[case] for case in ("dropless", "capacity", "top4")}


def _brute_force_route(routing, hosts, per_host, local, me):
    """Walk every token of every rank (routing[s][t] = the set of experts token t of rank s
    chose) through both stages and count what `me` sends and receives."""
    ranks = hosts * per_host
    host, index = divmod(me, per_host)
    rank_of = lambda expert: expert // local  # noqa: E731
    between_send, between_recv = [0] * hosts, [0] * hosts
    within_send, within_recv = [0] * per_host, [0] * per_host
    per_expert = [0] * local
    for source in range(ranks):
        source_host, source_index = divmod(source, per_host)
        for experts in routing[source]:
            target_ranks = {rank_of(e) for e in experts}
            target_hosts = {r // per_host for r in target_ranks}
            if source == me:
                for h in target_hosts:
                    between_send[h] += 1
            if source_index == index and host in target_hosts:
                between_recv[source_host] += 1  # it reached me, the rail peer in my host
                for r in target_ranks:
                    if r // per_host == host:
                        within_send[r % per_host] += 1
            if me in target_ranks:
                within_recv[source_index] += 1  # forwarded by my host mate of its index
                for e in experts:
                    if rank_of(e) == me:
                        per_expert[e % local] += 1
    return between_send, between_recv, within_send, within_recv, per_expert


@pytest.mark.parametrize("hosts,per_host,local,topk", [(2, 2, 2, 2), (2, 3, 2, 4), (3, 2, 1, 3)])
def test_host_route_split_sizes_match_a_brute_force_walk(hosts, per_host, local, topk):
    ranks, rng = hosts * per_host, random.Random(hosts * 100 + per_host * 10 + topk)
    experts = ranks * local
    routing = [[set(rng.sample(range(experts), topk)) for _ in range(13)] for _ in range(ranks)]
    table = []  # what each rank publishes: rows per host, (token, rank) pairs, expert counts
    for source in range(ranks):
        rows_G, pairs_R, counts_E = [0] * hosts, [0] * ranks, [0] * experts
        for chosen in routing[source]:
            for h in {e // local // per_host for e in chosen}:
                rows_G[h] += 1
            for r in {e // local for e in chosen}:
                pairs_R[r] += 1
            for e in chosen:
                counts_E[e] += 1
        table.append(rows_G + pairs_R + counts_E)
    for me in range(ranks):
        route = HostRoute.of(table, me, hosts, per_host, local)
        assert (route.between_send, route.between_recv, route.within_send, route.within_recv,
                route.tokens_per_local_expert) == _brute_force_route(routing, hosts, per_host,
                                                                     local, me)


def _rows_to_other_hosts(routing_map_TE, rank, hosts, per_host):
    """Rows a rank sends between hosts by host: one per (token, host with its experts)."""
    per_host_THX = routing_map_TE.view(routing_map_TE.shape[0], hosts, -1)
    return [int(per_host_THX[:, h].any(dim=1).sum()) for h in range(hosts)]


@pytest.mark.parametrize("ranks,hosts,backend", [(4, 2, "torch"), (2, 2, "torch"),
                                                pytest.param(4, 2, "triton",
                                                             marks=pytest.mark.slow)])
def test_by_host_matches_once_per_rank(ranks, hosts, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    per_host = ranks // hosts
    per_rank = run_ranks(by_host_equivalence, ranks, hosts, list(BY_HOST_CASES.values()),
                         backend, timeout_s=600)
    for rank, cases in enumerate(per_rank):
        for case, (flat, node) in zip(BY_HOST_CASES, cases):
            (probs, routing_map, rows, rows_probs, out, grad_x, grad_probs, grad_w,
             per_expert, sent, x_TH) = node
            where = (ranks, hosts, backend, rank, case)
            assert torch.equal(probs, flat[0]) and torch.equal(routing_map, flat[1]), where
            assert per_expert == flat[8], where
            assert torch.equal(rows, flat[2]) and torch.equal(rows_probs, flat[3]), where
            assert torch.equal(grad_w, flat[7]), where  # the experts' grads: same bits
            if per_host == 1:  # nothing summed inside a host: the same bits everywhere
                for got, want in zip((out, grad_x, grad_probs), flat[4:7]):
                    assert torch.equal(got, want), where
            close_to_both(node, flat)
            assert sent == _rows_to_other_hosts(routing_map, rank, hosts, per_host), where
            my_host = rank // per_host
            assert all(s <= f for h, (s, f) in enumerate(zip(sent, flat[9])) if h != my_host)


BUDGET_CASES = {"top2": [], "top4": ["--moe-router-topk", "4"]}


def _same_as_dropless(got: list, want: list, where) -> None:
    """The budget's results against the dropless dispatch's, bit for bit: the experts' rows and
    probs (less the budget's empty rows at the end), their counts and weight grads, the
    output and the token and prob grads."""
    per_expert = want[8]
    assert got[8] == per_expert, where
    rows = sum(per_expert)
    assert torch.equal(got[2][:rows], want[2]) and torch.equal(got[3][:rows], want[3]), where
    assert not got[2][rows:].any(), where  # empty slots carry zero rows
    for index in (0, 1, 4, 5, 6, 7):  # probs, routing, output, grads x / probs / weights
        assert torch.equal(got[index], want[index]), (where, index)


@pytest.mark.parametrize("ranks,hosts", [(4, 2), (2, 2)])
def test_by_host_budget_is_the_dropless_by_host_dispatch_bit_for_bit(ranks, hosts):
    """A budget that holds any routing (4.0 on <= 4 ranks: the top level) runs once and gives
    the dropless by-host dispatch's bits."""
    per_rank = run_ranks(by_host_budget_equivalence, ranks, hosts,
                         list(BUDGET_CASES.values()), 4.0, "torch", timeout_s=600)
    for rank, cases in enumerate(per_rank):
        for case, (want, got, levels, sizes, demand) in zip(BUDGET_CASES, cases):
            where = (ranks, hosts, rank, case)
            assert levels == [0], where
            _same_as_dropless(got, want, where)


@pytest.mark.parametrize("ranks,hosts", [pytest.param(4, 2, marks=pytest.mark.slow), (2, 2)])
def test_by_host_budget_cuts_records_and_its_rerun_is_dropless(ranks, hosts):
    """At budget 0.5 every stage's block is below balanced routing: rows are cut, the demand
    (rows to one host, to one mate, pairs on one rank's experts) exceeds the blocks, and the
    reruns, each at a level that holds what the last one counted (rows cut in stage 1 are not
    counted in stage 2, so that may take two), end with the dropless bits."""
    per_rank = run_ranks(by_host_budget_equivalence, ranks, hosts,
                         list(BUDGET_CASES.values()), 0.5, "torch", timeout_s=600)
    for rank, cases in enumerate(per_rank):
        for case, (want, got, levels, sizes, demand) in zip(BUDGET_CASES, cases):
            where = (ranks, hosts, rank, case)
            assert len(levels) >= 2 and levels == sorted(set(levels)), where
            assert demand[0] > sizes[0] and demand[2] > sizes[2], (where, demand, sizes)
            _same_as_dropless(got, want, where)


def test_by_host_budget_sizes_each_stage_from_balanced_routing():
    """64 experts top-2 over 2 hosts of 2, 1000 tokens: a token reaches a host with chance
    1 - C(32, 2) / C(64, 2) and a rank with 1 - C(48, 2) / C(64, 2); each buffer is the level
    times its balanced share, capped by what can come; the top level (f = ranks) holds
    everything; `fits` needs all three demands."""
    budget = DispatchBudget.for_dispatch(1.25, 4, 1000, 2, 64, True, torch.device("cpu"),
                                         hosts=2)
    assert isinstance(budget, ByHostBudget) and budget.levels == (1.25, 2.5, 4.0)
    reach_host = 1 - math.comb(32, 2) / math.comb(64, 2)
    reach_rank = 1 - math.comb(48, 2) / math.comb(64, 2)
    assert budget.block_rows == math.ceil(1.25 * 1000 * reach_host) == 943
    assert budget.within_rows == math.ceil(1.25 * 2 * 1000 * reach_rank) == 1102
    assert budget.expert_rows == math.ceil(1.25 * 1000 * 2) == 2500
    top = len(budget.levels) - 1
    assert budget.block_rows_at(top) == 1000 and budget.within_rows_at(top) == 2000
    assert budget.expert_rows_at(top) == 2 * 2000 * 2  # every received row, every expert
    assert budget.rerun_level([943, 1102, 2500]) is None
    assert budget.rerun_level([944, 0, 0]) == 1
    assert budget.rerun_level([0, 1103, 0]) == 1
    assert budget.rerun_level([0, 0, 2501]) == 1
    assert budget.rerun_level([0, 2000, 0]) == 1 and budget.rerun_level([0, 0, 8000]) == top
    budget.note(torch.tensor([3, 7]))
    budget.note_within(torch.tensor([5, 2]))
    budget.note_expert_rows(torch.tensor(11))
    assert budget.demand().tolist() == [7, 5, 11]
    budget.reset_demand()
    assert budget.demand().tolist() == [0, 0, 0]


def _local_copy_layer(budget_factor, me: int, hosts=2, per_host=2, experts=8, topk=3,
                      tokens=24):
    """One rank's MoE layer by host with --comm-mode local_copy (one process, no group) and
    identity experts: -> (combined [T, H], x [T, H], the experts' rows)."""
    from epoverlap.config.dispatch import DispatchMode
    from epoverlap.kernels import make_moe_ops
    from epoverlap.model.dispatch import make_dispatcher
    from epoverlap.parallel.comm import ExpertComm, HostComms
    ranks, cpu = hosts * per_host, torch.device("cpu")
    by_host = HostComms(ExpertComm(None, hosts, "local_copy"),
                        ExpertComm(None, per_host, "local_copy"), me)
    comm = ExpertComm(None, ranks, "local_copy", by_host=by_host)
    budget = None if budget_factor is None else DispatchBudget.for_dispatch(
        budget_factor, ranks, tokens, topk, experts, True, cpu, hosts=hosts)
    mode = DispatchMode(budget=budget_factor, once_per_rank=True, hierarchy="node")
    dispatcher = make_dispatcher(comm, experts, topk, make_moe_ops("torch"), cpu, mode, budget)
    gen = torch.Generator().manual_seed(7 + me)
    x_TH = torch.randn(tokens, 16, generator=gen)
    chosen = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :topk]
    routing_TE = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs_TE = torch.rand(tokens, experts, generator=gen) * routing_TE
    counts_E = routing_TE.sum(dim=0)
    rows, probs, row_id_map = dispatcher.preprocess(x_TH, probs_TE, routing_TE)
    exchange = dispatcher.start_split_exchange(counts_E, row_id_map)
    recv, recv_probs, meta = dispatcher.dispatch(rows, probs, counts_E, exchange, row_id_map)
    expert_rows, _, local_map = dispatcher.sort_by_expert(recv, recv_probs, meta)
    back = dispatcher.unsort(expert_rows, meta, local_map)
    return dispatcher.combine(back, meta, row_id_map), x_TH, expert_rows


@pytest.mark.parametrize("budget_factor", [None, 4.0])
@pytest.mark.parametrize("me", [0, 1, 3])
def test_local_copy_by_host_brings_back_every_rank_its_own_rows(budget_factor, me):
    """--comm-mode local_copy with the hierarchy (dropless: `HostRoute.mirrored`; the budget
    form's blocks mirror by themselves): both stages' local copies give back what was sent,
    so with identity experts each token's combine sums its own row once per chosen expert."""
    combined, x_TH, expert_rows = _local_copy_layer(budget_factor, me)
    if budget_factor is None:  # the dropless form sizes the experts' rows exactly
        assert expert_rows.shape[0] == x_TH.shape[0] * 3
    torch.testing.assert_close(combined, x_TH * 3)


def test_host_route_mirrored_sizes_what_this_rank_sent():
    # 2 hosts of 2, 2 local experts; this rank's row: rows per host, pairs per rank, counts
    row = [5, 4] + [3, 2, 4, 1] + [1, 2, 0, 2, 3, 1, 0, 1]
    route = HostRoute.mirrored(row, 2, 2, 2)
    assert route.between_send == route.between_recv == [5, 4]
    assert route.within_send == route.within_recv == [3 + 4, 2 + 1]
    assert route.tokens_per_local_expert == [1 + 0 + 3 + 0, 2 + 2 + 1 + 1]
