"""The executor: interprets a plan on two lanes. The only module that touches the lanes'
streams and events (the one other stream, the split-size exchange's, is `parallel.comm`'s).

Owns `Executor` and the lane backends: `SerialLanes` (everything in order on the calling
thread and current stream: the sequential reference), `CudaStreamLanes` (the compute lane is
the current CUDA stream, the comm lane a second stream, optionally high priority) and
`ThreadLanes` (CPU: the comm lane is one worker thread that runs comm nodes in order, like a
stream, so a gloo all-to-all really runs while the main thread computes).

Two lanes, one event per microbatch (overlap.md). For a layer pair, forward of F with backward
of B:

    comm:    | B.combine |          | F.dispatch ...... B.dispatch |        | F.combine |
    compute: |           | F.attn   | B.mlp | W.mlp |     F.mlp     |        | B.attn | W.attn
                 ^ hidden behind F.attn       ^ hidden behind W.mlp and F.mlp     ^ hidden by B.attn

Pipeline send/recv nodes are comm nodes like the all-to-alls: each transfer runs on the comm
lane in plan order (the plan puts both ends of a link in the same order), so it overlaps the
compute of other microbatches too.

Every F/B node of microbatch m waits on m's event (CUDA: `wait_event`; threads: the future of
m's last comm node) before it runs and records it after, so one microbatch's nodes form a chain
across the lanes while the two microbatches' chains share nothing and overlap freely. In waves
an MoE layer's node of wave c (`NodeSpec.wave`) chains on an event of its own, (m, c): the first
of the wave waits on m's event, the next ones on the wave's, and the next node of no wave
waits on m's and every open wave's, so wave c's experts run beside wave c+1's all-to-all
inside one microbatch (`Chains`). `W`
actions run on the compute lane and neither wait on nor record the event: nothing waits on
them. A lane runs a task as `task(wait)`: the task calls `wait()` (that wait, or nothing) first
thing, so the span recorder can time the wait apart from the work (its `queued` mark before
it, `start` after). A tensor handed from one lane to the other is marked used on the consumer's stream
(`record_stream`), so the caching allocator cannot hand its memory out early.

With a bucket reducer (--overlap-grad-reduce, `schedule.grad_reduce`), each gradient bucket's
data-parallel reduce runs on the comm lane after the action `reduce_points` names, waiting for
everything the compute lane issued before it (`submit_after_compute`: CUDA, an event on the
compute stream; threads, the compute lane's work is done when the host issues the next task);
`drain` joins them with the rest of the comm lane, before the clip and the optimizer.

With a `CommHold` (--local-copy-hold-us, a benchmark's local-copy recording), every all-to-all
node (a comm node that is no pipeline transfer) holds its lane for a fixed time after its work,
inside its span: the lane's stream sleeps (GPU) or its thread does (CPU). A local copy is nearly
free, so without the hold a local-copy step is bound by the host's launches and its compute
spans hold the host's gaps; held, the compute queues behind the comm lane as behind a real
all-to-all, and its spans time the device's work with the host ahead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch

from epoverlap.model.nodes import COMM, COMPUTE, NodeSpec
from epoverlap.schedule.grad_reduce import BucketReducer, ReduceAction, reduce_points
from epoverlap.schedule.node_run import NodeRun
from epoverlap.schedule.plan import Action
from epoverlap.schedule.wgrad import WeightGradQueue


def _tensors_in(value) -> list[torch.Tensor]:
    """Tensors inside a value handed between lanes: a tensor, or the fields of a dataclass."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        return [f for f in (getattr(value, field.name) for field in dataclasses.fields(value))
                if isinstance(f, torch.Tensor)]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


Task = Callable[[Callable[[], None]], None]  # task(wait): calls wait() first, then works


def no_wait() -> None:
    """The wait of a task that depends on nothing on the other lane."""


ChainKey = object  # a microbatch m, or (m, c) for wave c of an MoE layer in waves

HOLD_PROBE_CYCLES = 2_000_000  # ~1 ms at GPU clocks: the sleep timed to learn the clock


class CommHold:
    """The hold of every all-to-all node (module docstring), `us` microseconds on the lane
    that runs the node: a sleep kernel on the current stream (GPU; its cycles from the clock
    timed once here, at build, before any graph capture) or the current thread's sleep (CPU:
    there the compute runs on the host and has no launches to queue, so the hold changes no
    compute span; the comm node lasts `us` on both backends)."""

    def __init__(self, us: float, device: torch.device):
        self.us = float(us)
        self.cycles = (round(self.us * _sleep_cycles_per_us(device))
                       if device.type == "cuda" else None)

    def __call__(self) -> None:
        if self.cycles is None:
            time.sleep(self.us / 1e6)
        else:
            torch.cuda._sleep(self.cycles)


