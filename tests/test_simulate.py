"""The schedule simulator (tools/sim_engine.py, sim_costs.py, simulate.py), pure CPU.

The engine tests replay small plans with hand-made durations and compare every span with a
timeline worked out by hand in the comments (the lane and event rules of the executor, written
out step by step): an independent reference, not the simulator's own output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from epoverlap.model.nodes import COMM, COMPUTE, NodeKind
from epoverlap.schedule.plan import Action, combined_1f1b_plan, sequential_plan
from epoverlap_tools.sim_costs import (A2aShape, DurationTable, LinkModel, NodeCosts,
                                       a2a_volume, aligned_comm, fit_link)
from epoverlap_tools.sim_engine import SERIAL, STREAM, THREAD, simulate

MOE_LAYER = (NodeKind("attn", COMPUTE, True), NodeKind("dispatch", COMM),
             NodeKind("mlp", COMPUTE, True), NodeKind("combine", COMM))
LAYOUT = [MOE_LAYER]
# hand-made durations (us): compute per (phase, node); every all-to-all 5
COMPUTE_US = {("F", "embed"): 1, ("F", "attn"): 4, ("F", "mlp"): 3, ("F", "loss"): 1,
              ("B", "loss"): 1, ("B", "mlp"): 6, ("B", "attn"): 8, ("B", "embed"): 1,
              ("W", "mlp"): 2, ("W", "attn"): 3}


def table_costs(comm=5.0, host=0.0, sync=0.0, per_rank=None):
    """Costs from the tables above; per_rank[(rank, "F0.attn.L0")] overrides one duration."""
    per_rank = per_rank or {}

    def compute(rank, action):
        return per_rank.get((rank, str(action)), COMPUTE_US[(action.kind, action.node)])

    def comm_us(rank, action):
        return per_rank.get((rank, str(action)), comm)

    def sync_us(rank, action):
        return sync if (action.kind, action.node) == ("F", "dispatch") else 0.0
    return NodeCosts(compute, comm_us, host=lambda r, a: host, sync=sync_us)


def spans_of(result, rank=0):
    return {str(s.action): (s.start_us, s.end_us) for s in result.ranks[rank].spans}


def test_stream_lanes_follow_the_executor_event_rules():
    plan = combined_1f1b_plan(LAYOUT, 2)
    result = simulate(plan, LAYOUT, table_costs(), 1, STREAM)
    # By hand: compute and comm FIFOs; ev[m] = end of m's last F/B action in plan order.
    expected = {
        "F0.embed": (0, 1), "F0.attn.L0": (1, 5),
        "F0.dispatch.L0": (5, 10),        # waits ev0 = 5
        "F0.mlp.L0": (10, 13),            # waits ev0 = 10
        "F0.combine.L0": (13, 18), "F0.loss": (18, 19), "B0.loss": (19, 20),
        "F1.embed": (20, 21),             # compute FIFO
        "B0.combine.L0": (20, 25),        # comm free at 18, ev0 = 20
        "F1.attn.L0": (21, 25),           # ev1 = 21: overlaps B0.combine
        "B0.mlp.L0": (25, 31),            # ev0 = 25
        "F1.dispatch.L0": (25, 30),       # ev1 = 25: overlaps B0.mlp
        "B0.dispatch.L0": (31, 36),       # ev0 = 31
        "F1.mlp.L0": (31, 34),            # compute free 31, ev1 = 30
        "F1.combine.L0": (36, 41),        # comm free 36
        "B0.attn.L0": (36, 44),           # ev0 = 36
        "F1.loss": (44, 45), "B0.embed": (45, 46), "B1.loss": (46, 47),
        "B1.combine.L0": (47, 52), "B1.mlp.L0": (52, 58), "B1.dispatch.L0": (58, 63),
        "B1.attn.L0": (63, 71), "B1.embed": (71, 72)}
    assert spans_of(result) == expected
    assert result.step_us == 72


def test_thread_lanes_run_compute_on_the_host_and_hand_comm_over_in_plan_order():
    plan = combined_1f1b_plan(LAYOUT, 2)
    result = simulate(plan, LAYOUT, table_costs(), 1, THREAD)
    # By hand: a comm action starts when the host reaches it and the comm thread is free; a
    # compute F/B action first waits for the last comm action handed over for its microbatch.
    expected = {
        "F0.embed": (0, 1), "F0.attn.L0": (1, 5), "F0.dispatch.L0": (5, 10),
        "F0.mlp.L0": (10, 13), "F0.combine.L0": (13, 18), "F0.loss": (18, 19),
        "B0.loss": (19, 20), "F1.embed": (20, 21),
        "B0.combine.L0": (21, 26),        # handed over after F1.embed ran on the host
        "F1.attn.L0": (21, 25),
        "B0.mlp.L0": (26, 32),            # waits for B0.combine
        "F1.dispatch.L0": (32, 37),       # the host reaches it only after B0.mlp
        "B0.dispatch.L0": (37, 42),       # comm thread FIFO
        "F1.mlp.L0": (37, 40),            # waits for F1.dispatch
        "F1.combine.L0": (42, 47),
        "B0.attn.L0": (42, 50),           # waits for B0.dispatch
        "F1.loss": (50, 51),              # F1.combine (47) already done
        "B0.embed": (51, 52), "B1.loss": (52, 53), "B1.combine.L0": (53, 58),
        "B1.mlp.L0": (58, 64), "B1.dispatch.L0": (64, 69), "B1.attn.L0": (69, 77),
        "B1.embed": (77, 78)}
    assert spans_of(result) == expected
    assert result.step_us == 78


def test_serial_lanes_sum_everything_and_weight_grads_do_not_wait():
    plan = sequential_plan(LAYOUT, 2)
    # forward 1+4+5+3+5+1 = 19, backward 1+5+6+5+8+1 = 26, two microbatches
    assert simulate(plan, LAYOUT, table_costs(), 1, SERIAL).step_us == 2 * (19 + 26)
    plan = combined_1f1b_plan(LAYOUT, 2, delay_wgrad=True)
    spans = spans_of(simulate(plan, LAYOUT, table_costs(), 1, STREAM))
    # B0.mlp ends at 31 as before; W0.mlp (2) runs right after it on the compute FIFO, without
    # waiting for ev0 and without moving it: B0.dispatch still starts at 31 (comm lane)
    assert spans["B0.mlp.L0"] == (25, 31)
    assert spans["W0.mlp.L0"] == (31, 33)
    assert spans["B0.dispatch.L0"] == (31, 36)
    assert spans["F1.mlp.L0"] == (33, 36)      # behind W0.mlp in the compute FIFO
    assert spans["B0.attn.L0"] == (36, 44)
    assert spans["W0.attn.L0"] == (44, 47)


def test_all_to_all_starts_when_the_last_rank_arrives():
    layout = LAYOUT
    plan = sequential_plan(layout, 1)
    # rank 1's F0.attn takes 10 instead of 4, and rank 1 starts 2 us late
    costs = table_costs(per_rank={(1, "F0.attn.L0"): 10})
    result = simulate(plan, layout, costs, 2, SERIAL, start_us=[0.0, 2.0])
    r0, r1 = spans_of(result, 0), spans_of(result, 1)
    # rank 0 ready at 5, rank 1 at 2 + 1 + 10 = 13: the dispatch runs 13..18 on both; rank 0's
    # recorded span starts at its own arrival (5), as the span recorder measures it
    assert r0["F0.dispatch.L0"] == (5, 18) and r1["F0.dispatch.L0"] == (13, 18)
    assert r0["F0.mlp.L0"] == (18, 21) == r1["F0.mlp.L0"]
    # every later collective is aligned too; step times: rank 0 ends at 18+3+5+1+1+5+6+5+8+1
    end = 18 + 3 + 5 + 1 + 1 + 5 + 6 + 5 + 8 + 1
    assert result.ranks[0].step_us == end and result.ranks[1].step_us == end - 2
    assert result.comm_busy_us == 4 * 5


def test_host_issue_cost_and_the_dispatch_host_sync():
    plan = sequential_plan(LAYOUT, 1)[:4]  # F0.embed F0.attn F0.dispatch F0.mlp
    # launch-bound: every action costs the host 2 us to issue; device times from the tables
    costs = table_costs(host=2.0, sync=1.0)
    spans = spans_of(simulate(plan, LAYOUT, costs, 1, SERIAL))
    # embed: issued 0..2, runs 0..max(1, 2) = 2; attn: issued 2..4, runs 2..6
    # dispatch: issued at 4, stream free at 6: runs 6..11; the host blocks until 6 + 1 = 7,
    # then spends its 2 us: host at 9; mlp issued 9..11, runs max(11, 9) = 11..14
    assert spans == {"F0.embed": (0, 2), "F0.attn.L0": (2, 6), "F0.dispatch.L0": (6, 11),
                     "F0.mlp.L0": (11, 14)}
    # a longer split-size exchange (4 us): the host blocks until 6 + 4 = 10, then spends its
    # 2 us: the dispatch cannot end before 12 (its last launch), mlp is issued 12..14 and runs
    # 12..15
    costs = table_costs(host=2.0, sync=4.0)
    spans = spans_of(simulate(plan, LAYOUT, costs, 1, SERIAL))
    assert spans["F0.dispatch.L0"] == (6, 12)
    assert spans["F0.mlp.L0"] == (12, 15)


def test_duration_table_falls_back_to_same_node_and_phase():
    table = DurationTable([(0, Action.parse("F0.attn.L0"), 10.0),
                           (0, Action.parse("F1.attn.L0"), 20.0),
                           (1, Action.parse("F0.attn.L1"), 40.0)])
    assert table(0, Action.parse("F0.attn.L0")) == 10.0
    assert table(0, Action.parse("F5.attn.L0")) == 15.0      # same rank, node, layer
    assert table(1, Action.parse("F5.attn.L0")) == 15.0      # any rank, same layer
    assert table(3, Action.parse("F0.attn.L1")) == 40.0      # rank 3 wraps to rank 1
    assert table(0, Action.parse("F2.attn.L7")) == pytest.approx(70.0 / 3)
    with pytest.raises(KeyError):
        table(0, Action.parse("W0.attn.L0"))


def test_link_model_bytes_and_time():
    shape = A2aShape(tokens=1000, topk=2, hidden=100, num_experts=8, dtype_bytes=2, ep=4)
    action = Action.parse("F0.combine.L0")
    assert a2a_volume(shape, action) == (1000 * 2 * 100 * 2, 1)
    assert a2a_volume(shape, Action.parse("F0.dispatch.L0")) == (400000 + 2000 * 4 + 8 * 8, 3)
    link = LinkModel("x", bandwidth_gbs=1.0, latency_us=10.0, local_gbs=math.inf)
    # 3/4 of 400 kB leave the GPU at 1 GB/s = 300 us, plus one call's latency
    assert link.time_us(shape, action) == pytest.approx(310.0)
    assert link.time_us(shape, action, imbalance=2.0) == pytest.approx(610.0)
    # 8 GPUs per node: at EP 16, 8/16 of the bytes cross nodes, 7/16 stay on NVLink
    ib = LinkModel("ib", bandwidth_gbs=1.0, latency_us=0.0, gpus_per_node=8, nvlink_gbs=10.0,
                   local_gbs=math.inf)
    wide = A2aShape(1000, 2, 100, 16, 2, 16)
    assert ib.time_us(wide, action) == pytest.approx(400000 * 8 / 16 / 1e3)


def test_fit_link_recovers_latency_and_bandwidth():
    truth = LinkModel("x", bandwidth_gbs=2.0, latency_us=30.0)
    points = [(b, c, c * 30.0 + b / 2e3) for b, c in [(1e5, 1), (4e5, 1), (2e5, 3), (8e5, 2)]]
    fitted = fit_link(points)
    assert fitted.latency_us == pytest.approx(truth.latency_us)
    assert fitted.bandwidth_gbs == pytest.approx(truth.bandwidth_gbs)
