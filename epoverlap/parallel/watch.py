"""Liveness: a peer that dies or stalls ends this rank within the collective timeout, with one
line naming the step, the process group and the peer rank(s) that did not answer.

Owns `CollectiveWatch` (every collective of a run is issued inside `watch.collective(...)`),
`Heartbeat` (each rank's counter in the rendezvous store) and `PeerFailure` (the one line).

Three ways a dead or stalled peer shows, each ending in a report (`report`, `report_signal`)
that names the silent peers (heartbeats that did not move), prints one line and exits with
status 3; the first report of a process is the only one that prints:

  1. the collective raises (gloo: "Connection closed by peer" within a second of a SIGKILL, or
     its own timeout): `collective` turns the backend error into a `PeerFailure` carrying the
     step, group and op. On the CPU comm lane that happens on the comm thread; the executor
     hands the exception to the main thread (`Future.result`), and the entry point reports it;
  2. nothing raises: a monitor thread sees the oldest unfinished collective older than the
     timeout less a margin while some peer's heartbeat stands still, and reports. This is the
     path of a SIGSTOPped peer, and on NCCL of any silent peer: there the host never blocks in
     the collective (it is queued on a stream; completion is a CUDA event recorded after it),
     and the margin lets the monitor name the peer before NCCL's watchdog (same timeout,
     TORCH_NCCL_ASYNC_ERROR_HANDLING=3) tears the process down without naming it;
  3. the launcher sends SIGTERM because another rank exited: the report names the collective in
     flight, if any. The entry point routes the signal to the monitor thread (`take_signals`:
     Python's wakeup fd), so it is handled even while the main thread is blocked in C++ (a
     CUDA synchronize behind a stuck NCCL kernel), where a Python handler would never run.

A SIGTERM or SIGINT with every peer still beating is a stop for the whole job (a scheduler,
Ctrl-C): the watch hands it at once to the training loop's `stop_handler`, which stops every
rank after the same step, and probes the peers meanwhile: a silent one turns the signal into
its failure (`on_signal`); the heartbeats go on meanwhile, so no peer is called silent.

Collectives captured in a CUDA graph are issued by its replays, not by the calls made while
capturing: those are not tracked (`collective`), and the caller wraps each replay of a graph
that holds collectives instead (`Group.watched`).

A heartbeat is a counter per rank in the rendezvous store (torchrun's agent store, or rank 0's
store), bumped by the monitor thread every `interval_s`; a process whose counter did not move
over a window of a few intervals is stopped or dead. Each rank also writes its host there
(`host_label`), so a report whose silent ranks are all of a host's ranks names that host as
lost (a node down, not a rank). Only liveness goes through the store;
the heartbeat thread uses its own client connection, never the process groups' one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import select
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from epoverlap.parallel.transport import nccl_host_identity

EXIT_PEER_FAILURE = 3
ROUTED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Backend errors that mean a peer or the transport failed (not a bug in the caller's tensors).
_TRANSPORT_ERROR = re.compile(r"timed out|timeout|connection (closed|reset|refused)|"
                              r"pair closure|broken pipe|nccl|socket|aborted", re.IGNORECASE)


def host_list(values: torch.Tensor):
    """`values.tolist()`, read from a CUDA tensor through pinned memory: a non-blocking copy
    and a wait on an event recorded after it (the wait releases the GIL and holds no CUDA lock).

    A plain `.tolist()` of a CUDA tensor is a synchronous copy to pageable memory. Behind a
    collective that never ends (a dead peer) it blocks inside the driver in a way that also
    blocked the monitor thread's `Event.query()`, which holds the GIL meanwhile: with a peer
    SIGKILLed mid-collective (the survivor's stacks dumped with SIGUSR1) the monitor then could
    neither answer the launcher's SIGTERM nor report at the timeout, and the rank died by
    SIGKILL without naming the peer; through here it names it (tests/parallel/test_liveness.py,
    NCCL). A long sleep kernel on one GPU does not reproduce the block (`Event.query()` stays
    prompt beside a plain `.tolist()`), so the NCCL test is the proof. Every host read of the
    training loop goes through here."""
    if values.device.type != "cuda":
        return values.tolist()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    copied.synchronize()
    return host.tolist()


def ranks_text(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 6] -> '0-3,6'; [0, 1] -> '0,1'."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run))
                    for run in runs)


def short_cause(error: BaseException) -> str:
    """The first sentence of a backend error, without gloo's `[file.cc:123] ` prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". ")[0][:160]


def host_label() -> str:
    """The host a rank runs on, as a failure names it: its NCCL host identity when one is set
    (`--emulate-hosts`), else the host name; with torchrun's nodes, the node's index too (two
    "nodes" of one machine, or hosts sharing a name)."""
    label = nccl_host_identity()
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        label += f" (node {os.environ.get('GROUP_RANK', '?')})"
    return label


def lost_hosts(silent: Sequence[int], hosts: Sequence[Optional[str]],
               me: int) -> list[tuple[str, list[int]]]:
    """The hosts (other than rank `me`'s) all of whose ranks are `silent`, with those ranks."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        if host is not None:
            by_host.setdefault(host, []).append(rank)
    return [(host, ranks) for host, ranks in by_host.items()
            if hosts[me] != host and set(ranks) <= set(silent)]


@dataclass(eq=False)
class PeerFailure(RuntimeError):
    """A collective that could not complete because a peer failed, with where and who."""

    rank: int
    step: int
    what: str  # "expert-parallel group (ranks 0,1) all_to_all failed (...)", etc.
    silent: Optional[list[int]] = None  # filled by the report; None: not probed yet
    silent_for_s: float = 0.0
    store_answers: bool = True
    peers: tuple[int, ...] = ()  # the other ranks of the group in question, if any
    hosts_lost: list = field(default_factory=list)  # (host, its ranks): every one silent

    def __post_init__(self):
        RuntimeError.__init__(self, self.what)

    def __str__(self) -> str:
        return f"{self.where_text()}: {self._who()}"

    def where_text(self) -> str:
        """'rank R: step S: what happened', without who was silent."""
        step = f"step {self.step}" if self.step > 0 else "before step 1"
        return f"rank {self.rank}: {step}: {self.what}"

    def _who(self) -> str:
        if not self.store_answers:  # no heartbeat to read: the group tells what it can
            gone = "the rendezvous store is gone too, so no heartbeat tells"
            if len(self.peers) == 1:
                return f"rank {self.peers[0]} did not answer (the group's other rank; {gone} more)"
            if self.peers:
                return f"one of ranks {ranks_text(self.peers)} did not answer ({gone} which)"
            return f"some peer did not answer ({gone} which)"
        if self.silent is None:
            return "peers not probed"
        if not self.silent:
            return ("every peer still sends heartbeats (a mismatched collective, or a peer "
                    "stuck elsewhere)")
        noun = "rank" if len(self.silent) == 1 else "ranks"
        lost = "".join(f"; host {host} lost (all its ranks: {ranks_text(ranks)})"
                       for host, ranks in self.hosts_lost)
        return (f"{noun} {ranks_text(self.silent)} did not answer (no heartbeat in the last "
                f"{self.silent_for_s:.1f} s: dead or stopped){lost}")


class Heartbeat:
    """This rank's counter in the rendezvous store; reads of every rank's counter."""

    def __init__(self, rank: int, world_size: int, host: str, port: int,
                 store_timeout_s: float = 5.0, attempt: Optional[str] = None):
        """`attempt`: the same on every rank of this start of the job (default: torchrun's
        restart count), so a restarted job's keys never meet the dead attempt's."""
        self.rank, self.world_size = rank, world_size
        if attempt is None:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=store_timeout_s))
        self._store = dist.PrefixStore(f"epoverlap/heartbeat/{attempt}", client)
        self.store_gone = False  # set at the first failed store call; no call is tried after
        self._call(lambda: self._store.set(f"host/{rank}", host_label()))

    @classmethod
    def from_env(cls, rank: int, world_size: int, attempt: Optional[str] = None
                 ) -> "Heartbeat":
        return cls(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                   attempt=attempt)

    def beat(self) -> None:
        self._call(lambda: self._store.add(str(self.rank), 1))

    def counters(self) -> Optional[list[int]]:
        """Every rank's count, or None when the store does not answer."""
        return self._call(lambda: [self._store.add(str(r), 0) for r in range(self.world_size)])

    def hosts(self) -> Optional[list[Optional[str]]]:
        """Every rank's `host_label` as it published it (None for a rank that never did), or
        None when the store does not answer."""
        keys = [f"host/{r}" for r in range(self.world_size)]
        return self._call(lambda: [self._store.get(key).decode()
                                   if self._store.check([key]) else None for key in keys])

    def _call(self, work):
        if self.store_gone:
            return None
        try:
            return work()
        except (RuntimeError, dist.DistError):  # the store's host is gone: say it once
            self.store_gone = True
            return None


@dataclass
class _InFlight:
    """One issued collective: done (CPU: the call returned) or its CUDA completion event."""

    where: str
    peers: tuple[int, ...]  # the group's other ranks
    started: float
    done: bool = False
    event: Optional[torch.cuda.Event] = None
    probed: bool = False

    def finished(self) -> bool:
        return self.done or (self.event is not None and self.event.query())


@dataclass
class WatchTiming:
    """When the monitor looks: derived from the collective timeout (seconds)."""

    timeout_s: float
    interval_s: float = field(init=False)
    window_s: float = field(init=False)
    fire_at_s: float = field(init=False)

    def __post_init__(self):
        self.window_s = min(3.0, self.timeout_s / 4)  # silence observed over this long
        self.interval_s = self.window_s / 3  # >= 3 heartbeats per window
        self.fire_at_s = self.timeout_s - min(2.0, self.timeout_s / 8)


class CollectiveWatch:
    """Tracks collectives in flight, runs the heartbeat/monitor thread, reports failures."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, on_gpu: bool,
                 heartbeat: Optional[Heartbeat] = None,
                 exit_process: Callable[[int], None] = os._exit):
        self.rank, self.world_size, self.on_gpu = rank, world_size, on_gpu
        self.timing = WatchTiming(timeout_s)
        self.heartbeat = heartbeat
        self.step = 0  # set by the trainer at the start of each step
        self._exit = exit_process
        self._pending: deque[_InFlight] = deque()
        self._lock = threading.Lock()
        self._reporting = threading.Lock()  # acquired once, by the first report; never released
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._signal_fd: Optional[int] = None
        self._last_failed: Optional[_InFlight] = None  # the last collective a transport failed
        # the training loop's stop request (a signal, no silent peer): stop after this step
        self.stop_handler: Optional[Callable[[str], None]] = None
        self._stop_requested = False

    # ------------------------------------------------------------------ collectives
    @contextlib.contextmanager
    def collective(self, group_name: str, ranks: Sequence[int], op: str):
        """Wrap one collective call: track it, and turn a transport error into PeerFailure.

        A call made while the current CUDA stream captures a graph is not tracked: it issues
        nothing (the graph's replays do; their callers wrap each replay, `Group.watched`), and
        an event recorded in a capture may not be queried (the query from the monitor thread
        would invalidate the capture and fail on every later tick).

        The hot path (`Group.all_to_all_single`, several hundred calls a step) uses `begin` /
        `end` / `failed` directly with a description built once, not this generator."""
        entry = self.begin(*self.target(group_name, ranks, op))
        try:
            yield
        except BaseException as error:
            self.failed(entry, error)
        self.end(entry)

    def target(self, group_name: str, ranks: Sequence[int], op: str
               ) -> tuple[str, tuple[int, ...]]:
        """(where, peers) of a collective: its description in reports, and the other ranks
        it waits on; what `begin` takes (made once per group by the hot path)."""
        return (f"{group_name} group (ranks {ranks_text(ranks)}) {op}",
                tuple(r for r in ranks if r != self.rank))

    def begin(self, where: str, peers: tuple[int, ...]) -> Optional[_InFlight]:
        """Track a collective about to be issued (None while a CUDA graph captures)."""
        if self.on_gpu and torch.cuda.is_current_stream_capturing():
            return None
        entry = _InFlight(where, peers, time.monotonic())
        with self._lock:
            while self._pending and self._pending[0].done:  # host-finished: no event to query
                self._pending.popleft()
            self._pending.append(entry)
        return entry

    def end(self, entry: Optional[_InFlight]) -> None:
        """The collective was issued: on GPU its completion is an event recorded after it on
        the current stream; on CPU it has finished."""
        if entry is None:
            return
        if self.on_gpu:
            event = torch.cuda.Event()
            event.record()
            entry.event = event
        else:
            entry.done = True

    def failed(self, entry: Optional[_InFlight], error: BaseException) -> None:
        """The collective raised `error`: re-raise it, as a `PeerFailure` naming the group and
        op when it is a transport error."""
        if entry is None:
            raise error
        entry.done = True
        if (not isinstance(error, RuntimeError) or isinstance(error, PeerFailure)
                or not _TRANSPORT_ERROR.search(str(error))):
            raise error
        self._last_failed = entry
        raise PeerFailure(self.rank, self.step, f"{entry.where} failed "
                          f"({short_cause(error)})", peers=entry.peers) from error

    def oldest_unfinished(self) -> Optional[_InFlight]:
        with self._lock:
            while self._pending and self._pending[0].finished():
                self._pending.popleft()
            return self._pending[0] if self._pending else None

    # ------------------------------------------------------------------ reports
    def probe(self, failure: PeerFailure, baseline: Optional[tuple[float, list[int]]] = None
              ) -> PeerFailure:
        """Fill in who is silent: counters that did not move since `baseline` (or over a
        fresh window of `timing.window_s`)."""
        if self.heartbeat is None:
            failure.silent = []
            return failure
        if baseline is None:
            start, before = time.monotonic(), self.heartbeat.counters()
            self._beat_for(self.timing.window_s)
        else:
            start, before = baseline
        after = self.heartbeat.counters()
        if before is None or after is None:
            failure.store_answers = False
            return failure
        failure.silent = [r for r in range(self.world_size)
                          if r != self.rank and after[r] == before[r]]
        failure.silent_for_s = time.monotonic() - start
        hosts = self.heartbeat.hosts() if failure.silent else None
        if hosts is not None:
            failure.hosts_lost = lost_hosts(failure.silent, hosts, self.rank)
        return failure

    def _beat_for(self, seconds: float) -> None:
        """Wait `seconds`, still beating: every rank that gets a signal at once probes at once,
        and none may look silent to the others meanwhile."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._stop.wait(min(left, self.timing.interval_s)):
                return  # closed: the run is over, nothing to report
            with contextlib.suppress(RuntimeError, dist.DistError):
                self.heartbeat.beat()

    def report(self, failure: PeerFailure) -> None:
        """Print the one line and exit with status 3. Only the first report of a process
        prints; a later one (another thread) waits for the first one's exit."""
        if not self._reporting.acquire(blocking=False):
            while True:
                time.sleep(60)
        if failure.silent is None and failure.store_answers:
            self.probe(failure)
        self._emit(failure, EXIT_PEER_FAILURE)

    def on_signal(self, signum: int) -> None:
        """SIGTERM or SIGINT: a peer that died (the launcher stopping the job because a rank
        exited), or a stop for the whole job (a scheduler, Ctrl-C). With a training loop, its
        `stop_handler` is asked at once to stop after the step in progress (its flag rides in
        the step's stats reduction, so every rank learns of it at that reduction); then the
        peers are probed: a silent peer is reported as a failure (meanwhile the collective with
        it fails or stalls, so no rank gets past it), unless the run ended first (a reduction
        every rank took part in after the signal: all alive). Without a training loop the rank
        exits after the probe. Once per process."""
        name = signal.Signals(signum).name
        if self._reporting.locked() or self._stop_requested:
            return
        self._stop_requested = True
        handler = self.stop_handler
        if handler is not None:
            handler(name)
        failure = self.probe(PeerFailure(self.rank, self.step, ""))
        if self._stop.is_set():  # closed meanwhile: the run ended after the agreed step
            return
        if failure.silent or not failure.store_answers or handler is None:
            self.report_signal(name, failure)

    def report_signal(self, name: str, failure: PeerFailure) -> None:
        """A termination signal, `failure` the probe's finding: name the collective this rank
        is in and exit with status 3 when some peer is silent; else exit with 128 + the signal
        after one line from the first rank of the node. Returns at once when a report is
        already under way."""
        if not self._reporting.acquire(blocking=False):
            return
        entry, failed = self.oldest_unfinished(), self._last_failed
        if entry is not None:
            failure.what, failure.peers = f"stopped by {name} while in the {entry.where}", \
                entry.peers
        elif failed is not None:
            failure.what, failure.peers = f"stopped by {name} after the {failed.where} failed", \
                failed.peers
        else:
            failure.what = f"stopped by {name} with no collective in flight"
        if failure.silent or not failure.store_answers:
            self._emit(failure, EXIT_PEER_FAILURE)
        else:  # every peer alive, no training loop to stop after its step: one line a node
            self._exit_stopped(name)

    def _exit_stopped(self, name: str) -> None:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            when = "before training" if self.step == 0 else f"after step {self.step}"
            print(f"epoverlap-train: stopped by {name} {when}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._exit(128 + signal.Signals[name])

    def _emit(self, failure, status: int) -> None:
        print(f"epoverlap-train: error: {failure}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._exit(status)

    # ------------------------------------------------------------------ monitor thread
    def start(self) -> None:
        """Start beating and watching (a daemon thread); needs `heartbeat`."""
        if self.heartbeat is None or self._thread is not None:
            return
        self.heartbeat.beat()
        self._thread = threading.Thread(target=self._monitor, name="epoverlap-watch",
                                        daemon=True)
        self._thread.start()

    @property
    def monitoring(self) -> bool:
        """Whether the heartbeat/monitor thread runs (a world of more than one rank)."""
        return self._thread is not None

    def take_signals(self, read_fd: int) -> None:
        """Read signal numbers from `read_fd` (the read end of `signal.set_wakeup_fd`'s pipe)
        on the monitor thread; a SIGTERM there is reported like a failure."""
        self._signal_fd = read_fd

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _monitor(self) -> None:
        baseline: Optional[tuple[float, list[int]]] = None
        while self._sleep():
            with contextlib.suppress(RuntimeError, dist.DistError):
                self.heartbeat.beat()
            baseline = self._check(baseline)

    def _sleep(self) -> bool:
        """Wait one interval, or less when a signal arrives; False once closed."""
        if self._signal_fd is None:
            return not self._stop.wait(self.timing.interval_s)
        ready, _, _ = select.select([self._signal_fd], [], [], self.timing.interval_s)
        if ready:
            for signum in os.read(self._signal_fd, 64):
                if signum in ROUTED_SIGNALS:
                    self.on_signal(signum)
        return not self._stop.is_set()

    def _check(self, baseline):
        """One monitor tick: watch the oldest unfinished collective; report a stall."""
        entry = self.oldest_unfinished()
        if entry is None or entry.probed:
            return None
        age = time.monotonic() - entry.started
        if age < self.timing.fire_at_s - self.timing.window_s:
            return None
        if baseline is None:
            counters = self.heartbeat.counters()
            return None if counters is None else (time.monotonic(), counters)
        if age < self.timing.fire_at_s:
            return baseline
        entry.probed = True
        failure = self.probe(PeerFailure(
            self.rank, self.step, f"{entry.where} has waited {age:.0f} s of its "
            f"{self.timing.timeout_s:.0f} s timeout", peers=entry.peers), baseline)
        if failure.silent or not failure.store_answers:
            self.report(failure)
        return None  # nobody is silent: the backend's own timeout ends the collective


def route_signals(watch: CollectiveWatch) -> None:
    """Hand SIGTERM and SIGINT to `watch.on_signal` (call once, from the main thread of an
    entry point, after `watch.start()`).

    torchrun's agent sends SIGTERM to every rank once one rank exits, and forwards a signal it
    gets itself (a scheduler's SIGTERM, Ctrl-C's SIGINT): the watch tells the two apart by the
    peers' heartbeats. Python runs signal handlers on the main thread only, which may be
    blocked in C++ for as long as the collective timeout (a CUDA synchronize behind a stuck
    NCCL kernel); so with a monitor thread the handler does nothing itself, and the monitor,
    woken through Python's wakeup fd, acts. A world of one has no monitor: its handler acts."""
    if watch.monitoring:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        watch.take_signals(read_fd)
        handler = _routed_elsewhere
    else:
        def handler(signum, frame):
            watch.on_signal(signum)
    for signum in ROUTED_SIGNALS:
        signal.signal(signum, handler)


def _routed_elsewhere(signum, frame) -> None:
    pass  # the monitor thread acts on it (route_signals)
