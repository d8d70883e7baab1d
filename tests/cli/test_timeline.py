"""Timeline tool (epoverlap/cli/timeline.py): interval math, every metric on hand-made span files with
known answers, the Chrome trace and PNG outputs, the CLI's bad-input handling, and the
torch.profiler trace path on a hand-made trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from epoverlap.profiling.spans import Span, StepSpans, span_file_name, write_rank_span_file
from epoverlap.cli import timeline as tl

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def spans(*rows) -> list[Span]:
    """rows of (lane, action, start, end)."""
    return [Span.from_action(lane, action, start, end) for lane, action, start, end in rows]


def write_world(directory: Path, per_rank: list[dict[int, tuple[float, list[Span]]]]) -> Path:
    """per_rank[r] = {step: (step_time_us, spans)}."""
    for rank, steps in enumerate(per_rank):
        records = [StepSpans(step, time, rows) for step, (time, rows) in sorted(steps.items())]
        write_rank_span_file(directory, rank, len(per_rank), "cpu", "host", records)
    return directory


def run_tool(capsys, *argv) -> tuple[int, str, str]:
    code = tl.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def summary_of(out_dir: Path) -> dict:
    return json.loads((out_dir / tl.SUMMARY_FILE).read_text())


def rank_row(summary: dict, step_index: int, rank: int) -> dict:
    return summary["spans"]["steps"][step_index]["ranks"][rank]


def assert_figures(row: dict, **expected: float) -> None:
    for key, value in expected.items():
        assert row[key] == pytest.approx(value), key


# ---------------------------------------------------------------------------------------------
# Interval math


def test_union():
    assert tl.union([]) == []
    assert tl.union([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert tl.union([(0, 1), (1, 2)]) == [(0, 2)]  # touching merges
    assert tl.union([(0, 4), (1, 2)]) == [(0, 4)]  # contained
    assert tl.union([(3, 3), (4, 2)]) == []  # zero / negative length vanish


def test_intersect():
    assert tl.intersect([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert tl.intersect([(0, 1)], [(1, 2)]) == []  # touching shares no length
    assert tl.intersect([(0, 5), (6, 9)], [(4, 7)]) == [(4, 5), (6, 7)]
    assert tl.intersect([], [(0, 1)]) == []


def test_subtract():
    assert tl.subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert tl.subtract([(0, 10)], [(-1, 11)]) == []
    assert tl.subtract([(0, 10)], [(0, 4)]) == [(4, 10)]
    assert tl.subtract([(0, 10)], [(8, 12)]) == [(0, 8)]
    assert tl.subtract([(0, 2), (4, 6)], [(1, 5)]) == [(0, 1), (5, 6)]
    assert tl.subtract([(0, 2)], []) == [(0, 2)]
    assert tl.subtract([(0, 2)], [(2, 3)]) == [(0, 2)]


def test_measure_and_gaps():
    assert tl.measure([(0, 2), (1, 3), (10, 11)]) == 4
    assert tl.measure([]) == 0
    assert tl.gaps([(1, 2), (4, 5)], 0, 6) == [(0, 1), (2, 4), (5, 6)]
    assert tl.gaps([(0, 6)], 0, 6) == []


def test_comm_overlap_no_comm_is_ratio_one():
    figures = tl.comm_overlap([(0, 5)], [])
    assert figures == tl.CommOverlap(5.0, 0.0, 0.0, 0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# Metrics on span files with known answers

CASES = {
    # name: (step_time, spans, expected figures)
    "fully_hidden": (100.0, spans(("compute", "F0.attn.L0", 0, 100), ("comm", "B1.dispatch.L0", 10, 40)),
                     dict(compute_busy_us=100, comm_us=30, exposed_comm_us=0, hidden_comm_us=30,
                          overlap_ratio=1.0, idle_us=0, idle_gaps=0)),
    "fully_exposed": (100.0, spans(("compute", "F0.attn.L0", 0, 40), ("comm", "F0.dispatch.L0", 50, 80)),
                      dict(compute_busy_us=40, comm_us=30, exposed_comm_us=30, hidden_comm_us=0,
                           overlap_ratio=0.0, idle_us=30, idle_gaps=2)),
    "partial": (60.0, spans(("compute", "F0.attn.L0", 0, 50), ("comm", "B1.combine.L0", 40, 60)),
                dict(compute_busy_us=50, comm_us=20, exposed_comm_us=10, hidden_comm_us=10,
                     overlap_ratio=0.5, idle_us=0, idle_gaps=0)),
    "idle_gaps": (70.0, spans(("compute", "F0.attn.L0", 10, 20), ("compute", "F0.mlp.L0", 30, 40),
                              ("comm", "F0.combine.L0", 50, 55)),
                  dict(compute_busy_us=20, comm_us=5, exposed_comm_us=5, overlap_ratio=0.0,
                       idle_us=45, idle_gaps=4, step_time_us=70)),
    "overlapping_comm": (50.0, spans(("comm", "F0.dispatch.L0", 0, 30), ("comm", "B1.dispatch.L1", 20, 40),
                                     ("compute", "F0.attn.L0", 25, 50)),
                         dict(compute_busy_us=25, comm_us=40, exposed_comm_us=25, hidden_comm_us=15,
                              overlap_ratio=15 / 40, idle_us=0, idle_gaps=0)),
    "no_comm": (10.0, spans(("compute", "F0.embed", 0, 10)),
                dict(comm_us=0, exposed_comm_us=0, overlap_ratio=1.0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_step_metrics_known_answers(tmp_path, capsys, name):
    step_time, rows, expected = CASES[name]
    directory = write_world(tmp_path / "spans", [{0: (step_time, rows)}])
    code, out, err = run_tool(capsys, directory, "--no-png")
    assert code == 0, err
    assert_figures(rank_row(summary_of(directory), 0, 0), **expected)
    assert f"read {directory}" in out and "per rank" in out and "per layer" in out


def test_multi_rank(tmp_path, capsys):
    hidden = spans(("compute", "F0.attn.L0", 0, 100), ("comm", "B1.dispatch.L0", 10, 40))
    exposed = spans(("compute", "F0.attn.L0", 0, 40), ("comm", "B1.dispatch.L0", 50, 80))
    directory = write_world(tmp_path, [{0: (100.0, hidden)}, {0: (100.0, exposed)},
                                       {0: (100.0, hidden)}])
    code, _, err = run_tool(capsys, directory, "--no-png")
    assert code == 0, err
    summary = summary_of(directory)
    assert [r["rank"] for r in summary["spans"]["steps"][0]["ranks"]] == [0, 1, 2]
    assert_figures(rank_row(summary, 0, 0), exposed_comm_us=0, overlap_ratio=1.0)
    assert_figures(rank_row(summary, 0, 1), exposed_comm_us=30, overlap_ratio=0.0, idle_gaps=2)
    assert summary["spans"]["world_size"] == 3 and "mean_over_steps" not in summary["spans"]


def test_pipeline_stages_get_their_bubbles_marked_and_their_layers_labelled(tmp_path, capsys):
    """Two stages of a pipeline: stage 1 waits for stage 0's activation (its receive on the
    comm lane) before it computes; the idle compute time is its bubble."""
    stage0 = spans(("compute", "F0.embed", 0, 5), ("compute", "F0.attn.L0", 5, 20),
                   ("comm", "F0.send.L0", 20, 25), ("compute", "B0.attn.L0", 60, 80))
    stage1 = spans(("comm", "F0.recv.L1", 0, 25), ("compute", "F0.attn.L1", 25, 40),
                   ("compute", "F0.loss", 40, 45), ("compute", "B0.attn.L1", 45, 55),
                   ("comm", "B0.recv.L1", 55, 60))
    directory = write_world(tmp_path / "spans", [{1: (80.0, stage0)}, {1: (80.0, stage1)}])
    out_dir = tmp_path / "out"
    code, out, err = run_tool(capsys, directory, "--out-dir", out_dir)
    assert code == 0, err
    summary = summary_of(out_dir)
    assert_figures(rank_row(summary, 0, 0), bubble_us=40, bubble_fraction=0.5)
    assert_figures(rank_row(summary, 0, 1), bubble_us=50, bubble_fraction=50 / 80)
    assert "bubble" in out.splitlines()[3]  # the per-rank table's header
    trace = json.loads((out_dir / tl.TRACE_FILE).read_text())["traceEvents"]
    bubbles = [(e["pid"], e["ts"], e["dur"]) for e in trace if e.get("cat") == "bubble"]
    assert bubbles == [(0, 20.0, 40.0), (1, 0.0, 25.0), (1, 55.0, 25.0)]
    assert all(e["tid"] == tl.BUBBLE_TID for e in trace if e.get("cat") == "bubble")
    labels = {e["pid"]: e["args"]["labels"] for e in trace if e["name"] == "process_labels"}
    assert labels == {0: "L0", 1: "L1"}
    assert (out_dir / tl.PNG_FILE).read_bytes()[:8] == PNG_MAGIC


def test_per_layer_exposure_counts_other_layers_compute(tmp_path, capsys):
    rows = spans(
        ("compute", "F0.embed", 0, 5),
        ("compute", "F0.attn.L0", 5, 20),
        ("comm", "F0.dispatch.L0", 20, 40),   # hidden by layer 1's backward mlp until 35
        ("compute", "B1.mlp.L1", 20, 35),
        ("comm", "B1.combine.L1", 35, 45),    # hidden by nothing
        ("compute", "F0.mlp.L0", 45, 60),
    )
    directory = write_world(tmp_path, [{0: (60.0, rows)}])
    code, out, err = run_tool(capsys, directory, "--no-png")
    assert code == 0, err
    row = rank_row(summary_of(directory), 0, 0)
    layers = {entry["layer"]: entry for entry in row["layers"]}
    assert list(layers) == [0, 1, None]
    assert_figures(layers[0], compute_busy_us=30, comm_us=20, exposed_comm_us=5,
                   hidden_comm_us=15, overlap_ratio=0.75)
    assert_figures(layers[1], compute_busy_us=15, comm_us=10, exposed_comm_us=10,
                   hidden_comm_us=0, overlap_ratio=0.0)
    assert_figures(layers[None], compute_busy_us=5, comm_us=0, overlap_ratio=1.0)
    # the rank's comm is a union: layer figures need not add up where comm overlaps comm
    assert_figures(row, comm_us=25, exposed_comm_us=10, hidden_comm_us=15, compute_busy_us=50)


def test_multiple_steps_and_mean_row(tmp_path, capsys):
    step0 = (40.0, spans(("compute", "F0.attn.L0", 0, 20), ("comm", "F0.dispatch.L0", 10, 30)))
    step1 = (40.0, spans(("compute", "F0.attn.L0", 0, 40), ("comm", "F0.dispatch.L0", 0, 40)))
    directory = write_world(tmp_path, [{0: step0, 1: step1}, {0: step0, 1: step1}])
    code, out, err = run_tool(capsys, directory, "--no-png")
    assert code == 0, err
    summary = summary_of(directory)["spans"]
    assert [s["step"] for s in summary["steps"]] == [0, 1]
    assert_figures(summary["steps"][0]["ranks"][0], exposed_comm_us=10, overlap_ratio=0.5,
                   idle_us=10, idle_gaps=1)
    assert_figures(summary["steps"][1]["ranks"][0], exposed_comm_us=0, overlap_ratio=1.0)
    mean = summary["mean_over_steps"][0]
    # overlap ratio of the mean row is sum(hidden) / sum(comm) = 50 / 60, not mean(0.5, 1.0)
    assert_figures(mean, comm_us=30, exposed_comm_us=5, hidden_comm_us=25, overlap_ratio=50 / 60,
                   idle_us=5, idle_gaps=0.5, step_time_us=40)
    assert mean["rank"] == 0 and mean["layers"][0]["layer"] == 0
    assert_figures(mean["layers"][0], comm_us=30, exposed_comm_us=5, overlap_ratio=50 / 60)
    assert "mean" in out and "steps 0..1" in out


def test_step_option_selects_one_step(tmp_path, capsys):
    step0 = (40.0, spans(("compute", "F0.attn.L0", 0, 20), ("comm", "F0.dispatch.L0", 10, 30)))
    step1 = (50.0, spans(("compute", "F0.attn.L0", 0, 50)))
    directory = write_world(tmp_path, [{0: step0, 1: step1}])
    code, out, _ = run_tool(capsys, directory, "--no-png", "--step", 1)
    assert code == 0
    summary = summary_of(directory)["spans"]
    assert [s["step"] for s in summary["steps"]] == [1] and "mean_over_steps" not in summary
    assert "step 1" in out
    code, _, err = run_tool(capsys, directory, "--no-png", "--step", 7)
    assert code == 2 and "no step 7" in err


# ---------------------------------------------------------------------------------------------
# Outputs: Chrome trace, PNG


def _two_rank_two_step_dir(tmp_path: Path) -> Path:
    rows = spans(("compute", "F0.attn.L0", 0, 10), ("comm", "F0.dispatch.L0", 10, 20),
                 ("compute", "B1.mlp.L1", 12, 18), ("comm", "B1.dispatch.L1", 20, 25),
                 ("compute", "W1.mlp.L1", 20, 30), ("compute", "F2.loss", 30, 31))
    return write_world(tmp_path / "spans", [{0: (40.0, rows), 1: (40.0, rows)},
                                            {0: (35.0, rows), 1: (35.0, rows)}])


def test_chrome_trace_is_valid(tmp_path, capsys):
    directory = _two_rank_two_step_dir(tmp_path)
    out_dir = tmp_path / "out"
    code, _, err = run_tool(capsys, directory, "--no-png", "--out-dir", out_dir)
    assert code == 0, err
    with open(out_dir / tl.TRACE_FILE) as handle:
        trace = json.load(handle)
    events = trace["traceEvents"]
    assert all({"name", "ph", "pid", "tid"} <= event.keys() for event in events)
    complete = [e for e in events if e["ph"] == "X" and e["cat"] not in ("step", "bubble")]
    assert len(complete) == 2 * 2 * 6
    assert {e["pid"] for e in complete} == {0, 1}
    for event in complete:
        assert {"ts", "dur", "cname", "args"} <= event.keys() and event["dur"] >= 0
        assert event["tid"] == tl.LANE_TIDS[event["args"]["lane"]]
        assert event["cname"] == tl.TRACE_PALETTE[event["args"]["microbatch"] % len(tl.TRACE_PALETTE)]
        assert {"microbatch", "layer", "phase", "step"} <= event["args"].keys()
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(0, 0, "compute"), (0, 1, "comm"), (1, 0, "compute"), (1, 1, "comm")} <= threads
    # steps laid end to end per rank: rank 1's step 1 starts at its step 0's time (35 us)
    rank1_step1 = [e for e in complete if e["pid"] == 1 and e["args"]["step"] == 1]
    assert min(e["ts"] for e in rank1_step1) == 35.0
    assert not (directory / tl.PNG_FILE).exists() and not (out_dir / tl.PNG_FILE).exists()


def test_chrome_trace_reads_back_into_the_same_spans(tmp_path, capsys):
    """read_chrome_trace (the simulator's --trace input) inverts chrome_trace."""
    from epoverlap.profiling.spans import read_span_directory
    directory = _two_rank_two_step_dir(tmp_path)
    run_tool(capsys, directory, "--no-png", "--out-dir", tmp_path / "out")
    back = tl.read_chrome_trace(tmp_path / "out" / tl.TRACE_FILE)
    original = read_span_directory(directory)
    assert [r.rank for r in back] == [0, 1] and back[0].world_size == 2
    for got, want in zip(back, original):
        assert [s.step for s in got.steps] == [s.step for s in want.steps]
        for got_step, want_step in zip(got.steps, want.steps):
            assert got_step.step_time_us == want_step.step_time_us
            assert sorted(got_step.spans, key=str) == sorted(want_step.spans, key=str)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(tl.InputError, match="no traceEvents"):
        tl.read_chrome_trace(tmp_path / "bad.json")


def test_png_is_written(tmp_path, capsys):
    directory = _two_rank_two_step_dir(tmp_path)
    code, out, err = run_tool(capsys, directory)
    assert code == 0, err
    data = (directory / tl.PNG_FILE).read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert "timeline.png (step 1)" in out  # the last step by default


# ---------------------------------------------------------------------------------------------
# CLI bad input: exit 2, one line naming the problem, no traceback


def _assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    for needle in needles:
        assert needle in err


def test_cli_empty_directory(tmp_path, capsys):
    code, _, err = run_tool(capsys, tmp_path)
    _assert_one_line_error(code, err, str(tmp_path), "no span files")


def test_cli_truncated_file(tmp_path, capsys):
    directory = _two_rank_two_step_dir(tmp_path)
    bad = directory / span_file_name(1)
    bad.write_text(bad.read_text()[:-10])
    code, _, err = run_tool(capsys, directory)
    _assert_one_line_error(code, err, str(bad), "not valid JSON")


def test_cli_missing_rank(tmp_path, capsys):
    directory = _two_rank_two_step_dir(tmp_path)
    (directory / span_file_name(0)).unlink()
    code, _, err = run_tool(capsys, directory)
    _assert_one_line_error(code, err, "rank(s) 0 is missing")


def test_cli_needs_an_input(capsys):
    code, _, err = run_tool(capsys)
    _assert_one_line_error(code, err, "give a span directory")


@pytest.mark.parametrize("how", [["-m", "epoverlap.cli.timeline"]])
def test_runs_as_module(tmp_path, how):
    directory = _two_rank_two_step_dir(tmp_path)
    done = subprocess.run([sys.executable, *how, str(directory), "--no-png"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "per rank" in done.stdout
    done = subprocess.run([sys.executable, *how, str(tmp_path / "nothing")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not a directory" in done.stderr


# ---------------------------------------------------------------------------------------------
# torch.profiler Chrome traces

BASE_TS = 5_816_027_634_193.372  # profiler timestamps are large; the tool shifts them


def kernel(name: str, start: float, dur: float, stream: int | None = 7) -> dict:
    args = {"device": 0, "context": 1}
    if stream is not None:
        args["stream"] = stream
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream or 99,
            "ts": BASE_TS + start, "dur": dur, "args": args}


def torch_events() -> list[dict]:
    return [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": BASE_TS,
         "dur": 500},
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 100),
        kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 50, 130, stream=20),
        kernel("void at::native::vectorized_elementwise_kernel<4>", 150, 50),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "pid": 0, "tid": 7,
         "ts": BASE_TS + 210, "dur": 40, "args": {"stream": 7}},
        kernel("NCCL_AllReduce_sum", 220, 10, stream=None),  # no args.stream: grouped by tid
        {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": BASE_TS, "cat": "ac2g", "name": "ac2g"},
    ]


def test_torch_trace_known_answers(tmp_path, capsys):
    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": torch_events(),
                                 "distributedInfo": {"rank": 3, "world_size": 4}}))
    code, out, err = run_tool(capsys, "--torch-trace", trace, "--out-dir", tmp_path / "out")
    assert code == 0, err
    [entry] = summary_of(tmp_path / "out")["torch_traces"]
    assert entry["rank"] == 3 and entry["file"] == str(trace)
    # compute [0,100] + [150,200] = 150; comm [50,180] + [220,230] = 140
    # hidden [50,100] + [150,180] = 80; exposed [100,150] + [220,230] = 60; idle [200,220]
    assert_figures(entry, window_us=230, compute_busy_us=150, comm_us=140, exposed_comm_us=60,
                   hidden_comm_us=80, overlap_ratio=80 / 140, idle_us=20, idle_gaps=1)
    streams = {s["stream"]: s for s in entry["streams"]}
    assert list(streams) == ["7", "20", "99"]
    assert streams["7"] == {"stream": "7", "kind": "compute", "busy_us": pytest.approx(150),
                            "kernels": 2, "nccl_kernels": 0}
    assert streams["20"]["kind"] == "comm" and streams["20"]["busy_us"] == pytest.approx(130)
    assert streams["99"]["kind"] == "comm" and streams["99"]["kernels"] == 1
    assert "torch traces" in out and "per stream" in out