def _sleep_cycles_per_us(device: torch.device) -> float:
    """`torch.cuda._sleep` cycles per microsecond on `device`, timed (the nominal clock is not
    the one the GPU runs at): the second of two probes, the first warming up."""
    with torch.cuda.device(device):
        for _ in range(2):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            torch.cuda._sleep(HOLD_PROBE_CYCLES)
            end.record()
            end.synchronize()
        return HOLD_PROBE_CYCLES / (start.elapsed_time(end) * 1e3)


class Chains:
    """Which chain keys a node waits on and which it records (module docstring): wave c's
    first node waits on m, its next ones on (m, c); a node of no wave waits on m and the open
    waves, and closes them."""

    def __init__(self):
        self._open: dict[int, list[int]] = {}  # microbatch -> waves with a recorded key

    def step(self, microbatch: int, wave: Optional[int]) -> tuple[list[ChainKey], ChainKey]:
        """-> (keys to wait on, key to record) for the next chained node."""
        open_waves = self._open.setdefault(microbatch, [])
        if wave is None:
            waits = [microbatch] + [(microbatch, c) for c in open_waves]
            open_waves.clear()
            return waits, microbatch
        if wave in open_waves:
            return [(microbatch, wave)], (microbatch, wave)
        open_waves.append(wave)
        return [microbatch], (microbatch, wave)

    def clear(self) -> None:
        self._open.clear()


class SerialLanes:
    """Both lanes in program order on the caller's thread and stream (no overlap)."""

    def begin(self) -> None:
        """A plan starts (before its first `submit`)."""

    def submit(self, lane: str, microbatch: int, task: Task, chain: bool,
               wave: Optional[int] = None) -> None:
        task(no_wait)

    def submit_after_compute(self, task: Task) -> None:
        """A comm-lane task that runs after all compute-lane work submitted so far (a gradient
        bucket's reduce), chained to no microbatch."""
        task(no_wait)

    def hand_over(self, value, to_lane: str) -> None:
        pass

    def drain(self) -> None:
        pass

    def abort(self) -> None:
        """After a failure: drop queued work without waiting for any of it."""
        self.drain()

    def close(self) -> None:
        pass


class ThreadLanes(SerialLanes):
    """CPU: compute on the calling thread, comm on one worker thread (a FIFO, like a stream).

    An exception of a comm node (a `PeerFailure` naming the step, group and op, say) is raised
    again on the main thread by the `Future.result()` of the next wait on its microbatch."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epoverlap-comm")
        self._pending: dict[ChainKey, Future] = {}  # per chain key: its last comm node
        self._queued: list[Future] = []  # every comm node not known to be finished
        self._unchained: list[Future] = []  # the step's comm tasks of no chain, until drained
        self._chains = Chains()

    def submit(self, lane, microbatch, task, chain, wave=None):
        waits, record = self._chains.step(microbatch, wave) if chain else ([], None)
        if lane == COMM:  # FIFO after every compute node submitted before it: nothing to wait
            future = self._pool.submit(task, no_wait)
            if chain:
                self._pending[record] = future
            self._queued = [f for f in self._queued if not f.done()] + [future]
            return
        task((lambda: self._wait(waits)) if chain else no_wait)

    def submit_after_compute(self, task):
        """The compute lane's work is done once the host gets here (it runs on this thread).
        Kept until `drain`, which raises its exception (no chain's wait would)."""
        future = self._pool.submit(task, no_wait)
        self._unchained.append(future)
        self._queued = [f for f in self._queued if not f.done()] + [future]

    def _wait(self, keys: Sequence[ChainKey]) -> None:
        for key in keys:
            future = self._pending.pop(key, None)
            if future is not None:
                future.result()  # re-raises the comm node's exception here

    def drain(self):
        self._wait(list(self._pending))
        for future in self._unchained:  # gradient buckets' reduces: raised here if they failed
            future.result()
        self._unchained.clear()
        self._queued.clear()
        self._chains.clear()

    def abort(self):
        """Cancel the comm nodes not started yet; do not wait for the running one (it may be
        blocked on a dead peer until the timeout)."""
        for future in self._queued:
            future.cancel()
        self._queued.clear()
        self._unchained.clear()
        self._pending.clear()

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)


