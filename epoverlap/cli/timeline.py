"""Overlap timeline tool: `epoverlap-timeline DIR [--out-dir OUT] [--step N] [--no-png] [--torch-trace F]`,
or `epoverlap-timeline --compare SEQ_DIR OVL_DIR [--out-dir OUT]`.

This module owns everything that reads span files (epoverlap/profiling/spans.py, docs/span-format.md) or
torch.profiler Chrome traces and turns them into overlap figures:
  - metrics: per rank and step (interval math in epoverlap/profiling/intervals.py,
    one step's figures in epoverlap/profiling/overlap.py, which the trainer shares), per layer, mean over steps,
    and per torch trace (by kernel);
  - a merged Chrome/Perfetto trace (timeline_trace.json), a PNG Gantt chart (timeline.png),
    a printed summary and timeline_summary.json, all written to --out-dir (default DIR);
  - per compute node kind (layer, node, phase: epoverlap/profiling/node_times.py) the time it
    computed apart from the time it waited on the other lane, and with --compare the compute
    slowdown of one run against another (overlap vs sequential) per node kind and layer
    (timeline_compare.json in --out-dir, default the second directory).

Metric definitions (all in microseconds, per rank and step, window = [0, step_time_us]):
  compute_busy_us  measure(union(compute-lane spans))
  comm_us          measure(union(comm-lane spans))
  exposed_comm_us  measure(union(comm) minus union(compute)): comm time with no compute running
  hidden_comm_us   measure(union(comm) intersect union(compute)) = comm_us - exposed_comm_us
  overlap_ratio    hidden_comm_us / comm_us; defined as 1.0 when comm_us == 0 (nothing exposed)
  idle_us, idle_gaps  measure and count of the pieces of the window where neither lane is busy
  compute_wait_us  sum over compute spans of start_us - queued_us: the compute lane had reached a
                   node whose inputs from the comm lane were not ready (part of bubble_us;
                   None for version-1 span files, which do not record it)
  bubble_us        measure(window minus union(compute)): the compute lane idle, as a pipeline
                   stage is while it waits for another (plus any exposed comm and host gaps);
                   bubble_fraction = bubble_us / step_time_us. Marked in the trace (a `bubble`
                   track per rank) and the PNG (grey on the compute row). Each rank's trace
                   process is labelled with the layers its spans ran (its pipeline stage).
Per layer the busy times use only that layer's spans, but exposure is measured against ALL of the
rank's compute (comm hidden behind another layer's compute counts as hidden). Spans with no layer
(embed, loss) form the layer `null`. The mean-over-steps row averages each field over the steps;
its overlap_ratio is sum(hidden) / sum(comm) over those steps (1.0 when there is no comm).

Run as `epoverlap-timeline` or `python -m epoverlap.cli.timeline`; imports
only `epoverlap` (absolute), the standard library and matplotlib (for the PNG).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from epoverlap.profiling.overlap import (  # noqa: F401  (gaps, WindowMetrics: re-exported)
    CommOverlap, Interval, WindowMetrics, comm_overlap, gaps, intersect, lane_intervals, measure,
    step_metrics, subtract, union, window_metrics)
from epoverlap.model.stages import describe_layers
from epoverlap.profiling.node_times import compare_runs, node_figures
from epoverlap.profiling.spans import RankSpans, Span, SpanFileError, StepSpans, read_span_directory

TRACE_FILE = "timeline_trace.json"
PNG_FILE = "timeline.png"
SUMMARY_FILE = "timeline_summary.json"
COMPARE_FILE = "timeline_compare.json"
SUMMARY_FORMAT = "epoverlap-timeline-summary"
SUMMARY_VERSION = 1
LANE_TIDS = {"compute": 0, "comm": 1}
STEP_TID = 2
BUBBLE_TID = 3
BUBBLE_COLOR = "#c7c7c7"
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
EXPOSED_COLOR = "#d62728"
DEFINITIONS = {
    "compute_busy_us": "measure of the union of compute-lane spans (kernels)",
    "comm_us": "measure of the union of comm-lane spans (NCCL kernels)",
    "exposed_comm_us": "measure(union(comm) minus union(compute)) on the same rank",
    "hidden_comm_us": "measure(union(comm) intersect union(compute)) = comm_us - exposed_comm_us",
    "overlap_ratio": "hidden_comm_us / comm_us; 1.0 when comm_us == 0",
    "idle_us": "time in the window [0, step_time_us] when neither lane is busy",
    "idle_gaps": "number of maximal idle intervals in the window (leading/trailing included)",
    "bubble_us": "time in the window when the compute lane is idle (pipeline bubble, exposed "
                 "comm, host gaps)",
    "bubble_fraction": "bubble_us / step_time_us",
    "compute_wait_us": "sum over compute spans of start_us - queued_us: time the compute lane "
                       "waited for inputs from the comm lane (null: not recorded, span format 1)",
    "compute_nodes": "per (layer, node, phase) compute-lane spans summed over microbatches, mean "
                     "over the steps and ranks that ran them: compute_us = sum(end - start), "
                     "wait_us = sum(start - queued)",
    "layers": "busy times from that layer's spans only; exposure against ALL compute of the rank",
    "mean_over_steps": "field means over steps; overlap_ratio = sum(hidden) / sum(comm)",
}


class InputError(ValueError):
    """Bad input for the tool (bad torch trace, unknown step, ...); the message names the file."""


# ----------------------------------------------------------------------------------------------
# Metrics (a step's figures: epoverlap.profiling.overlap)
# ----------------------------------------------------------------------------------------------


def layer_metrics(step: StepSpans) -> dict[int | None, CommOverlap]:
    """Per layer (None = spans with no layer): that layer's busy times, exposure vs ALL compute."""
    all_compute = lane_intervals(step.spans, "compute")
    layers = sorted({span.layer for span in step.spans}, key=lambda l: (l is None, l or 0))
    out = {}
    for layer in layers:
        own = [span for span in step.spans if span.layer == layer]
        out[layer] = comm_overlap(
            lane_intervals(own, "compute"), lane_intervals(own, "comm"), hiding=all_compute
        )
    return out


