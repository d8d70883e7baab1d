"""Compute apart from waiting (epoverlap/profiling/node_times.py, `epoverlap-timeline`'s node
table and `--compare`): hand-made span files of a sequential and an overlapped run whose answers
are worked out by hand below; the span format's version 2 (`queued_us`) against version 1; the
recorder's three marks on CPU lanes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from epoverlap.profiling.node_times import NodePhase, compare_runs, node_figures
from epoverlap.profiling.spans import (SPAN_FORMAT_VERSION, Span, SpanFileError, StepSpans,
                                       read_span_directory, write_rank_span_file)
from epoverlap.cli import timeline as tl


def span(lane, action, queued, start, end) -> Span:
    return Span.from_action(lane, action, start, end, queued_us=queued)


# A one-layer model, one microbatch. Sequential: nothing waits; layer 0's mlp forward takes 20
# us in step 1 and 24 in step 2 (mean 22).
def seq_step(mlp_end: float) -> list[Span]:
    return [span("compute", "F0.attn.L0", 0, 0, 10), span("comm", "F0.dispatch.L0", 10, 10, 10),
            span("compute", "F0.mlp.L0", 10, 10, mlp_end),
            span("compute", "B0.mlp.L0", mlp_end, mlp_end, mlp_end + 20),
            span("compute", "B0.attn.L0", mlp_end + 20, mlp_end + 20, mlp_end + 30),
            span("compute", "F0.loss", mlp_end + 30, mlp_end + 30, mlp_end + 34)]


# Overlapped, weight grads deferred (W0.mlp.L0): rank 0's attn forward takes 12 us, rank 1's 14;
# the mlp forward then waits for the dispatch until 20 (8 us on rank 0, 6 on rank 1) and takes
# 25; the attn backward waits 5.
def ovl_step(attn_end: float) -> list[Span]:
    return [span("compute", "F0.attn.L0", 0, 0, attn_end),
            span("comm", "F0.dispatch.L0", attn_end, attn_end, 20),
            span("compute", "F0.mlp.L0", attn_end, 20, 45),
            span("compute", "B0.mlp.L0", 45, 45, 60), span("compute", "W0.mlp.L0", 60, 60, 70),
            span("comm", "B0.dispatch.L0", 60, 60, 75),
            span("compute", "B0.attn.L0", 70, 75, 85), span("compute", "F0.loss", 85, 85, 90)]


def write_run(directory: Path, per_rank: list[list[list[Span]]]) -> Path:
    for rank, steps in enumerate(per_rank):
        records = [StepSpans(index + 1, 100.0, rows) for index, rows in enumerate(steps)]
        write_rank_span_file(directory, rank, len(per_rank), "cpu", "host", records)
    return directory


@pytest.fixture
def runs(tmp_path):
    seq = write_run(tmp_path / "seq", [[seq_step(30), seq_step(34)]])
    ovl = write_run(tmp_path / "ovl", [[ovl_step(12), ovl_step(12)], [ovl_step(14),
                                                                        ovl_step(14)]])
    return seq, ovl


# By hand: (row, seq compute, ovl compute, slowdown, seq wait, ovl wait), per step.
EXPECTED = [
    ("0 attn forward", 10, 13, 1.3, 0, 0),  # ovl: mean of 12 and 14
    ("0 mlp forward", 22, 25, 25 / 22, 0, 7),  # seq: mean of 20 and 24; ovl wait: of 8 and 6
    ("0 attn backward", 10, 10, 1.0, 0, 5),
    ("0 mlp backward", 20, 15, 0.75, 0, 0),
    ("0 mlp wgrad", None, 10, None, None, 0),
    ("- loss forward", 4, 5, 1.25, 0, 0),
    ("L0 all", 62, 73, 73 / 62, 0, 12),  # seq 10+22+10+20; ovl 13+25+10+15+10
    ("- all", 4, 5, 1.25, 0, 0),
    ("all layers", 66, 78, 78 / 66, 0, 12),
]


def test_compare_known_answers(runs):
    rows = compare_runs(*(node_figures(read_span_directory(d)) for d in runs))
    assert [r.label for r in rows] == [e[0] for e in EXPECTED]
    for row, (label, seq, ovl, slowdown, seq_wait, ovl_wait) in zip(rows, EXPECTED):
        got = (row.base_compute_us, row.other_compute_us, row.slowdown, row.base_wait_us,
               row.other_wait_us)
        assert got == pytest.approx((seq, ovl, slowdown, seq_wait, ovl_wait)), label


def test_node_figures_count_spans_and_skip_comm(runs):
    figures = node_figures(read_span_directory(runs[1]))
    kinds = [f.kind.label() for f in figures]
    assert "0 dispatch forward" not in kinds and "0 dispatch backward" not in kinds
    mlp = next(f for f in figures if f.kind.label() == "0 mlp forward")
    assert (mlp.spans, mlp.compute_us, mlp.wait_us) == (1, 25, 7)


def test_cli_compare_prints_and_writes_the_table(runs, tmp_path, capsys):
    code = tl.main(["--compare", str(runs[0]), str(runs[1]), "--out-dir", str(tmp_path / "o")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "compute slowdown under overlap" in out
    lines = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert lines["L0 all"][-4:] == ["73.0", "1.177", "0.0", "12.0"]
    assert lines["0 mlp wgrad"][-5:] == ["-", "10.0", "-", "-", "0.0"]
    document = json.loads((tmp_path / "o" / tl.COMPARE_FILE).read_text())
    assert document["steps"] == [[1, 2], [1, 2]]
    total = next(r for r in document["rows"] if r["row"] == "all layers")
    assert total["slowdown"] == pytest.approx(78 / 66)


def test_cli_compare_refuses_other_inputs(runs, capsys):
    assert tl.main(["--compare", str(runs[0]), str(runs[1]), str(runs[0])]) == 2
    assert "--compare SEQ_DIR OVL_DIR takes no other DIR" in capsys.readouterr().err
    assert tl.main(["--compare", str(runs[0]), "/no/such/dir"]) == 2
    assert "/no/such/dir: not a directory" in capsys.readouterr().err


def test_single_run_table_has_the_wait_beside_the_compute(runs, capsys):
    code = tl.main([str(runs[1]), "--no-png"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads((runs[1] / tl.SUMMARY_FILE).read_text())["spans"]
    # rank 0: 8 (mlp forward) + 5 (attn backward); rank 1: 6 + 5; all of it compute-lane idle
    assert [r["compute_wait_us"] for r in summary["steps"][0]["ranks"]] == [13, 11]
    assert all(r["compute_wait_us"] <= r["bubble_us"] for r in summary["steps"][0]["ranks"])
    layer0 = summary["mean_over_steps"][0]["layers"][0]
    assert (layer0["layer"], layer0["compute_wait_us"]) == (0, 13)
    nodes = {(n["layer"], n["node"], n["phase"]): n for n in summary["compute_nodes"]}
    assert (nodes[(0, "mlp", "forward")]["compute_us"], nodes[(0, "mlp", "forward")]["wait_us"]) \
        == (25, 7)
    assert "per compute node" in out and "compute_wait" in out


def test_version_1_files_read_with_unknown_waits(runs, tmp_path, capsys):
    old = tmp_path / "v1"
    old.mkdir()
    for path in runs[0].glob("spans-rank*.json"):
        document = json.loads(path.read_text())
        document["version"] = 1
        for step in document["steps"]:
            for item in step["spans"]:
                del item["queued_us"]
        (old / path.name).write_text(json.dumps(document))
    rows = compare_runs(node_figures(read_span_directory(old)),
                        node_figures(read_span_directory(runs[1])))
    total = rows[-1]
    assert (total.base_compute_us, total.base_wait_us, total.other_wait_us) == (66, None, 12)
    assert tl.main([str(old), "--no-png"]) == 0
    summary = json.loads((old / tl.SUMMARY_FILE).read_text())["spans"]
    assert summary["steps"][0]["ranks"][0]["compute_wait_us"] is None


def test_versions_2_on_require_the_queued_mark_and_order_it(runs):
    path = next(runs[0].glob("spans-rank*.json"))
    document = json.loads(path.read_text())
    assert document["version"] == SPAN_FORMAT_VERSION >= 2
    del document["steps"][0]["spans"][0]["queued_us"]
    path.write_text(json.dumps(document))
    with pytest.raises(SpanFileError, match="missing field.s. queued_us"):
        read_span_directory(runs[0])
    document["steps"][0]["spans"][0]["queued_us"] = 5.0  # after its start (0)
    path.write_text(json.dumps(document))
    with pytest.raises(SpanFileError, match="queued_us 5.0 > start_us 0.0"):
        read_span_directory(runs[0])


def test_chrome_trace_keeps_the_waits(runs, tmp_path, capsys):
    assert tl.main([str(runs[1]), "--no-png", "--out-dir", str(tmp_path / "t")]) == 0
    back = tl.read_chrome_trace(tmp_path / "t" / tl.TRACE_FILE)
    original = read_span_directory(runs[1])
    for got, want in zip(back, original):
        assert [s.wait_us for s in got.steps[0].spans] == pytest.approx(
            [s.wait_us for s in sorted(want.steps[0].spans, key=lambda s: s.start_us)])


def test_node_phase_orders_layers_then_phases():
    kinds = sorted([NodePhase.of(s) for s in ovl_step(12) if s.lane == "compute"],
                   key=NodePhase.sort_key)
    assert [k.label() for k in kinds] == ["0 attn forward", "0 mlp forward", "0 attn backward",
                                          "0 mlp backward", "0 mlp wgrad", "- loss forward"]


def test_recorder_times_the_wait_apart_on_cpu_lanes():
    """ThreadLanes: a compute node of microbatch 0 waits for mb 0's comm node (held 50 ms by
    an event); its span's queued mark falls before that wait and its start after."""
    import torch
    from epoverlap.model.nodes import COMM, COMPUTE
    from epoverlap.profiling.recorder import SpanRecorder
    from epoverlap.schedule.executor import ThreadLanes
    from epoverlap.schedule.plan import Action

    recorder, lanes, release = SpanRecorder(torch.device("cpu"), 0, 1), ThreadLanes(), \
        threading.Event()
    recorder.begin_step(1)

    def node(action, lane, body):
        def task(wait):
            with recorder.span(action, lane, wait):
                body()
        return task
    try:
        lanes.submit(COMM, 0, node(Action.parse("F0.dispatch.L0"), COMM,
                                   lambda: release.wait(5)), chain=True)
        threading.Timer(0.05, release.set).start()
        lanes.submit(COMPUTE, 0, node(Action.parse("F0.mlp.L0"), COMPUTE,
                                      lambda: time.sleep(0.01)), chain=True)
        lanes.drain()
    finally:
        lanes.close()
    step = recorder.end_step()
    mlp = next(s for s in step.spans if s.node == "mlp")
    dispatch = next(s for s in step.spans if s.node == "dispatch")
    assert mlp.wait_us >= 30e3  # waited for the comm node (50 ms, generous margin)
    assert mlp.start_us >= dispatch.end_us  # ran after it
    assert 5e3 <= mlp.duration_us < 1e6  # its own 10 ms, not the wait
    assert dispatch.wait_us < 30e3  # nothing to wait for on the comm thread


