"""The merged Chrome / Perfetto trace of span records (timeline_trace.json), and its inverse.

Owns `chrome_trace` (one process per rank, one thread per lane plus a step track and a bubble
track, steps laid end to end; each rank's process labelled with the layers its spans ran, its
pipeline stage; spans coloured by microbatch) and `read_chrome_trace`, which turns such a trace
back into per-rank span records (the simulator's `--trace` input). The event ids it writes and
reads (`LANE_TIDS`, `STEP_TID`, `BUBBLE_TID`) are the format both sides share.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from epoverlap.model.stages import describe_layers
from epoverlap.profiling.spans import RankSpans, Span, StepPart, StepSpans
from epoverlap.profiling.summary import InputError, bubbles, find_step

LANE_TIDS = {"compute": 0, "comm": 1}
STEP_TID = 2
BUBBLE_TID = 3
PART_CATEGORY = "step_part"  # the step's parts after its forward-backward, on their lanes
# Reserved Chrome trace-viewer colour names (`cname`), cycled by microbatch.
TRACE_PALETTE = (
    "thread_state_runnable",
    "thread_state_running",
    "thread_state_iowait",
    "thread_state_uninterruptible",
    "background_memory_dump",
    "detailed_memory_dump",
    "thread_state_unknown",
    "olive",
    "light_memory_dump",
    "yellow",
)


def chrome_trace(ranks: list[RankSpans], steps: list[int], source: str) -> dict[str, Any]:
    """One process per rank, one thread per lane (+ a step track), steps laid end to end."""
    events: list[dict[str, Any]] = []
    for rank_spans in ranks:
        events += _rank_metadata(rank_spans)
        offset = 0.0
        for step_number in steps:
            step = find_step(rank_spans, step_number)
            events.append(_step_event(rank_spans.rank, step, offset))
            events += [_span_event(rank_spans.rank, step.step, span, offset) for span in step.spans]
            events += [_bubble_event(rank_spans.rank, step.step, start, end, offset)
                       for start, end in bubbles(step)]
            events += [_part_event(rank_spans.rank, step.step, part, offset)
                       for part in step.parts]
            offset += step.whole_step_us or step.step_time_us
    other = {"source": source, "clock": ranks[0].clock, "world_size": ranks[0].world_size}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def read_chrome_trace(path: str | Path) -> list[RankSpans]:
    """The inverse of `chrome_trace`: a timeline_trace.json back into per-rank span records
    (steps cut at their step markers, times relative to each step's start)."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise InputError(f"{path}: cannot read a timeline trace: {error}") from None
    events = document.get("traceEvents") if isinstance(document, dict) else None
    if not isinstance(events, list):
        raise InputError(f"{path}: not a timeline trace (no traceEvents list)")
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    steps: dict[tuple[int, int], StepSpans] = {}
    offsets: dict[tuple[int, int], float] = {}
    for event in (e for e in complete if e.get("tid") == STEP_TID):
        key = (event["pid"], event["args"]["step"])
        steps[key] = StepSpans(key[1], float(event["dur"]), [],
                               event["args"].get("whole_step_us"))
        offsets[key] = float(event["ts"])
    lanes = {tid: lane for lane, tid in LANE_TIDS.items()}
    for event in (e for e in complete if e.get("tid") in lanes):
        key = (event["pid"], event.get("args", {}).get("step"))
        if key not in steps:
            raise InputError(f"{path}: span {event.get('name')!r} outside any step marker")
        start = float(event["ts"]) - offsets[key]
        if event.get("cat") == PART_CATEGORY:
            steps[key].parts.append(StepPart(event["name"], lanes[event["tid"]], start,
                                             start + float(event["dur"])))
            continue
        wait = event.get("args", {}).get("wait_us")
        steps[key].spans.append(Span.from_action(lanes[event["tid"]], event["name"], start,
                                                 start + float(event["dur"]),
                                                 None if wait is None else start - wait))
    if not steps:
        raise InputError(f"{path}: no step markers (is it a timeline_trace.json?)")
    other = document.get("otherData", {})
    ranks = sorted({rank for rank, _ in steps})
    return [RankSpans(rank, other.get("world_size", len(ranks)), "trace",
                      other.get("clock", "cuda_event"),
                      [steps[key] for key in sorted(steps) if key[0] == rank], str(path))
            for rank in ranks]


def _rank_metadata(rank_spans: RankSpans) -> list[dict[str, Any]]:
    rank = rank_spans.rank

    def meta(name: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "ph": "M", "pid": rank, "tid": tid, "args": args}

    layers = sorted({span.layer for step in rank_spans.steps for span in step.spans
                     if span.layer is not None})
    events = [meta("process_name", 0, {"name": f"rank {rank}"}),
              meta("process_sort_index", 0, {"sort_index": rank})]
    if layers:
        events.append(meta("process_labels", 0, {"labels": describe_layers(layers)}))
    for lane, tid in [*LANE_TIDS.items(), ("step", STEP_TID), ("bubble", BUBBLE_TID)]:
        events += [meta("thread_name", tid, {"name": lane}),
                   meta("thread_sort_index", tid, {"sort_index": tid})]
    return events


def _span_event(rank: int, step: int, span: Span, offset: float) -> dict[str, Any]:
    return {
        "name": span.action, "cat": f"{span.lane},{span.phase}", "ph": "X",
        "ts": offset + span.start_us, "dur": span.end_us - span.start_us,
        "pid": rank, "tid": LANE_TIDS[span.lane],
        "cname": TRACE_PALETTE[span.microbatch % len(TRACE_PALETTE)],
        "args": {"microbatch": span.microbatch, "layer": span.layer, "node": span.node,
                 "phase": span.phase, "lane": span.lane, "step": step,
                 "wait_us": span.wait_us},
    }


def _bubble_event(rank: int, step: int, start: float, end: float,
                  offset: float) -> dict[str, Any]:
    return {"name": "bubble", "cat": "bubble", "ph": "X", "ts": offset + start,
            "dur": end - start, "pid": rank, "tid": BUBBLE_TID, "cname": "grey",
            "args": {"step": step}}


def _part_event(rank: int, step: int, part: StepPart, offset: float) -> dict[str, Any]:
    return {"name": part.name, "cat": PART_CATEGORY, "ph": "X", "ts": offset + part.start_us,
            "dur": part.duration_us, "pid": rank, "tid": LANE_TIDS[part.lane],
            "cname": "grey", "args": {"step": step, "lane": part.lane}}


def _step_event(rank: int, step: StepSpans, offset: float) -> dict[str, Any]:
    """The forward-backward's window (the step's parts after it follow on the lanes)."""
    return {"name": f"step {step.step}", "cat": "step", "ph": "X", "ts": offset,
            "dur": step.step_time_us, "pid": rank, "tid": STEP_TID, "cname": "grey",
            "args": {"step": step.step, "step_time_us": step.step_time_us,
                     "whole_step_us": step.whole_step_us}}
