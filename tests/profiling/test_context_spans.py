"""A context-parallel run's spans (2 gloo ranks, CP 2 x EP 2, the overlap on, steps 2-3
profiled) as the timeline tool and the simulator read them: with --cp-comm-type allgather
every layer's K/V gather is a comm-lane span named `F<m>.kv_gather.L<i>` / `B<m>.kv_gather.L<i>`
(one per microbatch, layer and phase), which `epoverlap-timeline` lists per comm node and puts
on the comm track of its trace, and which `epoverlap-simulate --spans` replays through the
same path as any recording (measured against simulated step time); with p2p the ring has no
span of its own (it runs inside `attn`, on the compute lane).

Slow tier: two 2-rank recordings (about 10 s each unloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from context_workers import cp_losses
from dist_helpers import run_ranks
from epoverlap.profiling.spans import read_span_directory

FLAGS = ["--train-iters", "3", "--profile-steps", "2:3", "--overlap-moe-expert-parallel-comm"]
MICROBATCHES, LAYERS = 4, 2  # gloo_workers.TINY's


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_spans")
    for comm_type in ("allgather", "p2p"):
        run_ranks(cp_losses, 2, 2, 2, FLAGS + ["--cp-comm-type", comm_type, "--profile-dir",
                                               str(root / comm_type)], timeout_s=400)
    return root


@pytest.mark.slow
def test_the_gathers_are_comm_lane_spans_named_by_microbatch_layer_and_phase(recorded):
    expected = {f"{kind}{m}.kv_gather.L{layer}" for kind in "FB" for m in range(MICROBATCHES)
                for layer in range(LAYERS)}
    ranks = read_span_directory(str(recorded / "allgather"))
    assert len(ranks) == 2
    for rank in ranks:
        assert [s.step for s in rank.steps] == [2, 3]
        for step in rank.steps:
            gathers = [s for s in step.spans if s.node == "kv_gather"]
            assert {s.action for s in gathers} == expected and len(gathers) == len(expected)
            assert all(s.lane == "comm" and s.end_us > s.start_us for s in gathers)
    for rank in read_span_directory(str(recorded / "p2p")):
        for step in rank.steps:
            assert {s.node for s in step.spans if s.lane == "comm"} <= {"dispatch", "combine",
                                                                         "grad_reduce"}
            assert sum(s.node == "attn" and s.lane == "compute" for s in step.spans) == \
                2 * MICROBATCHES * LAYERS


@pytest.mark.slow
def test_the_timeline_lists_the_gathers_and_puts_them_on_the_comm_track(recorded, tmp_path,
                                                                           capsys):
    from epoverlap.cli import timeline as tl
    out = tmp_path / "out"
    assert tl.main([str(recorded / "allgather"), "--out-dir", str(out)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    table = printed[printed.index("per comm node"):]
    for layer in range(LAYERS):
        for phase in ("forward", "backward"):
            assert any(line.split()[:4] == [str(layer), "kv_gather", phase, "4.0"]
                       for line in table.splitlines()), table
    summary = json.loads((out / tl.SUMMARY_FILE).read_text())["spans"]
    gathers = [n for n in summary["comm_nodes"] if n["node"] == "kv_gather"]
    assert len(gathers) == 2 * LAYERS
    assert all(0 < n["comm_us"] and 0 <= n["exposed_us"] <= n["comm_us"] for n in gathers)
    trace = json.loads((out / tl.TRACE_FILE).read_text())
    events = [e for e in trace["traceEvents"] if "kv_gather" in e.get("name", "")]
    assert events and all(e["tid"] == tl.LANE_TIDS["comm"] for e in events)
    assert (out / tl.PNG_FILE).is_file() or "PNG skipped" in captured.err


@pytest.mark.slow
def test_the_simulator_replays_a_cp_recording(recorded):
    """The recording's own layout (qkv, kv_gather, attn) and measured comm: each step within
    20% (as test_simulate's fresh gloo run; -3% measured on an idle 2-core machine)."""
    from epoverlap.cli import simulate as sim
    from gloo_workers import TINY
    scenario = sim.build_scenario(sim.parse_args(
        ["--spans", str(recorded / "allgather"), "--", *TINY, "--context-parallel-size", "2",
         "--cp-comm-type", "allgather"]))
    assert [kind.name for kind in scenario.layout[0]][:3] == ["qkv", "kv_gather", "attn"]
    assert any("K/V exchange, CP 2" in line for line in scenario.sources)
    rows = sim.replay_steps(scenario)
    assert [row["step"] for row in rows] == [2, 3] and rows[0]["mode"] == "ovl"
    measured = sum(row["measured_ms"] for row in rows)
    assert abs(sum(row["simulated_ms"] for row in rows) / measured - 1) < 0.20, rows
