"""Overlap timeline tool: `epoverlap-timeline DIR [--out-dir OUT] [--step N] [--no-png]
[--torch-trace F]`, or `epoverlap-timeline --compare SEQ_DIR OVL_DIR [--out-dir OUT]`.

Reads the span files of a profiled run (epoverlap/profiling/spans.py, docs/span-format.md)
and/or torch.profiler Chrome traces and writes, to --out-dir (default DIR):
  - a printed summary and timeline_summary.json: per rank and step, per layer, mean over steps
    and per compute node (epoverlap/profiling/summary.py, where the metric definitions are
    written out), and per torch trace by kernel (epoverlap/profiling/torch_trace.py);
  - a merged Chrome/Perfetto trace, timeline_trace.json (epoverlap/profiling/chrome_trace.py);
  - a PNG Gantt chart of one step, timeline.png (epoverlap/profiling/gantt.py);
  - with --compare, the compute slowdown of one run against another (overlap vs sequential)
    per node kind and layer, waits apart (timeline_compare.json in --out-dir, default the
    second directory).
This module owns the command: its arguments, the printed tables and the output files.

Run as `epoverlap-timeline` or `python -m epoverlap.cli.timeline`; imports only `epoverlap`
(absolute), the standard library and matplotlib (for the PNG).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from epoverlap.profiling.chrome_trace import chrome_trace
from epoverlap.profiling.gantt import draw_gantt
from epoverlap.profiling.spans import RankSpans, SpanFileError, read_span_directory
from epoverlap.profiling.summary import (
    DEFINITIONS, SUMMARY_FORMAT, SUMMARY_VERSION, InputError, compare_summary, span_summary)
from epoverlap.profiling.torch_trace import torch_trace_summary

# Importable from here too (the tests read the trace format and the interval math through this
# module; the analysis itself lives in epoverlap/profiling/).
from epoverlap.profiling.chrome_trace import (  # noqa: F401
    BUBBLE_TID, LANE_TIDS, TRACE_PALETTE, read_chrome_trace)
from epoverlap.profiling.overlap import (  # noqa: F401
    CommOverlap, Interval, WindowMetrics, comm_overlap, gaps, intersect, measure, subtract, union)

TRACE_FILE = "timeline_trace.json"
PNG_FILE = "timeline.png"
SUMMARY_FILE = "timeline_summary.json"
COMPARE_FILE = "timeline_compare.json"


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
    text += _whole_step_table(summary) + "\n\n" + format_compute_nodes(summary["compute_nodes"])
    if summary.get("comm_nodes"):
        text += "\n\n" + format_comm_nodes(summary["comm_nodes"])
    return text


_WHOLE_COLUMNS = ("whole_step_us", "step_time_us", "grad_reduce_us", "grad_clip_us",
                  "optimizer_us", "whole_comm_us", "whole_compute_busy_us")


def _whole_step_table(summary: dict[str, Any]) -> str:
    """The step through the optimizer (span format 3), or "" for files without it."""
    blocks = [(step["step"], step["ranks"]) for step in summary["steps"]]
    blocks += [("mean", summary["mean_over_steps"])] if "mean_over_steps" in summary else []
    rows = [[label, row["rank"], *(row.get(c) for c in _WHOLE_COLUMNS)]
            for label, ranks in blocks for row in ranks if "whole_step_us" in row]
    if not rows:
        return ""
    names = [c.removesuffix("_us").replace("step_time", "forward_backward")
             for c in _WHOLE_COLUMNS]
    return ("\n\nwhole step (times in us; comm and compute busy with the gradients' all-reduce, "
            "clip and optimizer)\n" + _table(["step", "rank", *names], rows))


def format_compute_nodes(nodes: Sequence[dict[str, Any]]) -> str:
    """The per-node-kind table: compute time apart from the wait on the comm lane."""
    rows = [["-" if n["layer"] is None else n["layer"], n["node"], n["phase"], n["spans"],
             n["compute_us"], n["wait_us"]] for n in nodes]
    return ("per compute node (times in us per step, summed over microbatches, mean over steps "
            "and ranks; wait: on the comm lane, before the node ran)\n" +
            _table(["layer", "node", "phase", "spans", "compute", "wait"], rows))


def format_comm_nodes(nodes: Sequence[dict[str, Any]]) -> str:
    """The per-comm-node table: each all-to-all, and the K/V gather of context parallelism
    (`kv_gather`), with the part of it no compute covered."""
    rows = [["-" if n["layer"] is None else n["layer"], n["node"], n["phase"], n["spans"],
             n["comm_us"], n["exposed_us"]] for n in nodes]
    return ("per comm node (times in us per step, summed over microbatches, mean over steps "
            "and ranks; exposed: with no compute running)\n" +
            _table(["layer", "node", "phase", "spans", "comm", "exposed"], rows))


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
    torch_entries = torch_trace_summary(args.torch_trace, skip={TRACE_FILE, SUMMARY_FILE}) \
        if args.torch_trace else None
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