def compute_wait_us(spans: Sequence[Span]) -> float | None:
    """Sum of the compute spans' waits on the comm lane (None if any span lacks the mark)."""
    waits = [span.wait_us for span in spans if span.lane == "compute"]
    return None if None in waits else sum(waits)


def bubbles(step: StepSpans) -> list[Interval]:
    """Where the rank's compute lane is idle in its step (module docstring: bubble_us)."""
    return gaps(lane_intervals(step.spans, "compute"), 0.0, step.step_time_us)


def _rank_row(rank: int, step: StepSpans) -> dict[str, Any]:
    layers = [{"layer": layer, **asdict(figures),
               "compute_wait_us": compute_wait_us([s for s in step.spans if s.layer == layer])}
              for layer, figures in layer_metrics(step).items()]
    bubble_us = measure(bubbles(step))
    return {"rank": rank, **step_metrics(step).as_dict(),
            "compute_wait_us": compute_wait_us(step.spans), "bubble_us": bubble_us,
            "bubble_fraction": bubble_us / step.step_time_us if step.step_time_us else 0.0,
            "layers": layers}


def mean_over_steps(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean of each numeric field; overlap_ratio recomputed as sum(hidden) / sum(comm)."""
    keys = [key for key, value in rows[0].items() if isinstance(value, (int, float))]
    mean = {key: sum(row.get(key, 0.0) for row in rows) / len(rows) for key in keys}
    comm = sum(row["comm_us"] for row in rows)
    mean["overlap_ratio"] = sum(row["hidden_comm_us"] for row in rows) / comm if comm > 0 else 1.0
    return mean


def span_summary(ranks: list[RankSpans], steps: list[int]) -> dict[str, Any]:
    """The JSON-ready figures of the chosen steps: per step, rank and layer; means over steps."""
    per_step = []
    for step_number in steps:
        rows = []
        for rank_spans in ranks:
            rows.append(_rank_row(rank_spans.rank, _find_step(rank_spans, step_number)))
        per_step.append({"step": step_number, "ranks": rows})
    summary: dict[str, Any] = {"steps": per_step}
    if len(steps) > 1:
        summary["mean_over_steps"] = [_rank_mean(per_step, index) for index in range(len(ranks))]
    summary["compute_nodes"] = [f.as_dict() for f in node_figures(ranks, steps)]
    return summary


def _rank_mean(per_step: list[dict[str, Any]], index: int) -> dict[str, Any]:
    rows = [step["ranks"][index] for step in per_step]
    layer_keys = []
    for row in rows:
        layer_keys += [entry["layer"] for entry in row["layers"] if entry["layer"] not in layer_keys]
    layers = []
    for key in layer_keys:
        entries = [_layer_entry(row, key) for row in rows]
        layers.append({"layer": key, **{k: v for k, v in mean_over_steps(entries).items()
                                        if k != "layer"}})
    return {"rank": rows[0]["rank"], **{k: v for k, v in mean_over_steps(rows).items()
                                        if k != "rank"}, "layers": layers}


def _layer_entry(row: dict[str, Any], layer: int | None) -> dict[str, Any]:
    for entry in row["layers"]:
        if entry["layer"] == layer:
            return entry
    zero = asdict(CommOverlap(0.0, 0.0, 0.0, 0.0, 1.0))
    return {"layer": layer, **zero}


def _find_step(rank_spans: RankSpans, step_number: int) -> StepSpans:
    for step in rank_spans.steps:
        if step.step == step_number:
            return step
    raise InputError(f"{rank_spans.path}: no step {step_number}")


# ----------------------------------------------------------------------------------------------
# torch.profiler Chrome traces: kernels whose name contains "nccl" are comm, other kernels compute
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float
    stream: str
    device: str
    is_comm: bool


def torch_trace_paths(arguments: Sequence[str]) -> list[Path]:
    """Expand --torch-trace arguments: files as given, directories to their *.json(.gz) files."""
    own_outputs = {TRACE_FILE, SUMMARY_FILE}
    paths: list[Path] = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz"))
                           and p.name not in own_outputs and not p.name.startswith("spans-rank"))
            if not found:
                raise InputError(f"{path}: no *.json or *.json.gz trace files in this directory")
            paths += found
        else:
            paths.append(path)
    return paths


def read_torch_trace(path: Path) -> tuple[int | None, list[Kernel]]:
    """(rank from distributedInfo if any, GPU kernels) of a trace given as an object or a list."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, EOFError) as error:
        raise InputError(f"{path}: cannot read torch trace: {error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not valid JSON (truncated or corrupt?): {error}") from None
    events = document.get("traceEvents") if isinstance(document, dict) else document
    if not isinstance(events, list):
        raise InputError(f"{path}: expected {{'traceEvents': [...]}} or a list of trace events")
    kernels = [_kernel(event, path) for event in events if _is_kernel(event)]
    if not kernels:
        raise InputError(
            f"{path}: no GPU kernel events (\"cat\": \"kernel\"); was the profiler run with "
            "ProfilerActivity.CUDA?"
        )
    info = document.get("distributedInfo") if isinstance(document, dict) else None
    rank = info.get("rank") if isinstance(info, dict) else None
    return (rank if isinstance(rank, int) else None), kernels


def _is_kernel(event: Any) -> bool:
    return (isinstance(event, dict) and str(event.get("cat", "")).lower() == "kernel"
            and event.get("ph", "X") == "X")


def _kernel(event: dict, path: Path) -> Kernel:
    name, ts, dur = event.get("name", ""), event.get("ts"), event.get("dur")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ts, dur)):
        raise InputError(f"{path}: kernel event {name!r} lacks numeric 'ts'/'dur'")
    args = event.get("args") if isinstance(event.get("args"), dict) else {}
    stream = args.get("stream", event.get("tid"))
    device = args.get("device", event.get("pid"))
    is_comm = "nccl" in str(name).lower()
    return Kernel(str(name), float(ts), float(ts) + float(dur), str(stream), str(device), is_comm)


