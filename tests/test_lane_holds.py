"""The CUDA lanes' hold on tensors handed between streams, checked on CPU against a model of
CUDA stream ordering written here, independently of the executor.

`CudaStreamLanes` no longer calls `record_stream` on every hand-over: it keeps a reference
until the producer lane's next wait on the microbatch's event (executor docstring). The model
below says when that is safe. Each fake stream keeps a vector clock (how many kernels of every
stream are known to come before its next kernel); an event copies its stream's clock when
recorded, and `wait_event` / `wait_stream` merge clocks. Every "device" buffer is owned by the
stream that allocated it, like a block of the caching allocator; when its memory is freed (the
Python buffer behind the tensor is collected), every kernel that read it on another stream
must be covered by the owner stream's clock, or the buffer must have been marked with
`record_stream` for that stream. Otherwise the allocator could hand the memory to a later
kernel of the owner stream while that read may still run: a violation.

The real `Executor` runs real plans over a toy model of attn / dispatch / mlp / combine nodes
whose kernels read their inputs and allocate their outputs on the current stream, forward and
backward (the grads handed between the lanes in backward are where the hold matters: a
forward value stays referenced by its consumer until that consumer's backward). Lanes that drop the hand-overs outright show the model catches the hazard.
"""

from __future__ import annotations

import array
import gc
import weakref

import pytest
import torch

from epoverlap.model.nodes import COMM, COMPUTE, NodeSpec
from epoverlap.schedule import executor as executor_module
from epoverlap.schedule.executor import CudaStreamLanes, Executor
from epoverlap.schedule.plan import build_plan

ROWS = 4


class _Block:
    def __init__(self, stream):
        self.stream, self.reads, self.recorded = stream, [], set()


class StreamModel:
    """Fake streams, events and device buffers, and the violations found at each free."""

    def __init__(self):
        self.default = FakeStream(self, "default")
        self.current = self.default
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
    def __init__(self, model: StreamModel, name: str):
        self.model, self.name, self.count = model, name, 0
        self.clock: dict = {self: 0}

    @staticmethod
    def priority_range():
        return (0, -1)

    def wait_event(self, event) -> None:
        for stream, count in event.clock.items():
            self.clock[stream] = max(self.clock.get(stream, 0), count)

    def wait_stream(self, other) -> None:
        self.wait_event(FakeEvent.at(other))


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


def _node(model, name, layer, lane, source, target, loss=False) -> NodeSpec:
    """A node whose forward is one kernel reading its input and writing a fresh output, and
    whose backward is one kernel reading the output's grad and writing a fresh input grad, both
    on the current stream. The backward is given as the node's own (`NodeSpec.backward`), as
    pipeline nodes give theirs, so the grads are the model's buffers, not autograd's copies."""
    def forward(x):
        model.launch([x])
        return {"out": model.alloc()}

    def backward(out):
        model.launch([out])
        return {"x": model.alloc()}
    return NodeSpec(name, layer, lane, forward, {"x": source}, {"out": target},
                    loss="out" if loss else None, backward=backward)


def _toy_specs(model: StreamModel, layers: int) -> list[NodeSpec]:
    specs = [_node(model, "embed", None, COMPUTE, "tokens", "hidden.L0")]
    for layer in range(layers):
        chain = [("attn", COMPUTE), ("dispatch", COMM), ("mlp", COMPUTE), ("combine", COMM)]
        values = [f"hidden.L{layer}"] + [f"{name}.L{layer}" for name, _ in chain[:-1]] + \
            [f"hidden.L{layer + 1}"]
        specs += [_node(model, name, layer, lane, values[i], values[i + 1])
                  for i, (name, lane) in enumerate(chain)]
    return specs + [_node(model, "loss", None, COMPUTE, f"hidden.L{layers}", "loss", loss=True)]


class _DroppingLanes(CudaStreamLanes):
    """Hand-overs forgotten: neither held nor marked (the hazard the hold prevents)."""

    def hand_over(self, value, to_lane, microbatch):
        pass


class _MarkingLanes(CudaStreamLanes):
    """Every hand-over marked with record_stream (the lanes' earlier way)."""

    def hand_over(self, value, to_lane, microbatch):
        for tensor in executor_module._tensors_in(value):
            tensor.record_stream(self.stream(to_lane))


def _run(monkeypatch, lanes_class, plan_name: str, microbatches: int = 4, layers: int = 2):
    model = StreamModel()
    MODEL[:] = [model]
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0:
                        FakeStream(model, "comm"))
    monkeypatch.setattr(torch.cuda.Stream, "priority_range", FakeStream.priority_range,
                        raising=False)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: setattr(model, "current",
                                                                        stream))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: model.current)
    lanes = lanes_class(torch.device("cuda"))
    specs = _toy_specs(model, layers)
    layout = [tuple(s.kind for s in specs if s.layer == layer) for layer in range(layers)]
    plan = build_plan(plan_name, layout, microbatches)
    executor = Executor(specs, lanes)
    inputs = [{"tokens": model.alloc()} for _ in range(microbatches)]
    for _ in range(2):  # two steps: what the first one left held is released in the second
        losses = executor.run(plan, inputs, 1.0)
        del losses
        gc.collect()
    del executor, lanes, inputs
    gc.collect()
    return model


PLANS = ["combined_1f1b", "combined_1f1b_early_release", "combined_1f1b_paired_ends"]


@pytest.mark.parametrize("plan_name", PLANS)
def test_held_hand_overs_are_freed_only_after_the_reading_stream(monkeypatch, plan_name):
    model = _run(monkeypatch, CudaStreamLanes, plan_name)
    assert model.checked >= 50, model.checked  # buffers read across streams were freed
    assert not model.violations, model.violations[:5]


def test_the_stream_model_catches_forgotten_hand_overs(monkeypatch):
    """Without the hold (or a mark), grads handed from one stream to the other are freed while
    the reader may still run; with every hand-over marked, nothing is."""
    dropped = _run(monkeypatch, _DroppingLanes, "combined_1f1b")
    assert len(dropped.violations) >= 10, dropped.violations
    marked = _run(monkeypatch, _MarkingLanes, "combined_1f1b")
    assert marked.checked >= 50 and not marked.violations, marked.violations[:5]
