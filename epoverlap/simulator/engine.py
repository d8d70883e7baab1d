"""The schedule simulator's engine: a plan replayed on two lanes per rank, ranks coupled by
their all-to-alls. Pure Python, no torch; `epoverlap/simulator/scenario.py` builds its inputs and
`epoverlap/cli/simulate.py` is the command around it.

Owns `simulate` and the three lane models, each the timing twin of one lane backend of
`epoverlap/schedule/executor.py`:

  serial  (`SerialLanes`)      one FIFO for every action (comm included), in plan order
  stream  (`CudaStreamLanes`)  a compute FIFO and a comm FIFO; one event per microbatch:
                               every F/B action waits for the end of the previous F/B action
                               of its microbatch (plan order, either lane) and becomes the new
                               end; W actions (compute lane) neither wait nor record
  thread  (`ThreadLanes`)      the compute lane IS the host thread (it runs compute actions one
                               after another); a comm action is handed to the comm thread (a
                               FIFO) when the host reaches it; a compute F/B action first waits
                               for the last comm action handed over for its microbatch; W
                               actions do not wait
  inline  (`SerialLanes` on a CPU)  every action, comm included, on the host thread in order

and the host that issues the actions. Serial and stream lanes (a GPU): the host walks the plan
in order, spends `host_us` on each action, and an action cannot start before the host issued it
nor end before the host finished issuing it (a launch-bound node lasts as long as its
launches). The forward dispatch reads its split sizes on the host (`HostSplitDispatcher.
dispatch`, the only host sync of a step): the exchange was started at the end of the node
before it in its microbatch's chain (the `attn` node, when the router has counted), on a
stream and communicator of its own, so it does not queue behind the comm lane; it is a
collective of its own, which starts when every rank's counts are ready (that node done) and
lasts `sync_us`. The host blocks in the read until then, and only then issues the
all-to-alls: the dispatch's collective cannot start before the read is done. Its span starts
where the recorder's does, when the comm lane reaches the node (before the read).
Thread and inline lanes (a CPU): the host thread runs the actions itself; `host_us` is
its time before an action outside any span (the executor's own Python, the wait for the GIL).

Every comm-lane action is an all-to-all over the EP group: it starts when every rank's comm lane
is ready for it (the lane free, its microbatch's dependencies met) and lasts `comm_us` on each
rank from that common start. A rank's recorded comm span runs from its own ready time to its
end, as the span recorder measures it (waiting for the peers included).

Times are microseconds; rank r starts its step at `start_us[r]` (default 0) and its step time is
its end minus its start, the end being when both its lanes and its host are done (the
executor's drain).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Generator, Optional, Protocol, Sequence

from epoverlap.model.nodes import COMM, COMPUTE
from epoverlap.schedule.plan import Action, Layout, action_lane, node_kinds

SERIAL, STREAM, THREAD, INLINE = "serial", "stream", "thread", "inline"
LANE_MODELS = (SERIAL, STREAM, THREAD, INLINE)
HOST_THREAD_LANES = (THREAD, INLINE)  # the host runs the actions (a CPU)


class Costs(Protocol):
    """Durations (us) the engine asks for, per rank and action."""

    def compute_us(self, rank: int, action: Action) -> float:
        """A compute-lane action's time on its lane (its kernels, or its CPU time)."""

    def comm_us(self, rank: int, action: Action) -> float:
        """A comm-lane action's time from the collective's common start to its end on `rank`."""

    def host_us(self, rank: int, action: Action) -> float:
        """Host time to issue the action (serial and stream lanes; 0: never the bottleneck)."""

    def sync_us(self, rank: int, action: Action) -> float:
        """For an action that reads split sizes on the host first: its exchange's time, from
        the exchange's common start to the host's read (the forward dispatch); 0 for every
        other action."""


@dataclass(frozen=True)
class SimSpan:
    lane: str
    action: Action
    start_us: float
    end_us: float


@dataclass
class RankTimeline:
    rank: int
    start_us: float
    end_us: float
    spans: list[SimSpan] = field(default_factory=list)

    @property
    def step_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class SimResult:
    ranks: list[RankTimeline]

    @property
    def step_us(self) -> float:
        """The step time: the slowest rank's."""
        return max(rank.step_us for rank in self.ranks)


# ---------------------------------------------------------------------------- lane models
class _SerialRank:
    """One FIFO for everything; the host issues in plan order (SerialLanes)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.host = t0
        self.free = {COMPUTE: t0, COMM: t0}
        self.event: dict[int, float] = {}  # microbatch -> end of its last F/B action
        self._issue = t0

    def _lane(self, lane: str) -> str:
        return COMPUTE  # both lanes are the one stream / thread

    def _wait_for(self, action: Action, chain: bool) -> float:
        return -math.inf

    def run_compute(self, action: Action, chain: bool, dev: float, host: float):
        issue = self.host
        lane = self._lane(COMPUTE)
        start = max(self.free[lane], issue, self._wait_for(action, chain))
        end = max(start + dev, issue + host)
        self.host = issue + host
        self.free[lane] = end
        self._recorded(action, chain, end)
        return start, end

    def counted(self, action: Action) -> float:
        """When this rank may start the action's split-size exchange: the node before it in
        its microbatch's chain (which counted the rows) done."""
        return self.event.get(action.microbatch, self.t0)

    def comm_ready(self, action: Action, host: float, read_done: float) -> tuple[float, float]:
        """(when the comm lane reaches the action: its span's start; when its collective may
        start: reached, and issued by the host after its read of the split sizes)."""
        reached = max(self.free[self._lane(COMM)], self.host, self._wait_for(action, True))
        self._issue = max(self.host, read_done)
        return reached, max(reached, self._issue)

    def comm_done(self, action: Action, start: float, dur: float, host: float):
        host_after = self._issue + host
        end = max(start + dur, host_after)
        self.host = host_after
        self.free[self._lane(COMM)] = end
        self._recorded(action, True, end)
        return end

    def _recorded(self, action: Action, chain: bool, end: float) -> None:
        if chain:
            self.event[action.microbatch] = end

    def finish(self) -> float:
        return max(self.host, *self.free.values())