def kernel_metrics(kernels: Sequence[Kernel]) -> dict[str, Any]:
    """Window (first kernel start .. last kernel end) metrics, plus busy time per stream."""
    start = min(kernel.start_us for kernel in kernels)
    end = max(kernel.end_us for kernel in kernels)
    compute = [(k.start_us - start, k.end_us - start) for k in kernels if not k.is_comm]
    comm = [(k.start_us - start, k.end_us - start) for k in kernels if k.is_comm]
    figures = window_metrics(compute, comm, 0.0, end - start).as_dict()
    figures["window_us"] = figures.pop("step_time_us")
    streams = []
    for stream in sorted({k.stream for k in kernels}, key=_natural_key):
        own = [k for k in kernels if k.stream == stream]
        comm_count = sum(k.is_comm for k in own)
        kind = "comm" if comm_count == len(own) else "compute" if comm_count == 0 else "mixed"
        busy = measure((k.start_us - start, k.end_us - start) for k in own)
        streams.append({"stream": stream, "kind": kind, "busy_us": busy, "kernels": len(own),
                        "nccl_kernels": comm_count})
    return {**figures, "streams": streams}


def torch_trace_summary(arguments: Sequence[str]) -> list[dict[str, Any]]:
    """One entry per (trace file, device) with kernel metrics; rank from the trace or file order."""
    entries = []
    for index, path in enumerate(torch_trace_paths(arguments)):
        rank, kernels = read_torch_trace(path)
        devices = sorted({kernel.device for kernel in kernels}, key=_natural_key)
        for device in devices:
            own = [kernel for kernel in kernels if kernel.device == device]
            entries.append({"file": str(path), "rank": index if rank is None else rank,
                            "device": device, **kernel_metrics(own)})
    return entries


