"""Tensors handed between the CUDA lanes' streams, checked on CPU against a model of CUDA
stream ordering written here, independently of the executor.

`CudaStreamLanes.hand_over` marks every tensor one lane hands to the other with
`record_stream` for the reader's stream. The model below says whether that, or anything put
in its place, is safe. Each fake stream keeps a vector clock (how many kernels of every
stream are known to come before its next kernel); an event copies its stream's clock when
recorded, and `wait_event` / `wait_stream` merge clocks. Every "device" buffer is owned by the
stream that allocated it, like a block of the caching allocator; when its memory is freed (the
Python buffer behind the tensor is collected), every kernel that read it on another stream
must be covered by the owner stream's clock, or the buffer must have been marked with
`record_stream` for that stream. Otherwise the allocator could hand the memory to a later
kernel of the owner stream while that read may still run: a violation.

The real `Executor` runs real plans over a toy model of attn / dispatch / mlp / combine nodes
whose forward kernel reads the input and writes a fresh output, and whose backward kernel reads
the output's grad and the saved input (as autograd's saved tensors are read), on the current
stream. Two lanes that skip the marks show the model catches the hazard:
  - lanes that forget the hand-overs;
  - lanes that hold each handed tensor until the producer lane's next wait on the
    microbatch's event, and drop it then. That covers the consumer node's own reads, but not
    the reads of what the consumer saved for its backward (or for a delayed weight grad, which
    waits on no event): on 2 H200s that design corrupted memory and the CLI run's loss went
    to NaN at step 4 (benchmarks/overlap.md, run F).
"""

from __future__ import annotations

import array
import gc
import weakref
from collections import deque

import pytest
import torch

from epoverlap.model.nodes import COMM, COMPUTE, NodeSpec
from epoverlap.schedule import executor as executor_module
from epoverlap.schedule.executor import CudaStreamLanes, Executor
from epoverlap.schedule.pipeline import build_plan
from epoverlap.schedule.wgrad import WeightGradQueue

ROWS = 4


class _Block:
    def __init__(self, stream):
        self.stream, self.reads, self.recorded = stream, [], set()


class StreamModel:
    """Fake streams, events and device buffers, and the violations found at each free."""

    def __init__(self):
        self.current = FakeStream("default")  # the stream a plan starts on
        self.blocks: dict[int, _Block] = {}
        self.violations: list[str] = []
        self.checked = 0  # frees of buffers read on another stream

    def alloc(self) -> torch.Tensor:
        buffer = array.array("f", bytes(4 * ROWS))
        tensor = FakeCudaTensor._make_subclass(FakeCudaTensor, torch.frombuffer(buffer,
                                                                                dtype=torch.float32))
        pointer = tensor.untyped_storage().data_ptr()
        block = self.blocks[pointer] = _Block(self.current)
        weakref.finalize(buffer, self._freed, pointer, block)
        return tensor

    def launch(self, reads) -> None:
        """A kernel on the current stream that reads `reads`."""
        stream = self.current
        stream.count += 1
        stream.clock[stream] = stream.count
        for tensor in reads:
            block = self.blocks.get(tensor.untyped_storage().data_ptr())
            if block is not None and block.stream is not stream:
                block.reads.append((stream, stream.count))

    def record_stream(self, tensor, stream) -> None:
        block = self.blocks.get(tensor.untyped_storage().data_ptr())
        if block is not None:
            block.recorded.add(stream)

    def _freed(self, pointer: int, block: _Block) -> None:
        if self.blocks.get(pointer) is block:
            del self.blocks[pointer]
        if block.reads:
            self.checked += 1
        for stream, position in block.reads:
            if stream not in block.recorded and block.stream.clock.get(stream, 0) < position:
                self.violations.append(f"memory of {block.stream.name} freed while kernel "
                                       f"{position} of {stream.name} may still read it")


class FakeStream:
    def __init__(self, name: str):
        self.name, self.count = name, 0
        self.clock: dict = {self: 0}

    @staticmethod
    def priority_range():
        return (0, -1)

    def wait_event(self, event) -> None:
        for stream, count in event.clock.items():
            self.clock[stream] = max(self.clock.get(stream, 0), count)

    def wait_stream(self, other) -> None:
        self.wait_event(FakeEvent.at(other))


class _StreamClass:
    """Stands in for torch.cuda.Stream: each call makes the comm lane's stream."""

    def __call__(self, device=None, priority=0) -> FakeStream:
        return FakeStream("comm")

    priority_range = staticmethod(FakeStream.priority_range)