def test_torch_trace_bare_list_and_directory(tmp_path, capsys):
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "a.json").write_text(json.dumps(torch_events()))
    (traces / "b.json").write_text(json.dumps({"traceEvents": torch_events()[:2]}))
    code, _, err = run_tool(capsys, "--torch-trace", traces, "--out-dir", tmp_path)
    assert code == 0, err
    entries = summary_of(tmp_path)["torch_traces"]
    assert [e["rank"] for e in entries] == [0, 1]  # no distributedInfo: file order
    assert_figures(entries[0], exposed_comm_us=60)
    assert_figures(entries[1], comm_us=0, compute_busy_us=100, overlap_ratio=1.0)


def test_torch_trace_with_span_directory(tmp_path, capsys):
    directory = _two_rank_two_step_dir(tmp_path)
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(torch_events()))
    code, _, err = run_tool(capsys, directory, "--no-png", "--torch-trace", trace)
    assert code == 0, err
    summary = summary_of(directory)
    assert "spans" in summary and len(summary["torch_traces"]) == 1


@pytest.mark.parametrize("content, needle", [
    ('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}',
     "no GPU kernel events"),
    ('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0}]}', "lacks numeric"),
    ('{"traceEvents": [', "not valid JSON"),
    ('{"events": []}', "expected {'traceEvents'"),
])
def test_torch_trace_bad_input(tmp_path, capsys, content, needle):
    trace = tmp_path / "bad.json"
    trace.write_text(content)
    code, _, err = run_tool(capsys, "--torch-trace", trace)
    _assert_one_line_error(code, err, str(trace), needle)
