"""Span records and the per-rank span file format (format "epoverlap-spans", version 4).

This module owns what a span is, how one rank's spans are written to disk, and how a directory
of span files is read back and checked. The executor records one Span per action it runs (on the
compute or the comm lane) and calls `write_rank_span_file` once per rank; the timeline tool
(epoverlap/profiling/summary.py and its neighbours) reads the files back with
`read_span_directory`. The file format is documented in
docs/span-format.md; any change to it bumps SPAN_FORMAT_VERSION. Version 2 added each span's
`queued_us` (when its lane reached it, before it waited on the other lane); version-1 files
still read, with `queued_us` None (the wait unknown). Version 3 added the step's end after the
forward-backward (`whole_step_us`) and its parts there (`step_parts`: the gradient reduction
over data-parallel replicas, the clip, the optimizer), so a step's comm counts the gradients'
all-reduce too; version-2 files read with neither. Version 4 renamed the nodes of an MoE layer
in waves (--moe-a2a-waves) from `NAME_cK` to `NAME_wK` (`dispatch_w0`, `mlp_w1`, ...); older
files read with their names in the new form (`_wave_names`), so every reader sees one name.

Times are microseconds (float) relative to the rank's step start; every span lies inside
[0, step_time_us] of its step. Every problem found while writing or reading raises
SpanFileError with a one-line message that names the file (or directory) at fault.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SPAN_FORMAT = "epoverlap-spans"
SPAN_FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
LANES = ("compute", "comm")
PHASES = ("forward", "backward", "wgrad")
CLOCKS = ("host", "cuda_event")
SPAN_FILE_GLOB = "spans-rank*.json"
# What a step does after its forward-backward, in order, and the lane each part is counted on
STEP_PARTS = {"grad_reduce": "comm", "grad_clip": "compute", "optimizer": "compute"}

_PHASE_OF_LETTER = {"F": "forward", "B": "backward", "W": "wgrad"}
_ACTION_RE = re.compile(r"^([FBW])(\d+)\.([A-Za-z_][A-Za-z0-9_]*)(?:\.L(\d+))?$")
_OLD_WAVE_RE = re.compile(r"_c(\d+)(?=\.L\d+$|$)")  # a wave's node before version 4: `mlp_c1`
_FILE_NAME_RE = re.compile(r"^spans-rank(\d+)\.json$")
_SPAN_KEYS = ("lane", "action", "microbatch", "layer", "node", "phase", "start_us", "end_us")


class SpanFileError(ValueError):
    """A span file or span directory that cannot be used; the message names the file."""


@dataclass(frozen=True, slots=True)
class Span:
    """One action on one lane, relative to the rank's step start: it ran in [start_us, end_us]
    and, before that, waited on the other lane from queued_us (None: not recorded)."""

    lane: str
    action: str
    microbatch: int
    layer: int | None
    node: str
    phase: str
    start_us: float
    end_us: float
    queued_us: float | None = None

    @classmethod
    def from_action(cls, lane: str, action: str, start_us: float, end_us: float,
                    queued_us: float | None = None) -> Span:
        """Build a span from an action string such as `F3.attn.L2` or `B1.loss`."""
        phase, microbatch, node, layer = parse_action(action)
        return cls(lane, action, microbatch, layer, node, phase, float(start_us), float(end_us),
                   None if queued_us is None else float(queued_us))

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us

    @property
    def wait_us(self) -> float | None:
        """Time the action waited on the other lane before it ran (None: not recorded)."""
        return None if self.queued_us is None else self.start_us - self.queued_us


@dataclass(frozen=True, slots=True)
class StepPart:
    """Work of the step after its forward-backward (`STEP_PARTS`: name -> lane), relative to
    the rank's step start."""

    name: str
    lane: str
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class StepSpans:
    """All spans of one training step on one rank; times relative to that rank's step start.
    `step_time_us` ends with the forward-backward (the plan the executor ran); `whole_step_us`
    (None: not recorded) with the optimizer, and `parts` are what ran in between."""

    step: int
    step_time_us: float
    spans: list[Span]
    whole_step_us: float | None = None
    parts: list[StepPart] = field(default_factory=list)


@dataclass
class RankSpans:
    """The contents of one rank's span file (`path` is where it was read from)."""

    rank: int
    world_size: int
    device: str
    clock: str
    steps: list[StepSpans]
    path: str
    # the run's --local-copy-hold-us: each all-to-all node held its comm lane that long after
    # a local copy (optional top-level key, absent: 0, no hold)
    local_copy_hold_us: float = 0.0