def test_comm_nodes_are_listed_by_name_with_their_exposed_part(tmp_path, capsys):
    """Context parallelism's K/V gather beside the all-to-alls, by hand: compute runs 0-10 and
    20-30; F0.kv_gather.L0 runs 5-25 (exposed 10-20: 10 us of 20), F0.dispatch.L0 30-40 (all
    of it exposed), B0.kv_gather.L0 22-28 (hidden); rank 1 the same with the gather 5-15 (5
    exposed). Means over the two ranks: gather forward 15 us, exposed 7.5."""
    def step(gather_end):
        return [span("compute", "F0.qkv.L0", 0, 0, 10),
                span("comm", "F0.kv_gather.L0", 5, 5, gather_end),
                span("compute", "F0.attn.L0", 20, 20, 30),
                span("comm", "F0.dispatch.L0", 30, 30, 40),
                span("comm", "B0.kv_gather.L0", 22, 22, 28)]
    run = write_run(tmp_path / "cp", [[step(25)], [step(15)]])
    assert tl.main([str(run), "--out-dir", str(tmp_path / "out"), "--no-png"]) == 0
    summary = json.loads((tmp_path / "out" / tl.SUMMARY_FILE).read_text())
    rows = {(n["node"], n["phase"]): n for n in summary["spans"]["comm_nodes"]}
    assert sorted(rows) == [("dispatch", "forward"), ("kv_gather", "backward"),
                            ("kv_gather", "forward")]
    assert (rows[("kv_gather", "forward")]["comm_us"],
            rows[("kv_gather", "forward")]["exposed_us"]) == (15.0, 7.5)
    assert (rows[("kv_gather", "backward")]["comm_us"],
            rows[("kv_gather", "backward")]["exposed_us"]) == (6.0, 0.0)
    assert (rows[("dispatch", "forward")]["comm_us"],
            rows[("dispatch", "forward")]["exposed_us"]) == (10.0, 10.0)
    printed = capsys.readouterr().out
    assert "per comm node" in printed
    assert any(line.split() == ["0", "kv_gather", "forward", "1.0", "15.0", "7.5"]
               for line in printed.splitlines()), printed