def _natural_key(text: str) -> tuple[int, Any]:
    return (0, int(text)) if text.lstrip("-").isdigit() else (1, text)


# ----------------------------------------------------------------------------------------------
# Chrome / Perfetto trace of the span files
# ----------------------------------------------------------------------------------------------


def chrome_trace(ranks: list[RankSpans], steps: list[int], source: str) -> dict[str, Any]:
    """One process per rank, one thread per lane (+ a step track), steps laid end to end."""
    events: list[dict[str, Any]] = []
    for rank_spans in ranks:
        events += _rank_metadata(rank_spans)
        offset = 0.0
        for step_number in steps:
            step = _find_step(rank_spans, step_number)
            events.append(_step_event(rank_spans.rank, step, offset))
            events += [_span_event(rank_spans.rank, step.step, span, offset) for span in step.spans]
            events += [_bubble_event(rank_spans.rank, step.step, start, end, offset)
                       for start, end in bubbles(step)]
            offset += step.step_time_us
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
        steps[key] = StepSpans(key[1], float(event["dur"]), [])
        offsets[key] = float(event["ts"])
    lanes = {tid: lane for lane, tid in LANE_TIDS.items()}
    for event in (e for e in complete if e.get("tid") in lanes):
        key = (event["pid"], event.get("args", {}).get("step"))
        if key not in steps:
            raise InputError(f"{path}: span {event.get('name')!r} outside any step marker")
        start = float(event["ts"]) - offsets[key]
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


def _step_event(rank: int, step: StepSpans, offset: float) -> dict[str, Any]:
    return {"name": f"step {step.step}", "cat": "step", "ph": "X", "ts": offset,
            "dur": step.step_time_us, "pid": rank, "tid": STEP_TID, "cname": "grey",
            "args": {"step": step.step, "step_time_us": step.step_time_us}}


# ----------------------------------------------------------------------------------------------
# PNG Gantt chart of one step
# ----------------------------------------------------------------------------------------------


