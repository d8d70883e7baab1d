"""Span recording in the runtime: what each executed action did, when, on which lane.

Owns `SpanRecorder`. Off by default; on for the steps given by `--profile-steps START:END`.
Each action the executor runs is wrapped in `recorder.span(action, lane, wait)`, which marks
`queued` (the lane reached the action: its earlier work on this lane done, the host has issued
it), calls `wait()` (the lane's wait for the action's microbatch on the other lane: inputs not
ready yet), marks `start`, runs the action and marks `end`. So `start - queued` is the time the
action waited on the other lane and `end - start` the time it ran:
  - GPU: CUDA events recorded on the lane's stream around its `wait_event` (no host sync inside
    the step), read back after the step, plus an NVTX range with the action's name for nsys;
  - CPU: host clock (time.perf_counter) read on the thread that runs the action.
After the profiled steps, `write` stores one file per rank in the `epoverlap-spans` format
(epoverlap/profiling/spans.py, docs/span-format.md), which `epoverlap-timeline` reads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from epoverlap.profiling.intervals import measure, subtract
from epoverlap.profiling.spans import Span, StepSpans, write_rank_span_file


class SpanRecorder:
    """Records spans of the actions of selected steps."""

    def __init__(self, device: torch.device, rank: int, world_size: int):
        self.device, self.rank, self.world_size = device, rank, world_size
        self.on_gpu = device.type == "cuda"
        self.steps: list[StepSpans] = []
        self._active = False
        self._lock = threading.Lock()
        self._raw: list = []
        self._step = 0
        self._t0: Optional[object] = None

    def begin_step(self, step: int) -> None:
        self._active, self._step, self._raw = True, step, []
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def span(self, action, lane: str, wait: Callable[[], None] = lambda: None):
        """Wait (on the other lane, through `wait`), then run the body; with recording on, mark
        queued / start / end around them (module docstring)."""
        if not self._active:
            wait()
            yield
            return
        name = str(action)
        if self.on_gpu:
            queued, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            torch.cuda.nvtx.range_push(name)
            try:
                queued.record()
                wait()  # a wait_event on this stream: `start` completes after it
                start.record()
                yield
            finally:
                end.record()
                torch.cuda.nvtx.range_pop()
        else:
            queued = time.perf_counter()
            wait()
            start = time.perf_counter()
            try:
                yield
            finally:
                end = time.perf_counter()
        with self._lock:
            self._raw.append((lane, name, queued, start, end))

    def end_step(self) -> Optional[StepSpans]:
        """Close the step (all lanes must be drained); convert raw marks to microseconds."""
        if not self._active:
            return None
        self._active = False
        if self.on_gpu:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            torch.cuda.synchronize(self.device)
            offset = self._t0.elapsed_time

            def us(mark) -> float:
                return offset(mark) * 1e3
            step_time = us(stop)
        else:
            t0 = self._t0

            def us(mark) -> float:
                return (mark - t0) * 1e6
            step_time = (time.perf_counter() - t0) * 1e6
        spans = [_span(lane, name, us(q), us(s), us(e)) for lane, name, q, s, e in self._raw]
        step_time = max([step_time] + [s.end_us for s in spans])
        record = StepSpans(step=self._step, step_time_us=step_time,
                           spans=sorted(spans, key=lambda s: s.start_us))
        self.steps.append(record)
        return record

    def mean_exposed_comm_ms(self) -> Optional[float]:
        """Comm-lane time with no compute running, mean over the recorded steps (None: none
        recorded). The timeline tool's exposed_comm_us, in ms."""
        if not self.steps:
            return None
        total_us = 0.0
        for step in self.steps:
            lanes = {lane: [(s.start_us, s.end_us) for s in step.spans if s.lane == lane]
                     for lane in ("compute", "comm")}
            total_us += measure(subtract(lanes["comm"], lanes["compute"]))
        return total_us / len(self.steps) / 1e3

    def write(self, directory: str) -> Optional[Path]:
        if not self.steps:
            return None
        clock = "cuda_event" if self.on_gpu else "host"
        return write_rank_span_file(directory, self.rank, self.world_size, str(self.device),
                                    clock, self.steps)


def _span(lane: str, name: str, queued_us: float, start_us: float, end_us: float) -> Span:
    """A span from its three marks (`queued` <= `start` by their order on one stream or
    thread; the min only guards the clock's rounding)."""
    return Span.from_action(lane, name, start_us, end_us, queued_us=min(queued_us, start_us))