def parse_action(action: str) -> tuple[str, int, str, int | None]:
    """`F3.attn.L2` -> ("forward", 3, "attn", 2); `B1.loss` -> ("backward", 1, "loss", None).

    Raises ValueError for a string outside the grammar `[FBW]<mb>.<node>[.L<layer>]`.
    """
    match = _ACTION_RE.match(action)
    if match is None:
        raise ValueError(
            f"action {action!r} is not of the form [FBW]<microbatch>.<node>[.L<layer>], "
            "e.g. F3.attn.L2 or B1.loss"
        )
    letter, microbatch, node, layer = match.groups()
    return _PHASE_OF_LETTER[letter], int(microbatch), node, None if layer is None else int(layer)


def span_file_name(rank: int) -> str:
    """The file name of a rank's span file: rank 3 -> `spans-rank00003.json`."""
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    return f"spans-rank{rank:05d}.json"


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def write_rank_span_file(
    directory: str | os.PathLike,
    rank: int,
    world_size: int,
    device: str,
    clock: str,
    steps: list[StepSpans],
    local_copy_hold_us: float = 0.0,
) -> Path:
    """Validate and write one rank's spans to `directory/spans-rankNNNNN.json`, atomically.

    The file is written to a hidden temp file in the same directory and renamed over the target,
    so a reader never sees a half-written file. Creates `directory` if needed. Returns the path.
    Raises SpanFileError (naming the target file) if the data would not read back.
    """
    path = Path(directory) / span_file_name(rank)
    document = {
        "format": SPAN_FORMAT,
        "version": SPAN_FORMAT_VERSION,
        "rank": rank,
        "world_size": world_size,
        "device": device,
        "clock": clock,
        "time_unit": "us",
        "steps": [_step_to_json(step) for step in steps],
    }
    if local_copy_hold_us:
        document["local_copy_hold_us"] = local_copy_hold_us
    _parse_document(document, str(path))  # the writer refuses what the reader would refuse
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False, encoding="utf-8"
    )
    try:
        with handle:
            json.dump(document, handle, separators=(",", ":"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return path


def _step_to_json(step: StepSpans) -> dict[str, Any]:
    return {
        "step": step.step,
        "step_time_us": step.step_time_us,
        "spans": [asdict(span) for span in step.spans],
        "whole_step_us": step.whole_step_us,
        "step_parts": [asdict(part) for part in step.parts],
    }


# ----------------------------------------------------------------------------------------------
# Reading one file
# ----------------------------------------------------------------------------------------------


def read_rank_span_file(path: str | os.PathLike) -> RankSpans:
    """Read and validate one rank's span file. Raises SpanFileError naming the file."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise SpanFileError(f"{name}: cannot read span file: {error.strerror or error}") from None
    if not text.strip():
        raise SpanFileError(f"{name}: span file is empty")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise SpanFileError(
            f"{name}: not valid JSON (truncated or corrupt?): {error.msg} at line {error.lineno} "
            f"column {error.colno}"
        ) from None
    return _parse_document(document, name)


def _parse_document(document: Any, name: str) -> RankSpans:
    if not isinstance(document, dict):
        raise SpanFileError(f"{name}: expected a JSON object at top level, got {_kind(document)}")
    if document.get("format") != SPAN_FORMAT:
        raise SpanFileError(
            f"{name}: not an epoverlap span file (format is {document.get('format')!r}, "
            f"expected {SPAN_FORMAT!r})"
        )
    version = document.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise SpanFileError(
            f"{name}: unsupported span format version {version!r} "
            f"(this reader understands versions {', '.join(map(str, READABLE_VERSIONS))})"
        )
    rank = _int_field(document, "rank", name, minimum=0)
    world_size = _int_field(document, "world_size", name, minimum=1)
    if rank >= world_size:
        raise SpanFileError(f"{name}: rank {rank} is not below world_size {world_size}")
    device = _str_field(document, "device", name)
    clock = _str_field(document, "clock", name)
    if clock not in CLOCKS:
        raise SpanFileError(f"{name}: unknown clock {clock!r} (allowed: {', '.join(CLOCKS)})")
    if document.get("time_unit", "us") != "us":
        raise SpanFileError(f"{name}: time_unit must be 'us', got {document.get('time_unit')!r}")
    raw_steps = document.get("steps")
    if not isinstance(raw_steps, list):
        raise SpanFileError(f"{name}: 'steps' must be a list, got {_kind(raw_steps)}")
    steps = [_parse_step(raw, index, name, version) for index, raw in enumerate(raw_steps)]
    seen: set[int] = set()
    for step in steps:
        if step.step in seen:
            raise SpanFileError(f"{name}: step {step.step} appears more than once")
        seen.add(step.step)
    steps.sort(key=lambda step: step.step)
    hold = _time_field(document, "local_copy_hold_us", name) \
        if "local_copy_hold_us" in document else 0.0
    return RankSpans(rank, world_size, device, clock, steps, name, hold)


def _parse_step(raw: Any, index: int, name: str, version: int) -> StepSpans:
    where = f"{name}: steps[{index}]"
    if not isinstance(raw, dict):
        raise SpanFileError(f"{where}: expected an object, got {_kind(raw)}")
    step = _int_field(raw, "step", where, minimum=0)
    where = f"{name}: step {step}"
    step_time_us = _time_field(raw, "step_time_us", where)
    raw_spans = raw.get("spans")
    if not isinstance(raw_spans, list):
        raise SpanFileError(f"{where}: 'spans' must be a list, got {_kind(raw_spans)}")
    spans = [_parse_span(item, i, step_time_us, where, version)
             for i, item in enumerate(raw_spans)]
    if version < 3 or raw.get("whole_step_us") is None:
        return StepSpans(step, step_time_us, spans)
    whole_us = _time_field(raw, "whole_step_us", where)
    if whole_us < step_time_us:
        raise SpanFileError(f"{where}: whole_step_us {whole_us} < step_time_us {step_time_us}")
    raw_parts = raw.get("step_parts")
    if not isinstance(raw_parts, list):
        raise SpanFileError(f"{where}: 'step_parts' must be a list, got {_kind(raw_parts)}")
    parts = [_parse_part(item, i, whole_us, where) for i, item in enumerate(raw_parts)]
    return StepSpans(step, step_time_us, spans, whole_us, parts)


def _parse_part(raw: Any, index: int, whole_us: float, where: str) -> StepPart:
    where = f"{where} step part {index}"
    if not isinstance(raw, dict):
        raise SpanFileError(f"{where}: expected an object, got {_kind(raw)}")
    name = _str_field(raw, "name", where)
    if name not in STEP_PARTS:
        raise SpanFileError(f"{where}: unknown part {name!r} (allowed: {', '.join(STEP_PARTS)})")
    lane = _str_field(raw, "lane", where)
    if lane != STEP_PARTS[name]:
        raise SpanFileError(f"{where} ({name}): lane {lane!r}, expected {STEP_PARTS[name]!r}")
    part = StepPart(name, lane, _time_field(raw, "start_us", where),
                    _time_field(raw, "end_us", where))
    if not part.start_us <= part.end_us <= whole_us:
        raise SpanFileError(f"{where} ({name}): [{part.start_us}, {part.end_us}] is not inside "
                            f"the whole step (whole_step_us {whole_us})")
    return part


def _wave_names(version: int, action: str, node: str) -> tuple[str, str]:
    """(action, node) as version 4 names them: a wave's `_cK` suffix read as `_wK`."""
    if version >= 4:
        return action, node
    return _OLD_WAVE_RE.sub(r"_w\1", action), _OLD_WAVE_RE.sub(r"_w\1", node)


def _parse_span(raw: Any, index: int, step_time_us: float, where: str, version: int) -> Span:
    where = f"{where} span {index}"
    if not isinstance(raw, dict):
        raise SpanFileError(f"{where}: expected an object, got {_kind(raw)}")
    keys = _SPAN_KEYS + (("queued_us",) if version >= 2 else ())
    missing = [key for key in keys if key not in raw]
    if missing:
        raise SpanFileError(f"{where}: missing field(s) {', '.join(missing)}")
    action, node = _wave_names(version, _str_field(raw, "action", where),
                               _str_field(raw, "node", where))
    where = f"{where} ({action})"
    lane, phase = _str_field(raw, "lane", where), _str_field(raw, "phase", where)
    if lane not in LANES:
        raise SpanFileError(f"{where}: unknown lane {lane!r} (allowed: {', '.join(LANES)})")
    if phase not in PHASES:
        raise SpanFileError(f"{where}: unknown phase {phase!r} (allowed: {', '.join(PHASES)})")
    layer = None if raw["layer"] is None else _int_field(raw, "layer", where, minimum=0)
    span = Span(
        lane=lane,
        action=action,
        microbatch=_int_field(raw, "microbatch", where, minimum=0),
        layer=layer,
        node=node,
        phase=phase,
        start_us=_time_field(raw, "start_us", where),
        end_us=_time_field(raw, "end_us", where),
        queued_us=(None if version < 2 or raw["queued_us"] is None
                   else _time_field(raw, "queued_us", where)),
    )
    _check_span_times(span, step_time_us, where)
    _check_action_matches(span, where)
    return span


def _check_span_times(span: Span, step_time_us: float, where: str) -> None:
    if span.end_us < span.start_us:
        raise SpanFileError(f"{where}: end_us {span.end_us} < start_us {span.start_us}")
    if span.queued_us is not None and span.queued_us > span.start_us:
        raise SpanFileError(f"{where}: queued_us {span.queued_us} > start_us {span.start_us} "
                            "(an action is queued before it starts)")
    if span.end_us > step_time_us:
        raise SpanFileError(
            f"{where}: end_us {span.end_us} is after the step's end (step_time_us {step_time_us})"
        )


def _check_action_matches(span: Span, where: str) -> None:
    """An action in the standard grammar must agree with the span's own fields."""
    try:
        phase, microbatch, node, layer = parse_action(span.action)
    except ValueError:
        return  # free-form action names (e.g. a gradient all-reduce) are allowed
    expected = {"phase": phase, "microbatch": microbatch, "node": node, "layer": layer}
    for field_name, value in expected.items():
        if getattr(span, field_name) != value:
            raise SpanFileError(
                f"{where}: field {field_name}={getattr(span, field_name)!r} disagrees with the "
                f"action name (which says {value!r})"
            )


def _int_field(raw: dict, key: str, where: str, minimum: int) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SpanFileError(f"{where}: '{key}' must be an int >= {minimum}, got {value!r}")
    return value


def _str_field(raw: dict, key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise SpanFileError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return value


def _time_field(raw: dict, key: str, where: str) -> float:
    value = raw.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise SpanFileError(f"{where}: '{key}' must be a finite number >= 0 (us), got {value!r}")
    return float(value)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# ----------------------------------------------------------------------------------------------
# Reading a directory
# ----------------------------------------------------------------------------------------------


def read_span_directory(directory: str | os.PathLike) -> list[RankSpans]:
    """Read every rank's span file in `directory`, sorted by rank, and check they fit together.

    Checks: at least one file; each file's rank matches its name; no rank twice; all files agree
    on world_size and clock; every rank in range(world_size) is present; all ranks recorded the
    same set of steps. Raises SpanFileError naming the directory or the offending file(s).
    """
    root = Path(directory)
    if not root.is_dir():
        raise SpanFileError(f"{root}: not a directory (expected a directory of span files)")
    paths = sorted(root.glob(SPAN_FILE_GLOB))
    if not paths:
        raise SpanFileError(f"{root}: no span files ({SPAN_FILE_GLOB}) in this directory")
    ranks = [_read_named_file(path) for path in paths]
    _check_unique_ranks(ranks)
    _check_agree(ranks, "world_size")
    _check_agree(ranks, "clock")
    _check_all_ranks_present(ranks, root)
    _check_same_steps(ranks)
    return sorted(ranks, key=lambda rank_spans: rank_spans.rank)


def _read_named_file(path: Path) -> RankSpans:
    rank_spans = read_rank_span_file(path)
    match = _FILE_NAME_RE.match(path.name)
    if match is None or int(match.group(1)) != rank_spans.rank:
        raise SpanFileError(
            f"{path}: file name does not match the rank it holds (rank {rank_spans.rank}; "
            f"expected the name {span_file_name(rank_spans.rank)})"
        )
    return rank_spans


def _check_unique_ranks(ranks: list[RankSpans]) -> None:
    by_rank: dict[int, RankSpans] = {}
    for rank_spans in ranks:
        first = by_rank.setdefault(rank_spans.rank, rank_spans)
        if first is not rank_spans:
            raise SpanFileError(
                f"duplicate rank {rank_spans.rank}: both {first.path} and {rank_spans.path}"
            )


def _check_agree(ranks: list[RankSpans], field_name: str) -> None:
    first = ranks[0]
    for other in ranks[1:]:
        if getattr(other, field_name) != getattr(first, field_name):
            raise SpanFileError(
                f"{other.path}: {field_name} is {getattr(other, field_name)!r} but {first.path} "
                f"says {getattr(first, field_name)!r}"
            )


def _check_all_ranks_present(ranks: list[RankSpans], root: Path) -> None:
    world_size = ranks[0].world_size
    present = {rank_spans.rank for rank_spans in ranks}
    missing = [rank for rank in range(world_size) if rank not in present]
    if missing:
        shown = ", ".join(str(rank) for rank in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise SpanFileError(
            f"{root}: world_size is {world_size} but the span file of rank(s) {shown} is missing "
            f"(expected e.g. {root / span_file_name(missing[0])})"
        )


def _check_same_steps(ranks: list[RankSpans]) -> None:
    first = ranks[0]
    first_steps = [step.step for step in first.steps]
    for other in ranks[1:]:
        other_steps = [step.step for step in other.steps]
        if other_steps != first_steps:
            raise SpanFileError(
                f"mixed steps: {other.path} (rank {other.rank}) has steps "
                f"{_show_steps(other_steps)} but {first.path} (rank {first.rank}) has "
                f"{_show_steps(first_steps)}"
            )


def _show_steps(steps: list[int]) -> str:
    if len(steps) > 8:
        return "[" + ", ".join(str(step) for step in steps[:8]) + f", ... ({len(steps)} steps)]"
    return str(steps)
