"""benchmarks.harness.realized_share: T_seq, T_ovl, T_comp, T_comm and the share from three
hand-made span directories with known answers, in both windows; the slowest rank per step."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness import realized_share as rs
from epoverlap.profiling.spans import Span, StepPart, StepSpans, write_rank_span_file


def _run(directory, compute_ms, comm_ms, step_ms, reduce_ms, rank_extra_ms=(0.0, 0.0),
         hold_us=0.0):
    """Two ranks, two steps: one compute span at 0, one comm span after it, then the parts;
    rank r's step is `rank_extra_ms[r]` longer."""
    for rank, extra in enumerate(rank_extra_ms):
        steps = []
        for number in (4, 5):
            fb = (step_ms + extra) * 1e3
            spans = [Span.from_action("compute", "F0.attn.L0", 0.0, compute_ms * 1e3)]
            if comm_ms:
                spans.append(Span.from_action("comm", "F0.dispatch.L0", fb - comm_ms * 1e3, fb))
            parts = [StepPart("grad_reduce", "comm", fb, fb + reduce_ms * 1e3),
                     StepPart("optimizer", "compute", fb + reduce_ms * 1e3,
                              fb + reduce_ms * 1e3 + 1e3)]
            steps.append(StepSpans(number, fb, spans, fb + reduce_ms * 1e3 + 1e3, parts))
        write_rank_span_file(directory, rank, 2, "cpu", "host", steps,
                             local_copy_hold_us=hold_us)


def test_known_answers_in_both_windows(tmp_path, capsys):
    dirs = {name: tmp_path / name for name in ("seq", "ovl", "comp")}
    _run(dirs["seq"], compute_ms=30, comm_ms=100, step_ms=130, reduce_ms=40, rank_extra_ms=(0, 2))
    _run(dirs["ovl"], compute_ms=30, comm_ms=100, step_ms=104, reduce_ms=40)
    _run(dirs["comp"], compute_ms=30, comm_ms=0, step_ms=30, reduce_ms=40)
    out = tmp_path / "share.json"
    assert rs.main([f"--{n}={d}" for n, d in dirs.items()] + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    fb, whole = result["forward_backward"], result["whole_step"]
    # forward-backward: T_seq 132 (the slowest rank), T_ovl 104, T_comp 30, T_comm 100
    assert (fb["T_seq"], fb["T_ovl"], fb["T_comp"], fb["T_comm"]) == pytest.approx(
        (132, 104, 30, 100))
    assert fb["share"] == pytest.approx(28 / 32)
    # whole: + 40 reduce + 1 optimizer; comp less its reduce; comm + the reduce
    assert (whole["T_seq"], whole["T_ovl"], whole["T_comp"], whole["T_comm"]) == pytest.approx(
        (173, 145, 31, 140))
    assert whole["share"] == pytest.approx(28 / 33)
    assert len(whole["samples_ms"]["T_seq"]) == 2
    assert "| whole step | 173.0 | 145.0 | 31.0 | 140.0 | 0.85 |" in capsys.readouterr().out


def test_a_missing_directory_is_one_line(tmp_path, capsys):
    assert rs.main(["--seq", str(tmp_path / "no"), "--ovl", str(tmp_path),
                    "--comp", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_held_compute_run_is_refused_in_one_line(tmp_path, capsys):
    """A held local-copy run's step lasts its holds: it is not T_comp (module docstring)."""
    dirs = {name: tmp_path / name for name in ("seq", "ovl", "comp")}
    _run(dirs["seq"], compute_ms=30, comm_ms=100, step_ms=130, reduce_ms=40)
    _run(dirs["ovl"], compute_ms=30, comm_ms=100, step_ms=104, reduce_ms=40)
    _run(dirs["comp"], compute_ms=30, comm_ms=40, step_ms=70, reduce_ms=40, hold_us=4000.0)
    assert rs.main([f"--{n}={d}" for n, d in dirs.items()]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--local-copy-hold-us 4000" in err
