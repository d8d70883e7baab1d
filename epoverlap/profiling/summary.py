"""Overlap figures of span records, as `epoverlap-timeline` reports them: per rank and step, per
layer, mean over steps, per compute node, and two runs compared per node.

Owns `span_summary` (the JSON-ready figures of the chosen steps), `compare_summary` (per node
kind and layer, the compute time of one run over another's: epoverlap/profiling/node_times.py),
the summary's `DEFINITIONS` and format name, `bubbles` (where a rank's compute lane is idle),
`find_step`, and `InputError`, the one error of bad input to the analysis (an unknown step, a
bad trace), which the timeline and simulator commands print as one line. A step's own figures
come from epoverlap/profiling/overlap.py (which the trainer shares), the interval math from
epoverlap/profiling/intervals.py.

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
Span files of version 3 also time the step after its forward-backward (the gradients'
all-reduce, clip, optimizer: `spans.STEP_PARTS`), and each rank row then adds:
  whole_step_us          the step through the optimizer (`StepSpans.whole_step_us`)
  <part>_us              each part's duration (grad_reduce_us, grad_clip_us, optimizer_us)
  whole_comm_us          comm_us + the comm-lane parts (the gradients' all-reduce)
  whole_compute_busy_us  compute_busy_us + the compute-lane parts
Per layer the busy times use only that layer's spans, but exposure is measured against ALL of the
rank's compute (comm hidden behind another layer's compute counts as hidden). Spans with no layer
(embed, loss) form the layer `null`. The mean-over-steps row averages each field over the steps;
its overlap_ratio is sum(hidden) / sum(comm) over those steps (1.0 when there is no comm).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

from epoverlap.profiling.node_times import compare_runs, comm_node_figures, node_figures
from epoverlap.profiling.overlap import (
    CommOverlap, Interval, comm_overlap, gaps, lane_intervals, measure, step_metrics)
from epoverlap.profiling.spans import RankSpans, Span, StepSpans, read_span_directory

SUMMARY_FORMAT = "epoverlap-timeline-summary"
SUMMARY_VERSION = 1
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
    "comm_nodes": "per (layer, node, phase) comm-lane spans (all-to-alls, the K/V gather of "
                  "context parallelism, kv_gather) summed over microbatches, mean over the "
                  "steps and ranks that ran them: comm_us = sum(end - start), exposed_us = "
                  "the part of them no compute-lane span of the rank covered",
    "layers": "busy times from that layer's spans only; exposure against ALL compute of the rank",
    "mean_over_steps": "field means over steps; overlap_ratio = sum(hidden) / sum(comm)",
    "whole_step_us": "the step through the optimizer (span format 3; absent before)",
    "whole_comm_us": "comm_us + the comm-lane step parts (the gradients' all-reduce)",
    "whole_compute_busy_us": "compute_busy_us + the compute-lane step parts (clip, optimizer)",
}


class InputError(ValueError):
    """Bad input for the tool (bad torch trace, unknown step, ...); the message names the file."""


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
    metrics = step_metrics(step).as_dict()
    return {"rank": rank, **metrics,
            "compute_wait_us": compute_wait_us(step.spans), "bubble_us": bubble_us,
            "bubble_fraction": bubble_us / step.step_time_us if step.step_time_us else 0.0,
            **whole_step_figures(step, metrics), "layers": layers}


def whole_step_figures(step: StepSpans, metrics: dict[str, Any]) -> dict[str, float]:
    """The whole step's figures (module docstring), {} for a step recorded without them."""
    if step.whole_step_us is None:
        return {}
    figures = {"whole_step_us": step.whole_step_us}
    lanes = {"comm": metrics["comm_us"], "compute": metrics["compute_busy_us"]}
    for part in step.parts:
        figures[f"{part.name}_us"] = figures.get(f"{part.name}_us", 0.0) + part.duration_us
        lanes[part.lane] += part.duration_us
    figures["whole_comm_us"], figures["whole_compute_busy_us"] = lanes["comm"], lanes["compute"]
    return figures


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
            rows.append(_rank_row(rank_spans.rank, find_step(rank_spans, step_number)))
        per_step.append({"step": step_number, "ranks": rows})
    summary: dict[str, Any] = {"steps": per_step}
    if len(steps) > 1:
        summary["mean_over_steps"] = [_rank_mean(per_step, index) for index in range(len(ranks))]
    summary["compute_nodes"] = [f.as_dict() for f in node_figures(ranks, steps)]
    summary["comm_nodes"] = [f.as_dict() for f in comm_node_figures(ranks, steps)]
    return summary


def _rank_mean(per_step: list[dict[str, Any]], index: int) -> dict[str, Any]:
    rows = [step["ranks"][index] for step in per_step]
    layer_keys = []
    for row in rows:
        layer_keys += [entry["layer"] for entry in row["layers"]
                       if entry["layer"] not in layer_keys]
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


def find_step(rank_spans: RankSpans, step_number: int) -> StepSpans:
    """The rank's record of step `step_number` (InputError naming the file if it has none)."""
    for step in rank_spans.steps:
        if step.step == step_number:
            return step
    raise InputError(f"{rank_spans.path}: no step {step_number}")


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