def draw_gantt(ranks: list[RankSpans], step_number: int, path: Path, title: str = "") -> None:
    """One row per (rank, lane); comm split into hidden (hatched) and exposed (red) parts.
    `title` goes before the step's exposed-comm figures (the simulator names its scenario)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    # tab10 without its red (index 3), which marks exposed comm
    colors = tuple(c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 3)
    steps = [_find_step(rank_spans, step_number) for rank_spans in ranks]
    width = max(step.step_time_us for step in steps) or 1.0
    figure, axes = plt.subplots(figsize=(14, 1.2 + 0.45 * 2 * len(ranks)))
    labels, exposed_by_rank, microbatches = [], [], set()
    for row_pair, (rank_spans, step) in enumerate(zip(ranks, steps)):
        compute_y, comm_y = -2 * row_pair, -2 * row_pair - 1
        all_compute = union(lane_intervals(step.spans, "compute"))
        _bars(axes, bubbles(step), compute_y, BUBBLE_COLOR, hatch="xx", alpha=0.5)
        for span in step.spans:
            microbatches.add(span.microbatch)
            color = colors[span.microbatch % len(colors)]
            own = [(span.start_us, span.end_us)]
            if span.lane == "compute":
                _bars(axes, own, compute_y, color)
            else:
                _bars(axes, intersect(own, all_compute), comm_y, color, hatch="///", alpha=0.55)
                _bars(axes, subtract(own, all_compute), comm_y, EXPOSED_COLOR)
            if span.duration_us > 0.04 * width:
                axes.text((span.start_us + span.end_us) / 2, compute_y if span.lane == "compute"
                          else comm_y, span.action, ha="center", va="center", fontsize=6)
        exposed = step_metrics(step).overlap.exposed_comm_us
        exposed_by_rank.append(exposed)
        labels += [(compute_y, f"rank {rank_spans.rank} compute"),
                   (comm_y, f"rank {rank_spans.rank} comm (exposed {exposed:.1f} us)")]
    axes.set_yticks([y for y, _ in labels], [text for _, text in labels])
    axes.set_xlim(0, width)
    axes.set_xlabel("time since step start (us)")
    worst = max(range(len(ranks)), key=lambda i: exposed_by_rank[i])
    axes.set_title(f"{title + chr(10) if title else ''}step {step_number}: exposed comm {sum(exposed_by_rank):.1f} us summed over "
                   f"{len(ranks)} rank(s), max {exposed_by_rank[worst]:.1f} us on rank "
                   f"{ranks[worst].rank}")
    handles = [Patch(color=colors[mb % len(colors)], label=f"microbatch {mb}")
               for mb in sorted(microbatches)]
    handles += [Patch(facecolor="white", edgecolor="black", hatch="///", label="comm, hidden"),
                Patch(color=EXPOSED_COLOR, label="comm, exposed"),
                Patch(facecolor=BUBBLE_COLOR, hatch="xx", label="compute idle (bubble)")]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _bars(axes: Any, intervals: list[Interval], y: float, color: Any, **style: Any) -> None:
    if intervals:
        axes.broken_barh([(s, e - s) for s, e in intervals], (y - 0.4, 0.8), facecolors=color,
                         edgecolor="black", linewidth=0.3, **style)


# ----------------------------------------------------------------------------------------------
# Printed tables
# ----------------------------------------------------------------------------------------------

_RANK_COLUMNS = ("step_time_us", "compute_busy_us", "comm_us", "exposed_comm_us",
                 "hidden_comm_us", "overlap_ratio", "idle_us", "idle_gaps")
_SPAN_COLUMNS = _RANK_COLUMNS[:2] + ("compute_wait_us",) + _RANK_COLUMNS[2:] + ("bubble_us",)
_LAYER_COLUMNS = ("compute_busy_us", "compute_wait_us", "comm_us", "exposed_comm_us",
                  "hidden_comm_us", "overlap_ratio")


def _cell(value: Any, column: str) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if column == "overlap_ratio" else f"{value:.1f}"
    return "-" if value is None else str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(header)] + [[_cell(v, c) for v, c in zip(row, header)] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def format_span_summary(summary: dict[str, Any]) -> str:
    """Per-rank table (every step, then means) and per-(rank, layer) table of the last block."""
    rows = [[step["step"], row["rank"], *(row.get(c) for c in _SPAN_COLUMNS)]
            for step in summary["steps"] for row in step["ranks"]]
    layer_source = summary["steps"][-1]["ranks"]
    layer_title = f"per layer, step {summary['steps'][-1]['step']}"
    if "mean_over_steps" in summary:
        rows += [["mean", row["rank"], *(row.get(c) for c in _SPAN_COLUMNS)]
                 for row in summary["mean_over_steps"]]
        layer_source, layer_title = summary["mean_over_steps"], "per layer, mean over steps"
    names = [c.removesuffix("_us") for c in _SPAN_COLUMNS]
    text = "per rank (times in us)\n" + _table(["step", "rank", *names], rows)
    layer_rows = [[row["rank"], "-" if e["layer"] is None else e["layer"],
                   *(e.get(c) for c in _LAYER_COLUMNS)]
                  for row in layer_source for e in row["layers"]]
    names = [c.removesuffix("_us") for c in _LAYER_COLUMNS]
    text += f"\n\n{layer_title} (times in us; exposure vs all compute of the rank)\n" + \
        _table(["rank", "layer", *names], layer_rows)
    return text + "\n\n" + format_compute_nodes(summary["compute_nodes"])


def format_compute_nodes(nodes: Sequence[dict[str, Any]]) -> str:
    """The per-node-kind table: compute time apart from the wait on the comm lane."""
    rows = [["-" if n["layer"] is None else n["layer"], n["node"], n["phase"], n["spans"],
             n["compute_us"], n["wait_us"]] for n in nodes]
    return ("per compute node (times in us per step, summed over microbatches, mean over steps "
            "and ranks; wait: on the comm lane, before the node ran)\n" +
            _table(["layer", "node", "phase", "spans", "compute", "wait"], rows))


def format_torch_summary(entries: list[dict[str, Any]]) -> str:
    columns = ("window_us", *_RANK_COLUMNS[1:])
    rows = [[e["rank"], e["device"], *(e[c] for c in columns)] for e in entries]
    text = "torch traces, GPU kernels (times in us)\n" + _table(
        ["rank", "device", *(c.removesuffix("_us") for c in columns)], rows)
    stream_rows = [[e["rank"], e["device"], s["stream"], s["kind"], s["busy_us"], s["kernels"]]
                   for e in entries for s in e["streams"]]
    return text + "\n\nper stream\n" + _table(
        ["rank", "device", "stream", "kind", "busy", "kernels"], stream_rows)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="epoverlap-timeline",
        description="Merge per-rank span files into a Perfetto trace, a PNG Gantt chart and an "
                    "overlap summary; or measure overlap from torch.profiler traces.")
    parser.add_argument("directory", nargs="?", help="directory of spans-rankNNNNN.json files")
    parser.add_argument("--out-dir", help="where to write outputs (default: DIR)")
    parser.add_argument("--step", type=int, help="only this step (default: all; PNG: last step)")
    parser.add_argument("--no-png", action="store_true", help="skip the PNG Gantt chart")
    parser.add_argument("--torch-trace", action="append", default=[], metavar="FILE",
                        help="torch.profiler Chrome trace (one per rank) or a directory of them; "
                             "repeatable")
    parser.add_argument("--compare", nargs=2, metavar=("SEQ_DIR", "OVL_DIR"),
                        help="two span directories of one model (say a sequential and an "
                             "overlapped run): per layer and node, compute time of the second "
                             "over the first's (the compute slowdown under overlap), waits apart")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tool; 0 on success, 2 with a one-line message on bad input."""
    args = parse_args(argv)
    try:
        return _run(args)
    except (SpanFileError, InputError) as error:
        print(f"epoverlap-timeline: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"epoverlap-timeline: error: {error.filename or ''}: {error.strerror or error}",
              file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.compare:
        if args.directory is not None or args.torch_trace or args.step is not None:
            raise InputError("--compare SEQ_DIR OVL_DIR takes no other DIR, --torch-trace or "
                             "--step (it reads every step of both)")
        return _run_compare(*args.compare, Path(args.out_dir or args.compare[1]))
    if args.directory is None and not args.torch_trace:
        raise InputError("give a span directory (DIR) and/or --torch-trace FILE, or --compare "
                         "SEQ_DIR OVL_DIR")
    default_out = args.directory or Path(args.torch_trace[0]).resolve().parent
    out_dir = Path(args.out_dir or default_out)
    summary: dict[str, Any] = {"format": SUMMARY_FORMAT, "version": SUMMARY_VERSION,
                               "definitions": DEFINITIONS}
    torch_entries = torch_trace_summary(args.torch_trace) if args.torch_trace else None
    if args.directory is not None:
        summary["spans"] = _run_spans(args, out_dir)
    if torch_entries is not None:
        print(f"epoverlap-timeline: read {len(torch_entries)} torch trace(s)\n")
        print(format_torch_summary(torch_entries) + "\n")
        summary["torch_traces"] = torch_entries
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out_dir / SUMMARY_FILE}")
    return 0


