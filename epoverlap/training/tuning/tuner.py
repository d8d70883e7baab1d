"""The measured path tuner (`--tune`): which path this run is fastest with.

The combined 1F1B hides the all-to-alls behind the other microbatch's compute, but it costs the
host more per step (interleaved microbatches, a second lane with its events) and its kernels
share the GPU with the communication kernels; delayed weight grads fill the comm gaps but add
launches; the paired-ends plan overlaps the step's ends for one microbatch's activations more.
Which wins depends on the shape, the interconnect and whether the step is host-bound (the
measured figures are in the benchmarks' reports). Every path gives the same bits (the overlap
contract, docs/overlap.md), so a run may take any of them at any step boundary without changing
its losses; the paths are listed by `config.tuning` (the pinned axes left out).

The tuner uses that: the run's first step (compiles, allocator warm-up) runs the first path
untimed; with CUDA graphs (--cuda-graph-impl local or full_iteration: a bank per path, each
captured in its own plan's order, in its own memory pool) the first path's graphs are captured
after the graphs' warm-up steps and every other path then runs one untimed step that records
its graphs (`prime`, captured after that step). Then the paths take turns, round-robin in their
fixed order, until each has --tune-steps timed steps; each step's time is its slowest rank's (one
all-reduce MAX of every timed step at the decision, so every rank decides alike) and the lowest
median wins; a tie keeps the earlier path (the flags' own first). The tuning steps are real training
steps. A path whose graph capture fails on any rank is dropped on every rank (`drop`, agreed by an
all-reduce in `training.loop.step`) and the run goes on; the losing paths' graph banks are released
after the decision. A decision from --tune-cache (`training.tuning.tune_cache`) is taken at once
(`Tuner(cached=...)`): no path is timed.

Where the paths' graph banks do not fit side by side (a full-iteration graph holds a whole
iteration's activations: `fits_beside` after the first capture, agreed over the ranks), the
paths are timed in turn (`take_turns`): each path's untimed step that records its graphs, then
its timed steps, then the next path's, only the path in turn holding its bank (the trainer
releases the others; the chosen path's graphs are captured again after the decision). Steps
that drift between the paths' blocks weigh more than in the round-robin, the price of fitting.

Owns `Tuner` (which path each step runs, the timings, the decision), `PathTiming` and
`TuneDecision` (the decision's table, its --log-json record). The paths' plans, lanes and graph
banks are built in `training.loop.build` (`training.loop.path`), and `training.loop.step` runs
each step by the path named here for it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

WARMUP, PRIME, TIMED = "warmup", "prime", "timed"


@dataclass(frozen=True)
class PathTiming:
    """One path's timed steps, each its slowest rank's time in seconds."""

    name: str
    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def record(self) -> dict:
        ms = [s * 1e3 for s in self.seconds]
        return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
                "steps": len(ms)}


@dataclass
class TuneDecision:
    """What the tuner chose and from what: the timed paths in their order, the window's first
    and last step, the paths dropped (name -> why), and the cache file it came from."""

    chosen: str
    timings: list[PathTiming]
    window: Optional[tuple[int, int]] = None
    dropped: dict[str, str] = field(default_factory=dict)
    cache_file: Optional[str] = None
    cached_rows: Optional[dict] = None  # from a cache file: name -> its record()

    def rows(self) -> dict[str, dict]:
        """name -> {median_ms, min_ms, max_ms, steps} of every timed path."""
        if self.cached_rows is not None:
            return self.cached_rows
        return {t.name: t.record() for t in self.timings}

    def record(self) -> dict:
        """The `tuned_path` field of the --log-json record (and the cache file's body)."""
        return {"chosen": self.chosen, "cached": self.cache_file is not None,
                "cache_file": self.cache_file,
                "window": list(self.window) if self.window else None,
                "paths": self.rows(), "dropped": dict(self.dropped)}

    def table(self) -> list[str]:
        """The decision as a table of one screen (rank 0 prints it)."""
        if self.cache_file is not None:
            head = f"tune: cached {self.chosen} ({self.cache_file})"
        elif self.window is not None:
            head = (f"tune: steps {self.window[0]}-{self.window[1]}, each path's step time on "
                    f"the slowest rank (ms): {self.chosen} for the rest of the run")
        else:
            head = f"tune: {self.chosen}, the only path left, for the rest of the run"
        width = max([len(n) for n in [*self.rows(), *self.dropped]] + [4])
        lines = [head, f"  {'path':<{width}}  {'median':>9}  {'min':>9}  {'max':>9}  steps"]
        mark = "chosen (cached)" if self.cache_file is not None else "chosen"
        for name, row in self.rows().items():
            lines.append(f"  {name:<{width}}  {row['median_ms']:9.1f}  {row['min_ms']:9.1f}  "
                         f"{row['max_ms']:9.1f}  {row['steps']:5d}"
                         f"{'  ' + mark if name == self.chosen else ''}")
        for name, why in self.dropped.items():
            lines.append(f"  {name:<{width}}  dropped: {why}")
        return lines


class Tuner:
    """The paths' turns and timings. `names`: the paths in their fixed order; `first_step`: the
    last step of the untimed warm-up (the first path runs every step up to it); `prime`: each
    other path runs one untimed step first (its CUDA graphs are recorded there); `cached`: the
    decision is already made (a --tune-cache file), no path is timed."""

    def __init__(self, names: list[str], steps: int, first_step: int, prime: bool = False,
                 cached: Optional[TuneDecision] = None):
        if steps < 1:
            raise ValueError(f"the tuner needs at least one timed step per path, got {steps}")
        if not names:
            raise ValueError("the tuner needs at least one path")
        self.names, self.steps, self.first_step, self.prime = list(names), steps, first_step, prime
        self.primed = {self.names[0]}
        self.times: dict[str, list[float]] = {name: [] for name in self.names}
        self.timed: list[tuple[str, float]] = []  # every timed step, in order
        self.phases: dict[int, tuple[str, str]] = {}  # step -> (path, phase)
        self.dropped: dict[str, str] = {}
        self.decision = cached
        self.in_turn = False  # `take_turns`: one path after another
        # the window as planned (no path dropped): for the run's description
        self.start = first_step + 1 + (len(self.names) - 1 if prime else 0)
        self.end = self.start + steps * len(self.names) - 1

    @property
    def chosen(self) -> Optional[str]:
        return None if self.decision is None else self.decision.chosen

    @property
    def cached(self) -> bool:
        return self.decision is not None and self.decision.cache_file is not None

    def path_for(self, step: int) -> str:
        """The path step `step` runs (asked once per step; a repeat gives the same path)."""
        if step in self.phases:
            return self.phases[step][0]
        if self.decision is not None:
            return self.decision.chosen
        if step <= self.first_step:
            name, phase = self.names[0], WARMUP
        elif self.in_turn:  # the first path short of its timed steps, primed first
            turns = self._timed_turns()
            name = next(n for n in self.names if turns[n] < self.steps)
            phase = TIMED if name in self.primed else PRIME
            self.primed.add(name)
        elif self.prime and any(n not in self.primed for n in self.names):
            name, phase = next(n for n in self.names if n not in self.primed), PRIME
            self.primed.add(name)
        else:  # round-robin: the earliest path with the fewest timed turns so far
            turns = self._timed_turns()
            name, phase = min(self.names, key=turns.__getitem__), TIMED
        self.phases[step] = (name, phase)
        return name

    def _timed_turns(self) -> dict[str, int]:
        turns = {n: 0 for n in self.names}
        for given, phase in self.phases.values():
            if phase == TIMED and given in turns:
                turns[given] += 1
        return turns

    def take_turns(self) -> None:
        """From the next step on, time the paths one after another (module docstring); a path
        primed before, other than the first, is primed again in its turn."""
        if self.decision is None and not self.in_turn:
            self.in_turn = True
            self.primed &= {self.names[0]}  # the others' graphs are released meanwhile

    def steps_of(self, name: str) -> set[int]:
        """The steps path `name` ran, of those the tuner gave a path to."""
        return {step for step, (given, _) in self.phases.items() if given == name}

    def phase_of(self, step: int) -> Optional[str]:
        """warmup, prime or timed for a step the tuner gave a path to; None after the
        decision."""
        return self.phases.get(step, (None, None))[1]

    def record(self, step: int, seconds: float,
               slowest: Callable[[list[float]], list[float]]) -> Optional[TuneDecision]:
        """Record a timed step's time; once every path has its steps, decide. `slowest` maps
        this rank's times of every timed step so far to their maximum over every rank (an
        all-reduce: every rank calls it at the same step). -> the decision at the step that
        makes it, else None."""
        if self.decision is not None or self.phase_of(step) != TIMED:
            return None
        name = self.phases[step][0]
        self.times[name].append(seconds)
        self.timed.append((name, seconds))
        if any(len(self.times[n]) < self.steps for n in self.names):
            return None
        return self._decide(slowest([s for _, s in self.timed]))

    def _decide(self, worst: list[float]) -> TuneDecision:
        per_path: dict[str, list[float]] = {name: [] for name in self.names}
        for (name, _), seconds in zip(self.timed, worst, strict=True):
            per_path[name].append(seconds)
        timings = [PathTiming(name, tuple(per_path[name])) for name in self.names]
        best = timings[0]
        for timing in timings[1:]:
            if timing.median < best.median:  # a tie keeps the earlier path
                best = timing
        window = (min(s for s, (_, p) in self.phases.items() if p == TIMED),
                  max(s for s, (_, p) in self.phases.items() if p == TIMED))
        self.decision = TuneDecision(best.name, timings, window, dict(self.dropped))
        return self.decision

    def drop(self, name: str, why: str) -> Optional[TuneDecision]:
        """Drop path `name` (its graphs could not be captured; every rank drops it at the same
        step). The last path left is chosen without timing (-> that decision, else None).
        Nothing is dropped after the decision, nor the only path."""
        if self.decision is not None or name not in self.names or len(self.names) == 1:
            return None
        self.names.remove(name)
        del self.times[name]
        self.timed = [(n, s) for n, s in self.timed if n != name]
        self.dropped[name] = why
        if len(self.names) > 1:
            return None
        self.decision = TuneDecision(self.names[0], [], None, dict(self.dropped))
        return self.decision

    def losers(self) -> list[str]:
        """Every path but the chosen one (before the decision: none)."""
        if self.decision is None:
            return []
        return [name for name in self.names if name != self.decision.chosen]

    def describe(self) -> str:
        """' (tuned: N paths x S steps, ...)' for the run's description line."""
        if self.cached:
            return f" (tuned: cached {self.chosen})"
        primed = (f", each path's CUDA graphs captured by step {self.start - 1}"
                  if self.prime else "")
        return (f" (tuned: {len(self.names)} paths, {self.steps} timed step(s) each, steps "
                f"{self.start}-{self.end}{primed})")


def fits_beside(bank_bytes: int, free_bytes: Optional[int], others: int) -> bool:
    """Whether `others` more graph banks of `bank_bytes` each fit in `free_bytes` of device
    memory, with room for the eager step that records each (about a bank's size again).
    Unknown free memory (no CUDA device) fits."""
    return free_bytes is None or free_bytes >= bank_bytes * (others + 1)
