"""Communication overlap of one step from its spans: the step's figures.

Owns `step_metrics` (compute busy, comm, exposed and hidden comm, overlap ratio, idle time of
one rank's step, on the interval math of `profiling.intervals`) and `window_metrics` (the same
for any window, such as a profiler trace's). The trainer reports them for profiled steps
(TensorBoard); the timeline tool builds its tables on them (epoverlap/profiling/summary.py,
where the metric definitions are written out).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from epoverlap.profiling.intervals import (  # noqa: F401  (re-exported)
    Interval, gaps, intersect, measure, subtract, union)
from epoverlap.profiling.spans import Span, StepSpans

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