class CudaStreamLanes(SerialLanes):
    """GPU: compute lane = the current stream, comm lane = a side stream; one event per mb.

    The compute lane is the stream current when a plan starts (`begin`: the default stream, or
    a graph's capture stream while a full iteration is captured: the comm stream then joins the
    capture through the events and rejoins it at `drain`). A compute action runs on it as it
    is; only a comm action switches streams (and back), by the streams held here: the host
    cost of the lanes is paid per action, hundreds of times a step in a host-bound run."""

    def __init__(self, device: torch.device, high_priority_comm: bool = True):
        self.device = device
        priority = torch.cuda.Stream.priority_range()[1] if high_priority_comm else 0
        self.comm_stream = torch.cuda.Stream(device=device, priority=priority)
        self._compute: Optional[torch.cuda.Stream] = None
        self._events: dict[ChainKey, torch.cuda.Event] = {}
        self._chains = Chains()

    def begin(self) -> None:
        self._compute = torch.cuda.current_stream(self.device)

    @property
    def compute_stream(self) -> torch.cuda.Stream:
        return self._compute if self._compute is not None else \
            torch.cuda.current_stream(self.device)

    def stream(self, lane: str) -> torch.cuda.Stream:
        return self.comm_stream if lane == COMM else self.compute_stream

    def _event(self, key: ChainKey) -> torch.cuda.Event:
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = torch.cuda.Event()
        return event

    def submit(self, lane, microbatch, task, chain, wave=None):
        stream, switch = self.stream(lane), lane == COMM
        if switch:
            torch.cuda.set_stream(stream)
        try:
            if not chain:
                task(no_wait)
                return
            waits, record = self._chains.step(microbatch, wave)
            events = [self._event(key) for key in waits]

            def wait():
                for event in events:
                    stream.wait_event(event)
            task(wait)
            self._event(record).record(stream)
        finally:
            if switch:
                torch.cuda.set_stream(self.compute_stream)

    def submit_after_compute(self, task):
        done = torch.cuda.Event()
        done.record(self.compute_stream)
        torch.cuda.set_stream(self.comm_stream)
        try:
            task(lambda: self.comm_stream.wait_event(done))
        finally:
            torch.cuda.set_stream(self.compute_stream)

    def hand_over(self, value, to_lane):
        stream = self.stream(to_lane)
        for tensor in _tensors_in(value):
            if tensor.is_cuda:
                tensor.record_stream(stream)

    def drain(self):
        self.compute_stream.wait_stream(self.comm_stream)
        self._events.clear()
        self._chains.clear()
        self._compute = None


class _MicrobatchState:
    """Values, grads and live node runs of one microbatch, with the lane that produced each."""

    def __init__(self, inputs: dict):
        self.values = dict(inputs)
        self.value_lane = {name: COMPUTE for name in inputs}
        self.grads: dict = {}
        self.grad_lane: dict = {}
        self.runs: dict = {}
        self.uses: dict = {}  # value name -> consumers that have not run their forward yet


RunFactory = Callable[[NodeSpec, int], Callable[..., dict]]


def eager_runs(spec: NodeSpec, microbatch: int) -> Callable[..., dict]:
    """The default run factory: every node runs its own callable."""
    return spec.fn


