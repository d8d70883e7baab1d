"""Communication overlap of one step from its spans: interval math and the step's figures.

Owns the pure interval functions (union, intersect, subtract, measure, gaps on lists of
(start, end) pairs) and `step_metrics` (compute busy, comm, exposed and hidden comm, overlap
ratio, idle time of one rank's step). The trainer reports them for profiled steps
(TensorBoard), `epoverlap-timeline` (tools/timeline.py, where the metric definitions are
written out) builds its tables on them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from epoverlap.profiling.spans import Span, StepSpans

Interval = tuple[float, float]


# ----------------------------------------------------------------------------------------------
# Interval math: lists of (start, end) pairs; results are sorted, disjoint, non-touching and of
# positive length ("normalized").
# ----------------------------------------------------------------------------------------------


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge overlapping or touching intervals; zero-length intervals vanish."""
    merged: list[Interval] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The points covered by both a and b."""
    left, right = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(left) and j < len(right):
        start, end = max(left[i][0], right[j][0]), min(left[i][1], right[j][1])
        if end > start:
            out.append((start, end))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The points covered by a and not by b."""
    cut = union(b)
    out: list[Interval] = []
    for start, end in union(a):
        cursor = start
        for cut_start, cut_end in cut:
            if cut_end <= cursor or cut_start >= end:
                continue
            if cut_start > cursor:
                out.append((cursor, cut_start))
            cursor = max(cursor, cut_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def measure(intervals: Iterable[Interval]) -> float:
    """Total length covered (overlaps counted once)."""
    return sum(end - start for start, end in union(intervals))


def gaps(intervals: Iterable[Interval], start: float, end: float) -> list[Interval]:
    """The pieces of [start, end] covered by none of `intervals`."""
    return subtract([(start, end)], intervals)


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommOverlap:
    """How much of the comm time ran with compute running beside it."""

    compute_busy_us: float
    comm_us: float
    exposed_comm_us: float
    hidden_comm_us: float
    overlap_ratio: float


@dataclass(frozen=True)
class WindowMetrics:
    """CommOverlap plus idle time, for one window (a rank's step, or a profiler trace)."""

    step_time_us: float
    overlap: CommOverlap
    idle_us: float
    idle_gaps: int

    def as_dict(self) -> dict[str, Any]:
        return {"step_time_us": self.step_time_us, **asdict(self.overlap),
                "idle_us": self.idle_us, "idle_gaps": self.idle_gaps}


def comm_overlap(
    compute: Iterable[Interval], comm: Iterable[Interval], hiding: Iterable[Interval] | None = None
) -> CommOverlap:
    """Busy times of `compute` and `comm`; exposure of `comm` against `hiding` (default compute)."""
    compute_u, comm_u = union(compute), union(comm)
    hiding_u = compute_u if hiding is None else union(hiding)
    comm_us = measure(comm_u)
    hidden_us = measure(intersect(comm_u, hiding_u))
    exposed_us = measure(subtract(comm_u, hiding_u))
    ratio = hidden_us / comm_us if comm_us > 0 else 1.0
    return CommOverlap(measure(compute_u), comm_us, exposed_us, hidden_us, ratio)


def window_metrics(
    compute: Sequence[Interval], comm: Sequence[Interval], start: float, end: float
) -> WindowMetrics:
    """Overlap and idle figures for the window [start, end]."""
    idle = gaps(list(compute) + list(comm), start, end)
    return WindowMetrics(end - start, comm_overlap(compute, comm), measure(idle), len(idle))


def lane_intervals(spans: Iterable[Span], lane: str) -> list[Interval]:
    return [(span.start_us, span.end_us) for span in spans if span.lane == lane]


def step_metrics(step: StepSpans) -> WindowMetrics:
    """A rank's figures for one step over the window [0, step_time_us]."""
    compute = lane_intervals(step.spans, "compute")
    comm = lane_intervals(step.spans, "comm")
    return window_metrics(compute, comm, 0.0, step.step_time_us)
