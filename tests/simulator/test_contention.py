"""The simulator's lanes slowing each other (epoverlap/simulator/contention.py), pure CPU: the
covered share by hand, each action's first stretch read off the hand-worked timeline of
tests/simulator/test_simulate.py, and the fixed point's bounds (the engine is monotone in its
durations, so stretching every all-to-all fully bounds it from above)."""

from __future__ import annotations

import pytest

from epoverlap.schedule.plan import combined_1f1b_plan, sequential_plan
from epoverlap.simulator.contention import _stretches, covered, simulate_contended
from epoverlap.simulator.engine import SERIAL, STREAM, simulate
from sim_tables import LAYOUT, spans_of, table_costs


def test_the_share_of_a_run_the_other_lane_covers():
    assert covered(0, 10, [(2, 4), (3, 6), (8, 20)]) == pytest.approx(0.6)
    assert covered(0, 10, []) == 0.0
    assert covered(5, 5, [(0, 10)]) == 0.0
    assert covered(0, 10, [(-5, 30)]) == 1.0


def test_each_actions_stretch_from_the_plain_replay():
    plan = combined_1f1b_plan(LAYOUT, 2)
    timeline = simulate(plan, LAYOUT, table_costs(), 1, STREAM).ranks[0]
    got = {str(action): value for (_, action), value in
           _stretches(timeline, table_costs(), {"comm": 2.0, "compute": 1.0}).items()}
    # by hand, from test_stream_lanes_follow_the_executor_event_rules' timeline: B0.combine
    # (20-25) beside F1.embed and F1.attn (20-25); F1.dispatch (25-30) beside B0.mlp (25-31);
    # B0.dispatch (31-36) beside F1.mlp (31-34): 3 of 5; the first forward's and the last
    # backward's all-to-alls have nothing beside them
    assert got == pytest.approx({"F0.dispatch.L0": 1.0, "F0.combine.L0": 1.0,
                                 "B0.combine.L0": 2.0, "F1.dispatch.L0": 2.0,
                                 "B0.dispatch.L0": 1.6, "F1.combine.L0": 2.0,
                                 "B1.combine.L0": 1.0, "B1.dispatch.L0": 1.0})
    compute = {str(action): value for (_, action), value in
               _stretches(timeline, table_costs(), {"comm": 1.0, "compute": 1.5}).items()}
    assert compute["F1.attn.L0"] == pytest.approx(1.5)  # 21-25 under B0.combine's 20-25
    assert compute["F0.attn.L0"] == 1.0 and compute["B1.attn.L0"] == 1.0


def test_the_contended_step_lies_between_the_plain_one_and_every_all_to_all_stretched():
    plan = combined_1f1b_plan(LAYOUT, 4)
    plain = simulate(plan, LAYOUT, table_costs(), 1, STREAM)
    contended = simulate_contended(plan, LAYOUT, table_costs(), 1, STREAM, comm_factor=2.0)
    every = simulate(plan, LAYOUT, table_costs(comm=10.0), 1, STREAM)
    assert plain.step_us < contended.step_us < every.step_us
    # nothing computes beside the first dispatch: it keeps its time
    assert spans_of(contended)["F0.dispatch.L0"] == spans_of(plain)["F0.dispatch.L0"]


def test_no_slowdown_and_serial_lanes_are_the_plain_replay():
    plan = combined_1f1b_plan(LAYOUT, 2)
    plain = simulate(plan, LAYOUT, table_costs(), 2, STREAM)
    same = simulate_contended(plan, LAYOUT, table_costs(), 2, STREAM)
    assert [spans_of(same, r) for r in (0, 1)] == [spans_of(plain, r) for r in (0, 1)]
    seq = sequential_plan(LAYOUT, 2)
    assert simulate_contended(seq, LAYOUT, table_costs(), 1, SERIAL, comm_factor=3.0,
                              compute_factor=2.0).step_us == \
        simulate(seq, LAYOUT, table_costs(), 1, SERIAL).step_us
    with pytest.raises(ValueError, match="below 1"):
        simulate_contended(plan, LAYOUT, table_costs(), 1, STREAM, comm_factor=0.5)
