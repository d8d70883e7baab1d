"""Span file format (epoverlap/profiling/spans.py): round trip, action parsing, and every bad-input case
giving a SpanFileError whose message names the file (or directory) at fault."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from epoverlap.profiling.spans import (
    SPAN_FORMAT,
    SPAN_FORMAT_VERSION,
    RankSpans,
    Span,
    SpanFileError,
    StepSpans,
    parse_action,
    read_rank_span_file,
    read_span_directory,
    span_file_name,
    write_rank_span_file,
)


def _steps(step_numbers=(0, 1)) -> list[StepSpans]:
    spans = [
        Span.from_action("compute", "F0.embed", 0.0, 2.0),
        Span.from_action("compute", "F0.attn.L0", 2.0, 10.5),
        Span.from_action("comm", "F0.dispatch.L0", 10.5, 20.0),
        Span.from_action("compute", "B1.mlp.L3", 11.0, 19.0),
        Span.from_action("compute", "W1.mlp.L3", 19.0, 25.0),
        Span("comm", "grad_allreduce", 0, None, "grad_allreduce", "backward", 25.0, 30.0),
    ]
    return [StepSpans(step, 30.0 + step, list(spans)) for step in step_numbers]


def _write_world(directory: Path, world_size: int, ranks=None, steps_of=None) -> None:
    for rank in range(world_size) if ranks is None else ranks:
        steps = _steps() if steps_of is None else steps_of(rank)
        write_rank_span_file(directory, rank, world_size, f"cpu:{rank}", "host", steps)


def _document(path: Path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------


def test_span_file_name():
    assert span_file_name(3) == "spans-rank00003.json"
    assert span_file_name(12345) == "spans-rank12345.json"
    with pytest.raises(ValueError):
        span_file_name(-1)


@pytest.mark.parametrize(
    "action, expected",
    [
        ("F3.attn.L2", ("forward", 3, "attn", 2)),
        ("B2.dispatch.L5", ("backward", 2, "dispatch", 5)),
        ("W2.mlp.L5", ("wgrad", 2, "mlp", 5)),
        ("F0.embed", ("forward", 0, "embed", None)),
        ("B1.loss", ("backward", 1, "loss", None)),
        ("F12.pre_dispatch.L31", ("forward", 12, "pre_dispatch", 31)),
    ],
)
def test_parse_action(action, expected):
    assert parse_action(action) == expected


@pytest.mark.parametrize("action", ["X1.attn.L0", "F.attn", "F1", "F1.attn.2", "F1.attn.L", ""])
def test_parse_action_rejects(action):
    with pytest.raises(ValueError, match="not of the form"):
        parse_action(action)


def test_span_from_action():
    span = Span.from_action("comm", "B2.dispatch.L5", 1, 4)
    assert span == Span("comm", "B2.dispatch.L5", 2, 5, "dispatch", "backward", 1.0, 4.0)
    assert span.duration_us == 3.0


def test_round_trip(tmp_path):
    steps = _steps()
    path = write_rank_span_file(tmp_path / "spans", 2, 4, "cuda:2", "cuda_event", steps)
    assert path == tmp_path / "spans" / "spans-rank00002.json"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    document = _document(path)
    assert document["format"] == SPAN_FORMAT and document["version"] == SPAN_FORMAT_VERSION
    back = read_rank_span_file(path)
    assert back == RankSpans(2, 4, "cuda:2", "cuda_event", steps, str(path))


def test_write_overwrites_atomically(tmp_path):
    write_rank_span_file(tmp_path, 0, 1, "cpu", "host", _steps([0]))
    write_rank_span_file(tmp_path, 0, 1, "cpu", "host", _steps([5]))
    assert [step.step for step in read_rank_span_file(tmp_path / span_file_name(0)).steps] == [5]
    assert len(list(tmp_path.iterdir())) == 1


def test_read_directory_sorted_by_rank(tmp_path):
    _write_world(tmp_path, 3, ranks=[2, 0, 1])
    ranks = read_span_directory(tmp_path)
    assert [r.rank for r in ranks] == [0, 1, 2]
    assert all(r.world_size == 3 and [s.step for s in r.steps] == [0, 1] for r in ranks)


def test_writer_refuses_bad_span(tmp_path):
    steps = [StepSpans(0, 10.0, [Span.from_action("compute", "F0.attn.L0", 5.0, 4.0)])]
    with pytest.raises(SpanFileError, match=r"spans-rank00000\.json.*end_us 4\.0 < start_us 5\.0"):
        write_rank_span_file(tmp_path, 0, 1, "cpu", "host", steps)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
def test_files_before_version_4_read_a_waves_nodes_by_their_new_names(tmp_path):
    """Versions 1-3 named a wave's nodes `NAME_cK`; they read as version 4's `NAME_wK`, the
    other names as they were. A version-4 file keeps what it says."""
    spans = [Span.from_action("comm", "F0.dispatch_w1.L2", 0.0, 1.0),
             Span.from_action("compute", "W0.mlp_w0.L2", 1.0, 2.0),
             Span.from_action("compute", "F0.mlp.L1", 2.0, 3.0)]
    path = write_rank_span_file(tmp_path, 0, 1, "cpu", "host", [StepSpans(0, 5.0, spans)])
    document = _document(path)
    for raw in document["steps"][0]["spans"][:2]:
        raw["action"], raw["node"] = (raw[key].replace("_w", "_c") for key in ("action", "node"))
    for version, expected in ((3, spans), (4, None)):
        document["version"] = version
        path.write_text(json.dumps(document))
        back = read_rank_span_file(path).steps[0].spans
        if expected is not None:
            assert back == expected
        else:
            assert [s.node for s in back] == ["dispatch_c1", "mlp_c0", "mlp"]


# One bad file: mutate a valid document, expect the file named and the reason.


def _mutate_and_read(tmp_path: Path, mutate) -> str:
    path = write_rank_span_file(tmp_path, 0, 1, "cpu", "host", _steps())
    document = _document(path)
    mutate(document)
    path.write_text(json.dumps(document))
    with pytest.raises(SpanFileError) as info:
        read_rank_span_file(path)
    message = str(info.value)
    assert str(path) in message
    return message


def _set_span(key, value):
    def mutate(document):
        document["steps"][0]["spans"][1][key] = value

    return mutate


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: d.update(format="chrome-trace"), "not an epoverlap span file"),
        (lambda d: d.update(version=5), "unsupported span format version 5"),
        (lambda d: d.pop("version"), "unsupported span format version None"),
        (lambda d: d.update(clock="wall"), "unknown clock 'wall'"),
        (lambda d: d.update(rank=1), "rank 1 is not below world_size 1"),
        (lambda d: d.update(steps={}), "'steps' must be a list"),
        (lambda d: d["steps"].append(copy.deepcopy(d["steps"][0])), "step 0 appears more than once"),
        (lambda d: d["steps"][0].update(step_time_us=-1), "'step_time_us' must be a finite number"),
        (_set_span("lane", "network"), "unknown lane 'network'"),
        (_set_span("phase", "optimizer"), "unknown phase 'optimizer'"),
        (_set_span("end_us", 1.0), "end_us 1.0 < start_us 2.0"),
        (_set_span("end_us", 99.0), "after the step's end"),
        (_set_span("microbatch", 7), "microbatch=7 disagrees with the action name"),
        (_set_span("layer", "0"), "'layer' must be an int"),
        (lambda d: d["steps"][0]["spans"][1].pop("node"), "missing field(s) node"),
        (lambda d: d["steps"][0]["spans"].append([1, 2]), "expected an object, got list"),
    ],
)
def test_bad_file_names_the_file(tmp_path, mutate, reason):
    assert reason in _mutate_and_read(tmp_path, mutate)


def test_span_error_says_which_step_and_action(tmp_path):
    message = _mutate_and_read(tmp_path, _set_span("lane", "network"))
    assert "step 0 span 1 (F0.attn.L0)" in message


def test_truncated_file(tmp_path):
    path = write_rank_span_file(tmp_path, 0, 1, "cpu", "host", _steps())
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(SpanFileError, match="not valid JSON") as info:
        read_rank_span_file(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content, reason", [("", "span file is empty"), ("[1, 2]", "got list"),
                                             ("hello", "not valid JSON")])
def test_not_a_span_file(tmp_path, content, reason):
    path = tmp_path / span_file_name(0)
    path.write_text(content)
    with pytest.raises(SpanFileError, match=reason) as info:
        read_rank_span_file(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(SpanFileError, match="cannot read span file") as info:
        read_rank_span_file(tmp_path / "nope.json")
    assert "nope.json" in str(info.value)


# ---------------------------------------------------------------------------------------------
# A directory whose files do not fit together.


def _directory_error(directory: Path) -> str:
    with pytest.raises(SpanFileError) as info:
        read_span_directory(directory)
    return str(info.value)


def test_empty_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("not a span file")
    message = _directory_error(tmp_path)
    assert str(tmp_path) in message and "no span files" in message


def test_not_a_directory(tmp_path):
    assert "not a directory" in _directory_error(tmp_path / "missing")


def test_missing_rank(tmp_path):
    _write_world(tmp_path, 4, ranks=[0, 1, 3])
    message = _directory_error(tmp_path)
    assert str(tmp_path) in message
    assert "world_size is 4 but the span file of rank(s) 2 is missing" in message
    assert "spans-rank00002.json" in message


def test_duplicate_rank(tmp_path):
    _write_world(tmp_path, 2)
    shutil.copy(tmp_path / span_file_name(1), tmp_path / "spans-rank1.json")
    message = _directory_error(tmp_path)
    assert "duplicate rank 1" in message
    assert "spans-rank1.json" in message and "spans-rank00001.json" in message


def test_file_name_does_not_match_rank(tmp_path):
    _write_world(tmp_path, 2)
    (tmp_path / span_file_name(1)).rename(tmp_path / span_file_name(7))
    message = _directory_error(tmp_path)
    assert "spans-rank00007.json" in message and "does not match the rank" in message


def test_mixed_steps(tmp_path):
    _write_world(tmp_path, 3, steps_of=lambda rank: _steps([0, 1] if rank != 2 else [0]))
    message = _directory_error(tmp_path)
    assert message.startswith("mixed steps")
    assert "spans-rank00002.json (rank 2) has steps [0]" in message
    assert "spans-rank00000.json" in message


def test_world_sizes_disagree(tmp_path):
    _write_world(tmp_path, 2)
    write_rank_span_file(tmp_path, 1, 3, "cpu", "host", _steps())
    message = _directory_error(tmp_path)
    assert "spans-rank00001.json: world_size is 3" in message and "says 2" in message


def test_clocks_disagree(tmp_path):
    _write_world(tmp_path, 2)
    write_rank_span_file(tmp_path, 1, 2, "cuda:1", "cuda_event", _steps())
    assert "spans-rank00001.json: clock is 'cuda_event'" in _directory_error(tmp_path)


def test_one_bad_file_in_directory_is_named(tmp_path):
    _write_world(tmp_path, 2)
    bad = tmp_path / span_file_name(1)
    bad.write_text(bad.read_text()[:40])
    message = _directory_error(tmp_path)
    assert str(bad) in message and "not valid JSON" in message
