"""benchmarks.harness.moe_layer_time: a MoE layer's forward and backward wall, its lanes' busy
times and overlap bound from hand-made span directories with known answers (nodes in waves on
both lanes, a dense layer and the weight-grad phase left out, the slowest rank), then from a
recorded CPU run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.harness import moe_layer_time as mlt
from epoverlap.profiling.spans import Span, StepSpans, write_rank_span_file

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "sim_cpu_tiny"


def _spans(scale: float) -> list[Span]:
    """Layer 0 dense (attn, mlp), layer 1 MoE in 2 waves: forward 10..40 (x scale), backward
    50..90; a weight-grad span after it that does not count."""
    def at(lane, action, start, end):
        return Span.from_action(lane, action, start * scale, end * scale)
    return [at("compute", "F0.attn.L0", 0, 5), at("compute", "F0.mlp.L0", 5, 9),
            at("compute", "F0.attn.L1", 9, 10),
            at("comm", "F0.dispatch_w0.L1", 10, 20), at("comm", "F0.dispatch_w1.L1", 20, 28),
            at("compute", "F0.mlp_w0.L1", 20, 30), at("compute", "F0.mlp_w1.L1", 28, 34),
            at("comm", "F0.return_w0.L1", 30, 36), at("comm", "F0.combine.L1", 34, 40),
            at("comm", "B0.combine_w0.L1", 50, 60), at("compute", "B0.mlp_w0.L1", 60, 70),
            at("comm", "B0.dispatch_w1.L1", 70, 90), at("compute", "W0.mlp_w0.L1", 90, 99),
            at("compute", "B0.mlp.L0", 99, 100)]


def _write(directory, scales):
    for rank, scale in enumerate(scales):
        steps = [StepSpans(number, 100.0 * scale, _spans(scale)) for number in (3, 4)]
        write_rank_span_file(directory, rank, len(scales), "cpu", "host", steps)


def test_a_moe_layer_part_is_its_nodes_first_start_to_last_end_at_the_slowest_rank(tmp_path):
    _write(tmp_path / "a", [1000.0, 1100.0])  # times in us x scale: rank 1 is 10% slower
    figures = mlt.run_figures([mlt.read_span_directory(tmp_path / "a")])
    assert figures["parts"] == 2  # two steps x one microbatch x the one MoE layer
    assert figures["forward_ms"] == pytest.approx(30 * 1.1)
    assert figures["backward_ms"] == pytest.approx(40 * 1.1)
    assert figures["both_ms"] == pytest.approx(70 * 1.1)


def test_each_lanes_busy_time_and_the_overlap_bound_of_a_layer_part(tmp_path):
    _write(tmp_path / "a", [1000.0, 1100.0])
    figures = mlt.run_figures([mlt.read_span_directory(tmp_path / "a")])
    # forward: all-to-alls 10 + 8 + 6 + 6, experts 10 + 6; backward: 10 + 20 and 10 (the
    # weight-grad span is not the backward's)
    assert figures["comm_forward_ms"] == pytest.approx(30 * 1.1)
    assert figures["compute_forward_ms"] == pytest.approx(16 * 1.1)
    assert figures["comm_backward_ms"] == pytest.approx(30 * 1.1)
    assert figures["compute_backward_ms"] == pytest.approx(10 * 1.1)
    assert figures["bound_ms"] == pytest.approx((30 + 30) * 1.1)  # the larger lane per phase


def test_the_share_of_the_attainable_saving_is_against_the_first_runs_bound():
    first = {"both_ms": 70.0, "bound_ms": 60.0}
    assert mlt.attainable_share(first, {"both_ms": 65.0}) == pytest.approx(0.5)
    assert mlt.attainable_share(first, first) == 0.0
    assert mlt.attainable_share({"both_ms": 60.0, "bound_ms": 60.0}, {"both_ms": 50.0}) is None


def test_the_table_gives_each_run_against_the_first_and_the_json_its_samples(tmp_path, capsys):
    _write(tmp_path / "slow", [1000.0])
    _write(tmp_path / "fast", [500.0])
    out = tmp_path / "f.json"
    assert mlt.main([f"k1={tmp_path / 'slow'}", f"k4={tmp_path / 'fast'}", "--out",
                     str(out)]) == 0
    text = capsys.readouterr().out
    assert "| k1 | 30.00 | 40.00 | 70.00 | 60.00 | 26.00 | 60.00 | 2 | 1.000 | 0.00 |" in text
    assert "| k4 | 15.00 | 20.00 | 35.00 | 30.00 | 13.00 | 30.00 | 2 | 2.000 | 3.50 |" in text
    runs = json.loads(out.read_text())["runs"]
    assert runs["k4"]["samples_ms"]["both"] == [35.0, 35.0]
    assert runs["k1"]["directories"] == [str(tmp_path / "slow")]


def test_a_recorded_run_and_spans_without_a_moe_layer(tmp_path, capsys):
    figures = mlt.run_figures([mlt.read_span_directory(RECORDED / "seq")])
    # the tiny preset's MoE layers, 4 microbatches, the recorded steps 3..5
    assert figures["parts"] % 12 == 0 and figures["parts"] > 0
    assert 0 < figures["forward_ms"] < figures["both_ms"]
    steps = [StepSpans(1, 10.0, [Span.from_action("compute", "F0.mlp.L0", 0.0, 5.0)])]
    write_rank_span_file(tmp_path / "dense", 0, 1, "cpu", "host", steps)
    assert mlt.main([f"dense={tmp_path / 'dense'}"]) == 2
    assert "no MoE layer part" in capsys.readouterr().err


def test_a_name_given_twice_pools_its_runs(tmp_path, capsys):
    _write(tmp_path / "r1", [1000.0])
    _write(tmp_path / "r2", [3000.0])
    out = tmp_path / "f.json"
    assert mlt.main([f"k1={tmp_path / 'r1'}", f"k1={tmp_path / 'r2'}", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"]["k1"]
    assert run["runs"] == 2 and run["parts"] == 4
    assert run["both_ms"] == pytest.approx((70 + 210) / 2)  # the median of 70, 70, 210, 210
