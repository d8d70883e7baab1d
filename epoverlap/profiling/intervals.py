"""Interval math for timelines: pure functions on lists of (start, end) intervals.

Owns `union`, `intersect`, `subtract`, `measure`, `gaps`. Results are sorted, disjoint,
non-touching and of positive length ("normalized"). Used by the trainer's end-of-run summary
(exposed communication of the profiled steps) and by the timeline tool.
"""

from __future__ import annotations

from typing import Iterable

Interval = tuple[float, float]


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
