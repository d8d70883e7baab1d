"""The PNG Gantt chart of one step of span records (timeline.png, the simulator's simulated.png).

Owns `draw_gantt`: one row per (rank, lane), spans coloured by microbatch, comm split into
hidden (hatched: compute running beside it) and exposed (red) parts, the compute lane's idle
time (its bubbles) in grey, and each rank's exposed comm in its row label and the title.
Needs matplotlib (imported when drawing; the Agg backend, no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epoverlap.profiling.overlap import (
    Interval, intersect, lane_intervals, step_metrics, subtract, union)
from epoverlap.profiling.spans import RankSpans
from epoverlap.profiling.summary import bubbles, find_step

BUBBLE_COLOR = "#c7c7c7"
EXPOSED_COLOR = "#d62728"


def draw_gantt(ranks: list[RankSpans], step_number: int, path: Path, title: str = "") -> None:
    """One row per (rank, lane); comm split into hidden (hatched) and exposed (red) parts.
    `title` goes before the step's exposed-comm figures (the simulator names its scenario)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    # tab10 without its red (index 3), which marks exposed comm
    colors = tuple(c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 3)
    steps = [find_step(rank_spans, step_number) for rank_spans in ranks]
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
    axes.set_title(f"{title + chr(10) if title else ''}step {step_number}: exposed comm "
                   f"{sum(exposed_by_rank):.1f} us summed over {len(ranks)} rank(s), max "
                   f"{exposed_by_rank[worst]:.1f} us on rank {ranks[worst].rank}")
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
