"""The simulator's hierarchical dispatch (--moe-dispatch-hierarchy node): its row counts against
a Monte Carlo of balanced top-k routing, and its link time against the flat dispatch's where
tokens share hosts (2 nodes) and where they hardly do (32 nodes). Pure CPU."""

from __future__ import annotations

import pytest
import torch

from epoverlap.config.dispatch import by_host_row_share
from epoverlap.schedule.plan import Action
from epoverlap.simulator.costs import LINKS, A2aShape


def _routing(tokens: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    scores = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed))
    chosen = torch.zeros(tokens, experts, dtype=torch.bool)
    return chosen.scatter_(1, scores.topk(topk, dim=1).indices, True)


@pytest.mark.parametrize("experts, topk, hosts, per_host", [(64, 8, 2, 4), (32, 4, 4, 2)])
def test_stage_rows_match_a_monte_carlo_of_balanced_routing(experts, topk, hosts, per_host):
    """Rank (host 0, index 0): stage 1 sends one row per (token, host reached); it receives,
    from the rank of its index in every host, that rank's tokens reaching host 0, and forwards
    each to the other ranks of host 0 holding one of its experts."""
    tokens, ranks = 4000, hosts * per_host
    local = experts // ranks
    sent = _routing(tokens, experts, topk, 0).view(tokens, hosts, -1).any(dim=2).sum()
    forwarded = 0
    for source_host in range(hosts):  # the rail peer in each host (itself included)
        routing = _routing(tokens, experts, topk, 1 + source_host)
        to_rank = routing.view(tokens, ranks, local).any(dim=2)[:, :per_host]  # host 0's ranks
        reached = to_rank.any(dim=1)
        forwarded += int(to_rank[reached][:, 1:].sum())  # to the ranks other than rank 0
    shape = A2aShape(tokens, topk, 1024, experts, 2, ranks, hosts=hosts, by_host=True)
    assert int(sent) == pytest.approx(shape.rows, rel=0.03)
    assert forwarded == pytest.approx(shape.forwarded_rows, rel=0.03)


def _dispatch_us(ep: int, hierarchy: bool) -> float:
    shape = A2aShape(4096, 8, 7168, 256, 2, ep, hosts=ep // 8, by_host=hierarchy)
    return LINKS["ib"].time_us(shape, Action("F", 0, "dispatch", 0))


def test_by_host_pays_where_tokens_share_hosts_and_not_where_they_do_not():
    assert by_host_row_share(256, 8, 2) < 0.3 and by_host_row_share(256, 8, 32) > 0.9
    assert _dispatch_us(16, True) < 0.6 * _dispatch_us(16, False)  # 2 nodes of 8
    assert _dispatch_us(256, True) > _dispatch_us(256, False)  # 32 nodes: its second stage