class _StreamRank(_SerialRank):
    """A compute stream, a comm stream and one event per microbatch (CudaStreamLanes)."""

    def _lane(self, lane: str) -> str:
        return lane

    def _wait_for(self, action: Action, chain: bool) -> float:
        return self.event.get(action.microbatch, -math.inf) if chain else -math.inf


class _ThreadRank:
    """Compute on the host thread, comm on one worker thread (ThreadLanes)."""

    def __init__(self, t0: float):
        self.host = t0
        self.comm_free = t0
        self.pending: dict[int, float] = {}

    def run_compute(self, action: Action, chain: bool, dev: float, host: float):
        wait = self.pending.pop(action.microbatch, -math.inf) if chain else -math.inf
        start = max(self.host, wait) + host
        self.host = start + dev
        return start, self.host

    def comm_ready(self, action: Action, host: float, read_done: float) -> tuple[float, float]:
        self.host += host
        ready = max(self.comm_free, self.host)  # handed over when the host reaches it
        return ready, ready

    def comm_done(self, action: Action, start: float, dur: float, host: float):
        end = start + dur
        self.comm_free = end
        self.pending[action.microbatch] = end
        return end

    def finish(self) -> float:
        return max(self.host, self.comm_free)


class _InlineRank(_ThreadRank):
    """Everything on the host thread, comm included (SerialLanes on a CPU)."""

    def comm_ready(self, action: Action, host: float, read_done: float) -> tuple[float, float]:
        self.host += host
        return self.host, self.host

    def comm_done(self, action: Action, start: float, dur: float, host: float):
        self.host = start + dur
        return self.host


_RANK_MODELS = {SERIAL: _SerialRank, STREAM: _StreamRank, THREAD: _ThreadRank,
                INLINE: _InlineRank}


# ---------------------------------------------------------------------------- the engine
@dataclass(frozen=True)
class Exchange:
    """The split-size exchange of a comm action, a collective of its own (module docstring)."""

    action: Action

    def __str__(self) -> str:
        return f"split-size exchange of {self.action}"


_Program = Generator[tuple[object, float], float, RankTimeline]


def _rank_program(rank: int, plan: Sequence[Action], kinds: dict, costs: Costs, lanes: str,
                  t0: float) -> _Program:
    """One rank's replay; yields (collective, its ready time), is sent the common start."""
    model = _RANK_MODELS[lanes](t0)
    timeline = RankTimeline(rank, t0, t0)
    for action in plan:
        lane = action_lane(action, kinds)
        host = costs.host_us(rank, action)
        if lane == COMPUTE:
            start, end = model.run_compute(action, action.kind != "W",
                                           costs.compute_us(rank, action), host)
            timeline.spans.append(SimSpan(COMPUTE, action, start, end))
            continue
        sync = costs.sync_us(rank, action) if lanes not in HOST_THREAD_LANES else 0.0
        read_done = -math.inf
        if sync > 0:
            read_done = (yield Exchange(action), model.counted(action)) + sync
        reached, ready = model.comm_ready(action, host, read_done)
        start = yield action, ready
        end = model.comm_done(action, start, costs.comm_us(rank, action), host)
        timeline.spans.append(SimSpan(COMM, action, reached, end))
    timeline.end_us = model.finish()
    return timeline


def simulate(plan: Sequence[Action], layout: Layout, costs: Costs, num_ranks: int,
             lanes: str, start_us: Optional[Sequence[float]] = None) -> SimResult:
    """Replay `plan` on `num_ranks` ranks of one EP group; see the module docstring."""
    if lanes not in LANE_MODELS:
        raise ValueError(f"lanes {lanes!r}: allowed {', '.join(LANE_MODELS)}")
    starts = list(start_us) if start_us is not None else [0.0] * num_ranks
    if len(starts) != num_ranks:
        raise ValueError(f"start_us has {len(starts)} entries for {num_ranks} ranks")
    kinds = node_kinds(layout)
    programs = [_rank_program(r, plan, kinds, costs, lanes, starts[r]) for r in range(num_ranks)]
    timelines: list[Optional[RankTimeline]] = [None] * num_ranks
    pending = [_advance(p, None, timelines, r) for r, p in enumerate(programs)]
    while any(item is not None for item in pending):
        if any(item is None for item in pending):
            raise RuntimeError("ranks disagree on the plan's collectives")
        actions = {item[0] for item in pending}
        if len(actions) != 1:
            raise RuntimeError(f"ranks wait in different collectives: {sorted(map(str, actions))}")
        start = max(item[1] for item in pending)
        pending = [_advance(p, start, timelines, r) for r, p in enumerate(programs)]
    return SimResult([t for t in timelines if t is not None])


def _advance(program: _Program, value: Optional[float], timelines: list, rank: int):
    """Run a rank until its next collective (returned) or its end (None, timeline stored)."""
    try:
        return program.send(value) if value is not None else next(program)
    except StopIteration as done:
        timelines[rank] = done.value
        return None
