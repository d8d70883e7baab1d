"""The overlap probe (`--overlap-probe-steps N`): which schedule this run is faster with.

The combined 1F1B hides the all-to-alls behind the other microbatch's compute, but it costs
the host more per step (the interleaved microbatches, and a second stream with its events and
hand-overs) and its compute kernels share the GPU with the communication kernels. Where a step
is bound by the host (small microbatches, eager kernels) or the all-to-all takes SMs the GEMMs
need (NVLink), the overlapped step can be slower than the sequential one; which schedule wins
depends on the shape and the interconnect (the measured figures are in the benchmarks'
reports). Both schedules give the same bits (the overlap contract, docs/overlap.md), so a run
may take either at any step without changing its losses. The probe uses that: after the
first step (compiles, allocator warm-up), it runs N steps of each schedule, alternating
(overlap first), takes each schedule's median step time on the slowest rank (an all-reduce, so
every rank decides alike), and keeps the faster for the rest of the run. A tie keeps the
overlap.

With CUDA graphs (`--cuda-graph-impl local`, or `full_iteration`: one graph of the whole
plan) each schedule replays its own graphs (a bank per schedule, each captured in its plan's
order on its own lanes, in its own memory pool): the probe
then starts after the overlap's bank is captured (the graphs' warm-up steps), runs one
untimed sequential step that records the sequential bank (`prime`), and times replays only;
the losing schedule's bank is released after the decision.

Owns `OverlapProbe` (which schedule each step runs, the step times, the decision); the plans
and lanes it switches between are built in `training.build` and switched in `training.step`.
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

SEQUENTIAL = "sequential"


class OverlapProbe:
    """Alternates `overlap` (the configured overlap plan's name) and sequential over `steps`
    steps each, from the step after `first_step` (the run's first, untimed), then keeps the
    faster."""

    def __init__(self, steps: int, first_step: int, overlap: str, prime: bool = False):
        if steps < 1:
            raise ValueError(f"an overlap probe needs at least one step of each schedule, "
                             f"got {steps}")
        self.steps, self.overlap = steps, overlap
        # steps up to first_step run the overlap untimed (warm-up); with `prime`, the step
        # after it runs the sequential schedule untimed (its CUDA graphs are recorded there)
        self.prime_step = first_step + 1 if prime else None
        self.start = first_step + 1 + prime
        self.end = self.start + 2 * steps - 1  # the last probed step
        self.times: dict[str, list[float]] = {overlap: [], SEQUENTIAL: []}
        self.chosen: Optional[str] = None

    def schedule_for(self, step: int) -> str:
        """The schedule step `step` runs."""
        if self.chosen is not None:
            return self.chosen
        if step == self.prime_step or self.in_window(step) and (step - self.start) % 2 == 1:
            return SEQUENTIAL
        return self.overlap

    def losing(self) -> Optional[str]:
        """The schedule the decision dropped (None before it)."""
        if self.chosen is None:
            return None
        return SEQUENTIAL if self.chosen == self.overlap else self.overlap

    def in_window(self, step: int) -> bool:
        """Whether `step` is one of the probed steps."""
        return self.start <= step <= self.end

    def probing(self, step: int) -> bool:
        return self.chosen is None and self.in_window(step)

    def record(self, step: int, seconds: float,
               slowest: Callable[[list[float]], list[float]]) -> Optional[str]:
        """Record a probed step's time; at the last probed step, decide. `slowest` maps this
        rank's [overlap median, sequential median] to the maximum over every rank (an
        all-reduce: every rank must call it at the same step). Returns the decision's log line
        at the step that decides, else None."""
        if not self.probing(step):
            return None
        self.times[self.schedule_for(step)].append(seconds)
        if step != self.end:
            return None
        overlap_s, sequential_s = slowest([statistics.median(self.times[self.overlap]),
                                           statistics.median(self.times[SEQUENTIAL])])
        self.chosen = SEQUENTIAL if sequential_s < overlap_s else self.overlap
        return (f"overlap probe, steps {self.start}-{self.end}: {self.overlap} "
                f"{overlap_s * 1e3:.1f} ms, {SEQUENTIAL} {sequential_s * 1e3:.1f} ms per step "
                f"(median of {self.steps} each, slowest rank; overlap / sequential "
                f"{overlap_s / sequential_s:.3f}): {self.chosen} for the rest of the run")
