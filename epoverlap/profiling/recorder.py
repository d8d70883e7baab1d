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
After the forward-backward (`end_forward_backward`) the step's own parts are marked the same
way (`part(name)`: the gradients' all-reduce over data-parallel replicas on the comm lane, the
clip and the optimizer on the compute lane, `spans.STEP_PARTS`), and `end_step` closes the
whole step. Gradient buckets reduced beside the backward (--overlap-grad-reduce) are spans on
the comm lane (`grad_reduce.<bucket>`, node `grad_reduce`); the forward-backward then ends with
the plan's last action, and what the reduces run after it is the part `grad_reduce`
(`_reduce_tail`). After the profiled steps, `write` stores one file per rank in the `epoverlap-spans` format
(epoverlap/profiling/spans.py, docs/span-format.md), which `epoverlap-timeline` reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from epoverlap.profiling.intervals import measure, subtract
from epoverlap.profiling.spans import (STEP_PARTS, Span, StepPart, StepSpans,
                                       write_rank_span_file)
from epoverlap.schedule.grad_reduce import GRAD_REDUCE, ReduceAction


class SpanRecorder:
    """Records spans of the actions of selected steps."""

    def __init__(self, device: torch.device, rank: int, world_size: int,
                 local_copy_hold_us: float = 0.0):
        self.device, self.rank, self.world_size = device, rank, world_size
        self.local_copy_hold_us = local_copy_hold_us  # written to the file (spans.RankSpans)
        self.on_gpu = device.type == "cuda"
        self.steps: list[StepSpans] = []
        self._active = False
        self._lock = threading.Lock()
        self._raw: list = []
        self._parts: list = []
        self._step = 0
        self._t0: Optional[object] = None
        self._fb_end: Optional[object] = None

    def begin_step(self, step: int) -> None:
        self._active, self._step, self._raw, self._parts = True, step, [], []
        self._fb_end = None
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        self._t0 = self._mark()

    def _mark(self):
        """Now on this rank's clock: an event recorded on the current stream (GPU), or the host
        clock."""
        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end_forward_backward(self) -> None:
        """Mark the end of the executor's plan (the lanes joined into the current stream)."""
        if self._active:
            self._fb_end = self._mark()

    @contextlib.contextmanager
    def part(self, name: str):
        """Mark one of the step's parts after its forward-backward (`STEP_PARTS`)."""
        if not self._active:
            yield
            return
        start = self._mark()
        try:
            yield
        finally:
            self._parts.append((name, start, self._mark()))

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
            self._raw.append((lane, action, queued, start, end))

    def end_step(self) -> Optional[StepSpans]:
        """Close the step (all lanes must be drained); convert raw marks to microseconds. The
        forward-backward's window ends at `end_forward_backward` (here, if it was not marked);
        the whole step here."""
        if not self._active:
            return None
        self._active = False
        stop = self._mark()
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            offset = self._t0.elapsed_time

            def us(mark) -> float:
                return offset(mark) * 1e3
        else:
            t0 = self._t0

            def us(mark) -> float:
                return (mark - t0) * 1e6
        spans = [_span(lane, action, us(q), us(s), us(e)) for lane, action, q, s, e in self._raw]
        fb_end = us(self._fb_end if self._fb_end is not None else stop)
        spans, step_time, tail = _reduce_tail(spans, fb_end)
        parts = tail + [StepPart(name, STEP_PARTS[name], max(us(start), step_time),
                                 max(us(end), step_time)) for name, start, end in self._parts]
        whole = max([us(stop), step_time] + [p.end_us for p in parts]) if parts else None
        record = StepSpans(step=self._step, step_time_us=step_time,
                           spans=sorted(spans, key=lambda s: s.start_us),
                           whole_step_us=whole, parts=parts)
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
                                    clock, self.steps,
                                    local_copy_hold_us=self.local_copy_hold_us)


def _span(lane: str, action, queued_us: float, start_us: float, end_us: float) -> Span:
    """A span from its three marks (`queued` <= `start` by their order on one stream or
    thread; the min only guards the clock's rounding)."""
    queued_us = min(queued_us, start_us)
    if isinstance(action, ReduceAction):  # outside the action grammar: its fields given here
        return Span(lane, str(action), action.microbatch, action.bucket.layer, GRAD_REDUCE,
                    "backward", start_us, end_us, queued_us)
    return Span.from_action(lane, str(action), start_us, end_us, queued_us=queued_us)


def _reduce_tail(spans: list[Span], fb_end: float) -> tuple[list[Span], float, list[StepPart]]:
    """(spans, forward-backward's end, parts): without bucket reduces among the spans the
    window ends at `fb_end` or the last span; with them, at the plan's last action, and the
    reduces' time after it becomes `grad_reduce` parts (a reduce running across the end: its
    span up to it, a part after it)."""
    plan = [s.end_us for s in spans if s.node != GRAD_REDUCE]
    if len(plan) == len(spans):
        return spans, max([fb_end] + plan), []
    end = max(plan) if plan else fb_end
    kept, tail = [], []
    for span in spans:
        if span.node == GRAD_REDUCE and span.end_us > end:
            tail.append(StepPart(GRAD_REDUCE, STEP_PARTS[GRAD_REDUCE], max(span.start_us, end),
                                 span.end_us))
            if span.start_us < end:
                kept.append(dataclasses.replace(span, end_us=end))
        else:
            kept.append(span)
    return kept, end, tail
