"""The lanes slowing each other down: a replay where an all-to-all runs `comm_factor` times
slower while its rank's compute lane is busy beside it (and a compute action `compute_factor`
times slower beside an all-to-all), for the share of it that has the other lane beside it.

Through host memory or a network, an all-to-all next to GEMMs takes longer than alone (the
copies and the GEMMs share SMs and memory bandwidth); the engine's lanes do not slow each other,
so it predicts an overlapped step too fast by about that stretch. The factors are inputs,
measured apart from the run predicted (the all-to-all timed beside a GEMM loop and alone:
benchmarks.harness.bench_a2a_links --beside-gemm).

Owns `simulate_contended`: which part of an action has the other lane beside it depends on the
replay itself, so it is a fixed point. Replay with the plain durations; stretch each action by
the share of its run that the other lane's spans of its rank cover; replay again from the base
durations with those stretches; until the step moves less than `TOLERANCE` or after `ROUNDS`
replays. Each action's stretch is the mean of its last two, so a run that swings between two
arrangements settles between them. Serial lanes (the sequential plan) have nothing beside
anything: the plain replay.
"""

from __future__ import annotations

from typing import Optional, Sequence

from epoverlap.model.nodes import COMM, COMPUTE
from epoverlap.schedule.plan import Action, Layout
from epoverlap.simulator.costs import NodeCosts
from epoverlap.simulator.engine import (HOST_THREAD_LANES, SERIAL, Costs, RankTimeline,
                                        SimResult, simulate)

ROUNDS = 8
TOLERANCE = 1e-4  # of the step time


def _stretched(costs: Costs, stretch: dict) -> NodeCosts:
    """`costs` with each (rank, action)'s device time multiplied by its stretch."""
    def scaled(duration):
        return lambda rank, action: duration(rank, action) * stretch.get((rank, action), 1.0)
    return NodeCosts(scaled(costs.compute_us), scaled(costs.comm_us), costs.host_us,
                     costs.sync_us)


def covered(start: float, end: float, intervals: Sequence[tuple[float, float]]) -> float:
    """The share of [start, end] that the union of `intervals` (sorted by start) covers."""
    if end <= start:
        return 0.0
    total, reach = 0.0, start
    for lo, hi in intervals:
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            total += hi - lo
            reach = hi
        if reach >= end:
            break
    return total / (end - start)


def _runs(timeline: RankTimeline, costs: Costs) -> list[tuple]:
    """(span, run start, run end) of one rank's replayed spans under `costs`: a compute span
    runs its whole span; a comm span runs from when its lane reached it, waiting for its peers
    included, so its transfer is its last `costs.comm_us` microseconds."""
    runs = []
    for span in timeline.spans:
        start = span.start_us
        if span.lane == COMM:
            start = max(start, span.end_us - costs.comm_us(timeline.rank, span.action))
        runs.append((span, start, span.end_us))
    return runs


def _stretches(timeline: RankTimeline, costs: Costs, factors: dict) -> dict:
    """(rank, action) -> stretch: 1 + (its lane's factor - 1) x the share of its run that the
    other lane's runs cover, on one rank replayed under `costs`."""
    runs = _runs(timeline, costs)
    busy = {lane: sorted((start, end) for span, start, end in runs if span.lane == lane)
            for lane in (COMPUTE, COMM)}
    stretch = {}
    for span, start, end in runs:
        factor = factors[span.lane]
        if factor != 1.0:
            share = covered(start, end, busy[COMM if span.lane == COMPUTE else COMPUTE])
            stretch[(timeline.rank, span.action)] = 1.0 + (factor - 1.0) * share
    return stretch


def simulate_contended(plan: Sequence[Action], layout: Layout, costs: Costs, num_ranks: int,
                       lanes: str, start_us: Optional[Sequence[float]] = None,
                       comm_factor: float = 1.0, compute_factor: float = 1.0) -> SimResult:
    """`engine.simulate` with the lanes slowing each other (module docstring)."""
    if comm_factor < 1.0 or compute_factor < 1.0:
        raise ValueError(f"slowdown factors below 1 (comm {comm_factor}, compute "
                         f"{compute_factor}): a lane does not speed up beside the other")
    result = simulate(plan, layout, costs, num_ranks, lanes, start_us)
    if (comm_factor, compute_factor) == (1.0, 1.0) or lanes == SERIAL \
            or lanes in HOST_THREAD_LANES:
        return result
    factors = {COMM: comm_factor, COMPUTE: compute_factor}
    stretch: dict = {}
    current = costs  # the costs `result` was replayed under
    for _ in range(ROUNDS - 1):
        found: dict = {}
        for timeline in result.ranks:
            found.update(_stretches(timeline, current, factors))
        stretch = {key: (value + stretch.get(key, value)) / 2 for key, value in found.items()}
        current = _stretched(costs, stretch)
        previous, result = result, simulate(plan, layout, current, num_ranks, lanes, start_us)
        if abs(result.step_us - previous.step_us) <= TOLERANCE * previous.step_us:
            break
    return result