class Executor:
    """Runs a plan over a model's nodes. One instance per training run.

    `run_factory(spec, microbatch)` gives the callable that runs a node's forward for one
    microbatch (default: the spec's own; `epoverlap.graphs` returns graph replays); the
    executor never needs to know which. `grad_reduce`: the gradient buckets reduced beside the
    backward (module docstring; None: the step reduces them after the plan). `hold`: each
    all-to-all node's hold (module docstring; None: none).
    """

    def __init__(self, specs: Sequence[NodeSpec], lanes: SerialLanes,
                 wgrad_queue: Optional[WeightGradQueue] = None, recorder=None,
                 run_factory: RunFactory = eager_runs,
                 grad_reduce: Optional[BucketReducer] = None,
                 hold: Optional[CommHold] = None):
        self.run_factory = run_factory
        self.hold = hold
        self.specs = {spec.key: spec for spec in specs}
        self.lanes = lanes
        self.wgrad_queue = wgrad_queue or WeightGradQueue(enabled=False)
        self.recorder = recorder
        self.grad_reduce = grad_reduce
        self._reduce_points: dict[int, tuple] = {}  # id(plan) -> (plan, its reduce points)
        self._consumers = self._count_consumers(specs)

    @staticmethod
    def _count_consumers(specs) -> dict:
        counts: dict = {}
        for spec in specs:
            for name in spec.inputs.values():
                counts[name] = counts.get(name, 0) + 1
        return counts

    def run(self, plan: Sequence[Action], microbatch_inputs: Sequence[dict],
            loss_scale: float) -> list[torch.Tensor]:
        """Execute `plan`; return each microbatch's (detached) loss (None on a pipeline stage
        without the loss head). Grads land in the params."""
        states = [_MicrobatchState(inputs) for inputs in microbatch_inputs]
        losses: list[Optional[torch.Tensor]] = [None] * len(states)
        points = self.reduce_points(plan)
        self.wgrad_queue.begin_run(len(states))
        self.lanes.begin()
        try:
            for index, action in enumerate(plan):
                self._submit(action, states[action.microbatch], losses, loss_scale)
                for bucket in points.get(index, ()):
                    self._submit_reduce(bucket, action.microbatch)
        except BaseException:
            with contextlib.suppress(BaseException):
                self.lanes.abort()
            raise
        self.lanes.drain()
        self.wgrad_queue.check_empty()
        self.wgrad_queue.check_paired()
        return losses

    def reduce_points(self, plan: Sequence[Action]) -> dict[int, list[int]]:
        """`grad_reduce.reduce_points` of `plan` over this executor's nodes (made once per
        plan); {} without a bucket reducer."""
        if self.grad_reduce is None:
            return {}
        cached = self._reduce_points.get(id(plan))
        if cached is None or cached[0] is not plan:
            kinds = {key: spec.kind for key, spec in self.specs.items()}
            cached = (plan, reduce_points(plan, kinds, self.grad_reduce.buckets))
            self._reduce_points[id(plan)] = cached
        return cached[1]

    def _submit_reduce(self, bucket: int, microbatch: int) -> None:
        reducer = self.grad_reduce
        action = ReduceAction(reducer.buckets[bucket], microbatch)
        self.lanes.submit_after_compute(
            self._task(action, COMM, lambda: reducer.reduce_bucket(bucket)))

    def _submit(self, action: Action, state: _MicrobatchState, losses: list,
                loss_scale: float) -> None:
        spec = self.specs[action.node_key]
        lane = COMPUTE if action.kind == "W" else spec.lane
        work = {"F": self._forward, "B": self._backward, "W": self._wgrad}[action.kind]
        hold = self.hold if self.hold is not None and lane == COMM and spec.p2p is None else no_wait

        def body() -> None:
            work(action, spec, state, losses, loss_scale)
            hold()
        self.lanes.submit(lane, action.microbatch, self._task(action, lane, body),
                          chain=action.kind != "W", wave=spec.wave)

    def _task(self, action, lane: str, body: Callable[[], None]) -> Task:
        """A lane task running `body` after its wait; recording, in a span of `action` that
        times the wait, then the work."""
        def task(wait: Callable[[], None]) -> None:
            if self.recorder is None:
                wait()
                body()
                return
            with self.recorder.span(action, lane, wait):
                body()
        return task

    def _forward(self, action, spec: NodeSpec, state: _MicrobatchState, losses, loss_scale):
        inputs = {}
        for name in spec.inputs.values():
            value = state.values[name]
            if state.value_lane[name] != spec.lane:
                self.lanes.hand_over(value, spec.lane)
            inputs[name] = value
        run = NodeRun(spec, self.run_factory(spec, action.microbatch))
        outputs = run.forward(inputs)
        state.runs[spec.key] = run
        for name, value in outputs.items():
            state.values[name] = value
            state.value_lane[name] = spec.lane
        if spec.loss is not None:
            losses[action.microbatch] = outputs[spec.outputs[spec.loss]].detach()
        self._drop_consumed_values(spec, state)

    def _drop_consumed_values(self, spec: NodeSpec, state: _MicrobatchState) -> None:
        for name in spec.inputs.values():
            state.uses[name] = state.uses.get(name, self._consumers[name]) - 1
            if state.uses[name] == 0:
                state.values.pop(name, None)

    def _backward(self, action, spec: NodeSpec, state: _MicrobatchState, losses, loss_scale):
        grads = {}
        for local, name in spec.outputs.items():
            if local == spec.loss:
                grads[name] = torch.full_like(losses[action.microbatch], loss_scale)
            elif name in state.grads:
                if state.grad_lane[name] != spec.lane:
                    self.lanes.hand_over(state.grads[name], spec.lane)
                grads[name] = state.grads.pop(name)
        run = state.runs.pop(spec.key)
        collect = (self.wgrad_queue.collecting(self._wgrad_key(action)) if spec.has_weights
                   else contextlib.nullcontext())
        with collect:
            input_grads = run.backward(grads)
        for name, grad in input_grads.items():
            if grad is not None:
                state.grads[name] = grad
                state.grad_lane[name] = spec.lane

    def _wgrad(self, action, spec, state, losses, loss_scale):
        self.wgrad_queue.run(self._wgrad_key(action))

    @staticmethod
    def _wgrad_key(action: Action) -> tuple:
        return (action.microbatch, action.layer, action.node)


def make_lanes(device: torch.device, overlap: bool, high_priority_comm: bool = True):
    """The lane backend for a run: serial without overlap, streams on GPU, a thread on CPU."""
    if not overlap:
        return SerialLanes()
    if device.type == "cuda":
        return CudaStreamLanes(device, high_priority_comm)
    return ThreadLanes()