class FakeEvent:
    def __init__(self, *args, **kwargs):
        self.clock: dict = {}

    @classmethod
    def at(cls, stream: FakeStream) -> "FakeEvent":
        event = cls()
        event.clock = dict(stream.clock)
        return event

    def record(self, stream=None) -> None:
        self.clock = dict((stream or MODEL[0].current).clock)


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor the lanes take for a CUDA one."""

    is_cuda = property(lambda self: True)

    def record_stream(self, stream) -> None:
        MODEL[0].record_stream(self, stream)


MODEL: list[StreamModel] = []  # the model of the running test (FakeEvent.record reads it)


def _node(model, name, layer, lane, source, target, loss=False, queue=None) -> NodeSpec:
    """A node whose forward is one kernel reading its input and writing a fresh output, and
    whose backward is one kernel reading the output's grad and the saved input and writing a
    fresh input grad, all on the current stream; with a weight-grad `queue`, one more kernel
    reading the same two, deferred to the node's W action when the queue collects. The
    backward is given as the node's own (`NodeSpec.backward`), as pipeline nodes give theirs,
    so the grads are the model's buffers, not autograd's copies."""
    saved: deque = deque()  # the inputs saved for the backward, oldest microbatch first

    def forward(x):
        model.launch([x])
        saved.append(x)
        return {"out": model.alloc()}

    def backward(out):
        x = saved.popleft()  # these plans run backwards in forward order
        model.launch([out, x])
        if queue is not None and not queue.defer(lambda: model.launch([out, x])):
            model.launch([out, x])  # the weight grad, inline
        return {"x": model.alloc()}
    return NodeSpec(name, layer, lane, forward, {"x": source}, {"out": target},
                    has_weights=queue is not None, loss="out" if loss else None,
                    backward=backward)


def _toy_specs(model: StreamModel, layers: int, queue: WeightGradQueue) -> list[NodeSpec]:
    specs = [_node(model, "embed", None, COMPUTE, "tokens", "hidden.L0")]
    for layer in range(layers):
        chain = [("attn", COMPUTE), ("dispatch", COMM), ("mlp", COMPUTE), ("combine", COMM)]
        values = [f"hidden.L{layer}"] + [f"{name}.L{layer}" for name, _ in chain[:-1]] + \
            [f"hidden.L{layer + 1}"]
        specs += [_node(model, name, layer, lane, values[i], values[i + 1],
                        queue=queue if lane == COMPUTE else None)
                  for i, (name, lane) in enumerate(chain)]
    return specs + [_node(model, "loss", None, COMPUTE, f"hidden.L{layers}", "loss", loss=True)]


class _DroppingLanes(CudaStreamLanes):
    """Hand-overs forgotten: neither marked nor held."""

    def hand_over(self, value, to_lane):
        pass


class _ReleasingLanes(CudaStreamLanes):
    """Each handed tensor held until the lane that made it next waits on the microbatch's
    event, then dropped (module docstring: not enough)."""

    def __init__(self, device):
        super().__init__(device)
        self._held: dict = {}
        self._microbatch = None

    def submit(self, lane, microbatch, task, chain, wave=None):
        def holding_task(wait):
            def wait_and_release():
                wait()
                if chain:
                    self._held.pop((lane, microbatch), None)
            self._microbatch = microbatch
            task(wait_and_release)
        super().submit(lane, microbatch, holding_task, chain, wave)

    def hand_over(self, value, to_lane):
        made_on = COMPUTE if to_lane == COMM else COMM
        self._held.setdefault((made_on, self._microbatch), []).extend(
            executor_module._tensors_in(value))


def _run(monkeypatch, lanes_class, plan_name: str, delay_wgrad: bool,
         microbatches: int = 4, layers: int = 2):
    model = StreamModel()
    MODEL[:] = [model]
    monkeypatch.setattr(torch.cuda, "Stream", _StreamClass())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: setattr(model, "current",
                                                                        stream))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: model.current)
    lanes = lanes_class(torch.device("cuda"))
    queue = WeightGradQueue(enabled=delay_wgrad)
    specs = _toy_specs(model, layers, queue)
    layout = [tuple(s.kind for s in specs if s.layer == layer) for layer in range(layers)]
    plan = build_plan(plan_name, layout, microbatches, delay_wgrad)
    executor = Executor(specs, lanes, queue)
    inputs = [{"tokens": model.alloc()} for _ in range(microbatches)]
    for _ in range(2):  # two steps, as training runs them
        losses = executor.run(plan, inputs, 1.0)
        del losses
        gc.collect()
    del executor, lanes, inputs
    gc.collect()
    return model


PLANS = ["combined_1f1b", "combined_1f1b_early_release", "combined_1f1b_paired_ends"]


@pytest.mark.parametrize("delay_wgrad", [False, True])
@pytest.mark.parametrize("plan_name", PLANS)
def test_no_buffer_is_freed_while_the_other_stream_may_read_it(monkeypatch, plan_name,
                                                               delay_wgrad):
    model = _run(monkeypatch, CudaStreamLanes, plan_name, delay_wgrad)
    assert model.checked >= 50, model.checked  # buffers read across streams were freed
    assert not model.violations, model.violations[:5]


@pytest.mark.parametrize("lanes_class, delay_wgrad", [(_DroppingLanes, False),
                                                      (_ReleasingLanes, True)])
def test_the_stream_model_catches_unmarked_hand_overs(monkeypatch, lanes_class, delay_wgrad):
    """Forgotten hand-overs; hand-overs dropped at the producer's next wait while a delayed
    weight grad still reads them: buffers freed while the other stream may still read."""
    model = _run(monkeypatch, lanes_class, "combined_1f1b", delay_wgrad)
    assert len(model.violations) >= 5, model.violations
