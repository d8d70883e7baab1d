"""The whole step in span files (format 3): the recorder marks the parts after the
forward-backward (gradients' all-reduce on the comm lane, clip and optimizer on the compute
lane), the file keeps them, the summary counts them into the step's comm and compute, the trace
reads them back; version-2 files still read without them. One real training run records them."""

from __future__ import annotations

import json
import time

import pytest
import torch

from epoverlap.cli import timeline as tl
from epoverlap.cli.train import main as train_main
from epoverlap.profiling.recorder import SpanRecorder
from epoverlap.profiling.spans import (STEP_PARTS, Span, SpanFileError, StepPart, StepSpans,
                                       read_rank_span_file, read_span_directory,
                                       write_rank_span_file)
from epoverlap.profiling.summary import span_summary


def _recorded_step() -> StepSpans:
    recorder = SpanRecorder(torch.device("cpu"), rank=0, world_size=1)
    recorder.begin_step(4)
    with recorder.span("F0.attn.L0", "compute"):
        time.sleep(0.002)
    with recorder.span("F0.dispatch.L0", "comm"):
        time.sleep(0.002)
    recorder.end_forward_backward()
    for name in STEP_PARTS:
        with recorder.part(name):
            time.sleep(0.002)
    return recorder.end_step()


def test_the_recorder_marks_the_parts_after_the_forward_backward():
    step = _recorded_step()
    assert [p.name for p in step.parts] == list(STEP_PARTS)
    assert [p.lane for p in step.parts] == ["comm", "compute", "compute"]
    assert max(s.end_us for s in step.spans) <= step.step_time_us <= step.parts[0].start_us
    assert all(p.duration_us >= 1500 for p in step.parts)
    assert step.parts[-1].end_us <= step.whole_step_us
    assert step.whole_step_us - step.step_time_us >= 3 * 1500


def test_a_step_without_parts_has_no_whole_step():
    recorder = SpanRecorder(torch.device("cpu"), rank=0, world_size=1)
    recorder.begin_step(1)
    with recorder.span("F0.attn.L0", "compute"):
        pass
    step = recorder.end_step()
    assert step.whole_step_us is None and step.parts == []


def _step(parts=None, whole=40.0) -> StepSpans:
    spans = [Span.from_action("compute", "F0.attn.L0", 0.0, 10.0),
             Span.from_action("comm", "F0.dispatch.L0", 5.0, 20.0)]
    parts = [StepPart("grad_reduce", "comm", 20.0, 30.0),
             StepPart("grad_clip", "compute", 30.0, 32.0),
             StepPart("optimizer", "compute", 32.0, 38.0)] if parts is None else parts
    return StepSpans(3, 20.0, spans, whole, parts)


def test_the_file_keeps_the_parts_and_the_summary_counts_them(tmp_path):
    path = write_rank_span_file(tmp_path, 0, 1, "cpu", "host", [_step()])
    back = read_rank_span_file(path)
    assert back.steps[0] == _step()
    row = span_summary([back], [3])["steps"][0]["ranks"][0]
    assert row["whole_step_us"] == 40.0 and row["step_time_us"] == 20.0
    assert (row["grad_reduce_us"], row["grad_clip_us"], row["optimizer_us"]) == (10, 2, 6)
    assert row["comm_us"] == 15.0 and row["whole_comm_us"] == 25.0
    assert row["compute_busy_us"] == 10.0 and row["whole_compute_busy_us"] == 18.0


@pytest.mark.parametrize("mutate, needle", [
    (lambda s: s.update(step_parts=[dict(name="backward", lane="comm", start_us=1,
                                         end_us=2)]), "unknown part 'backward'"),
    (lambda s: s["step_parts"][0].update(lane="compute"), "lane 'compute', expected 'comm'"),
    (lambda s: s["step_parts"][2].update(end_us=41.0), "not inside the whole step"),
    (lambda s: s.update(whole_step_us=10.0), "whole_step_us 10.0 < step_time_us 20.0"),
    (lambda s: s.update(step_parts=None), "'step_parts' must be a list"),
])
def test_a_bad_part_names_the_file(tmp_path, mutate, needle):
    path = write_rank_span_file(tmp_path, 0, 1, "cpu", "host", [_step()])
    document = json.loads(path.read_text())
    mutate(document["steps"][0])
    path.write_text(json.dumps(document))
    with pytest.raises(SpanFileError, match="spans-rank00000.json.*" + needle.replace(
            "(", r"\(").replace(")", r"\)")):
        read_rank_span_file(path)


def test_a_version_2_file_reads_without_the_whole_step(tmp_path):
    path = write_rank_span_file(tmp_path, 0, 1, "cpu", "host", [_step()])
    document = json.loads(path.read_text())
    document["version"] = 2
    for step in document["steps"]:
        del step["whole_step_us"], step["step_parts"]
    path.write_text(json.dumps(document))
    step = read_rank_span_file(path).steps[0]
    assert step.whole_step_us is None and step.parts == []
    assert "whole_step_us" not in span_summary([read_rank_span_file(path)], [3])["steps"][0][
        "ranks"][0]


def test_a_training_run_records_its_whole_steps(tmp_path, capfd):
    spans = tmp_path / "spans"
    assert train_main(["--preset", "tiny", "--mock-data", "--train-iters", "3",
                       "--profile-steps", "2:3", "--profile-dir", str(spans)]) == 0
    (rank,) = read_span_directory(spans)
    for step in rank.steps:
        assert [p.name for p in step.parts] == list(STEP_PARTS)
        assert step.step_time_us <= step.parts[0].start_us
        assert step.parts[-1].end_us <= step.whole_step_us
    assert tl.main([str(spans), "--no-png", "--out-dir", str(tmp_path / "t")]) == 0
    assert "whole step" in capfd.readouterr().out
    back = tl.read_chrome_trace(tmp_path / "t" / tl.TRACE_FILE)[0]
    for got, want in zip(back.steps, rank.steps):
        assert got.whole_step_us == pytest.approx(want.whole_step_us)
        assert [(p.name, p.lane) for p in got.parts] == [(p.name, p.lane) for p in want.parts]
        assert [p.duration_us for p in got.parts] == pytest.approx(
            [p.duration_us for p in want.parts])
