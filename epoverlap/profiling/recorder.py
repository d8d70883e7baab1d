"""Span recording in the runtime: what each executed action did, when, on which lane.

Owns `SpanRecorder`. Off by default; on for the steps given by `--profile-steps START:END`.
Each action the executor runs is wrapped in `recorder.span(action, lane)`:
  - GPU: a pair of CUDA events recorded on the lane's stream (no host sync inside the step),
    read back after the step, plus an NVTX range with the action's name for nsys users;
  - CPU: host clock (time.perf_counter) read on the thread that runs the action.
After the profiled steps, `write` stores one file per rank in the `epoverlap-spans` format
(epoverlap/profiling/spans.py, docs/span-format.md), which `epoverlap-timeline` reads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Optional

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
    def span(self, action, lane: str):
        if not self._active:
            yield
            return
        name = str(action)
        if self.on_gpu:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            torch.cuda.nvtx.range_push(name)
            start.record()
            try:
                yield
            finally:
                end.record()
                torch.cuda.nvtx.range_pop()
        else:
            start = time.perf_counter()
            try:
                yield
            finally:
                end = time.perf_counter()
        with self._lock:
            self._raw.append((lane, name, start, end))

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
            spans = [Span.from_action(lane, name, offset(s) * 1e3, offset(e) * 1e3)
                     for lane, name, s, e in self._raw]
            step_time = offset(stop) * 1e3
        else:
            t0 = self._t0
            spans = [Span.from_action(lane, name, (s - t0) * 1e6, (e - t0) * 1e6)
                     for lane, name, s, e in self._raw]
            step_time = (time.perf_counter() - t0) * 1e6
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