def _run_spans(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    ranks = read_span_directory(args.directory)
    steps = [step.step for step in ranks[0].steps]
    if not steps:
        raise InputError(f"{args.directory}: the span files hold no steps")
    if args.step is not None:
        if args.step not in steps:
            raise InputError(f"{args.directory}: no step {args.step} (steps recorded: "
                             f"{steps[0]}..{steps[-1]}, {len(steps)} in all)")
        steps = [args.step]
    shown = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    print(f"epoverlap-timeline: read {args.directory}: {len(ranks)} rank(s), clock "
          f"{ranks[0].clock}, {shown}\n")
    figures = span_summary(ranks, steps)
    print(format_span_summary(figures) + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = chrome_trace(ranks, steps, str(args.directory))
    (out_dir / TRACE_FILE).write_text(json.dumps(trace) + "\n", encoding="utf-8")
    print(f"wrote {out_dir / TRACE_FILE} (open in ui.perfetto.dev or chrome://tracing)")
    if not args.no_png:
        _write_png(ranks, steps[-1], out_dir / PNG_FILE)
    return {"directory": str(args.directory), "world_size": ranks[0].world_size,
            "clock": ranks[0].clock, **figures}


def compare_summary(base_dir: str, other_dir: str) -> dict[str, Any]:
    """Per node kind, per layer and overall: compute time of the run in `other_dir` over the one
    in `base_dir` (node_times.compare_runs), with both runs' waits."""
    runs = [read_span_directory(directory) for directory in (base_dir, other_dir)]
    for directory, ranks in zip((base_dir, other_dir), runs):
        if not ranks[0].steps:
            raise InputError(f"{directory}: the span files hold no steps")
    rows = compare_runs(node_figures(runs[0]), node_figures(runs[1]))
    return {"format": SUMMARY_FORMAT + "-compare", "version": 1, "base": base_dir,
            "other": other_dir, "steps": [[s.step for s in ranks[0].steps] for ranks in runs],
            "definitions": {
                "compute_us": "sum over the row's compute spans of end - start, per step "
                              "(summed over microbatches, mean over steps and ranks)",
                "wait_us": "likewise of start - queued: waiting on the comm lane",
                "slowdown": "other_compute_us / base_compute_us"},
            "rows": [row.as_dict() for row in rows]}


def format_compare(summary: dict[str, Any]) -> str:
    width = max(len(r["row"]) for r in summary["rows"])
    rows = [[r["row"].ljust(width), r["base_compute_us"], r["other_compute_us"], r["slowdown"],
             r["base_wait_us"], r["other_wait_us"]] for r in summary["rows"]]
    header = ["layer node phase".ljust(width), "seq compute", "ovl compute", "slowdown",
              "seq wait", "ovl wait"]
    cells = [[_compare_cell(value, column) for value, column in zip(row, header)] for row in rows]
    return (f"compute slowdown under overlap: {summary['other']} over {summary['base']} (times "
            "in us per step; compute apart from the wait on the comm lane)\n" +
            _table(header, cells))


def _compare_cell(value: Any, column: str) -> str:
    if column == "slowdown" and isinstance(value, float):
        return f"{value:.3f}"
    return _cell(value, column)


def _run_compare(base_dir: str, other_dir: str, out_dir: Path) -> int:
    summary = compare_summary(base_dir, other_dir)
    print(format_compare(summary) + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / COMPARE_FILE).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out_dir / COMPARE_FILE}")
    return 0


def _write_png(ranks: list[RankSpans], step: int, path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("epoverlap-timeline: PNG skipped: matplotlib is not installed "
              "(pip install matplotlib, or pass --no-png)", file=sys.stderr)
        return
    draw_gantt(ranks, step, path)
    print(f"wrote {path} (step {step})")


if __name__ == "__main__":
    sys.exit(main())
