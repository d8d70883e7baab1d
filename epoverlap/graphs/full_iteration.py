"""Full-iteration CUDA graphs (`--cuda-graph-impl full_iteration`): one graph over the forward
and backward of every microbatch of a step.

Owns `FullIterationGraph`: the executor's whole run of the plan (sequential, or the combined
1F1B with the EP overlap on its two streams, with delayed weight grads or not) captured once and
replayed each step; zeroing the grad buffers, the grad reduction, clipping, the stats and the
optimizer step stay eager around it. It needs every op of a step to be capturable, the
dispatch included: a sync-free dispatch mode (`DispatchMode.dispatch_syncs_host` False) and the
Triton kernels (validation enforces both).

Buffers: the microbatches' tokens and labels are copied into static inputs before a replay, the
losses come out of static outputs; parameters, `main_grad` buffers, router statistics, the
expert bias and the budget's overflow record keep fixed addresses, so the eager code around
the replay reads and updates them as in an eager step. Everything else a step allocates lives
in the graph's private pool.

Capture (after the last warmup step, which records the inputs' shapes): one eager run on the
capture stream (per-stream handles and workspaces), its cached blocks released and the free
memory checked against what it took (`CudaGraphBackend.make_room`), then the capture itself;
the routers' balancing generators are registered with the graph and their states restored
afterwards.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional, Sequence

import torch

from epoverlap.graphs.capture import CudaGraphBackend, TensorMeta
from epoverlap.schedule.plan import Action


class FullIterationGraph:
    """Runs `executor.run(plan, inputs, loss_scale)` eagerly, or as one graph once captured."""

    def __init__(self, executor, plan: Sequence[Action], loss_scale: float, *,
                 device: torch.device, generators: Sequence[torch.Generator] = (),
                 backend_factory=CudaGraphBackend,
                 replay_watch: Callable[[], contextlib.AbstractContextManager]
                 = contextlib.nullcontext):
        """`replay_watch`: a context around each replay (the EP group's `Group.watched`, so the
        liveness watch tracks the all-to-alls the graph holds)."""
        self.executor, self.plan, self.loss_scale = executor, list(plan), loss_scale
        self.replay_watch = replay_watch
        self.device, self.generators = device, tuple(generators)
        self.backend_factory = backend_factory
        self.recording = False
        self.backend = None
        self.graph = None
        self.input_metas: Optional[list[dict]] = None
        self.static_inputs: list[dict] = []
        self.static_losses: list[torch.Tensor] = []
        self.capture_seconds: Optional[float] = None
        self.pool_bytes = 0

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def run(self, inputs: Sequence[dict]) -> list[torch.Tensor]:
        """Every microbatch's forward and backward; -> each microbatch's loss."""
        if self.recording:
            self.input_metas = [{name: TensorMeta.of(value) for name, value in mb.items()}
                                for mb in inputs]
        if self.graph is None:
            return self.executor.run(self.plan, inputs, self.loss_scale)
        for static, given in zip(self.static_inputs, inputs, strict=True):
            for name, buffer in static.items():
                if tuple(given[name].shape) != tuple(buffer.shape):
                    raise RuntimeError(f"full-iteration graph: input {name!r} is "
                                       f"{tuple(given[name].shape)}, captured for "
                                       f"{tuple(buffer.shape)}")
                buffer.copy_(given[name])
        with self.replay_watch():
            self.graph.replay()
        return [loss.clone() for loss in self.static_losses]

    def capture(self, plan: Optional[Sequence[Action]] = None) -> None:
        """Capture the step (needs one recorded run first). `plan`, if given, must be the one
        this graph runs (the same signature as `GraphRunner.capture`)."""
        if plan is not None and list(plan) != self.plan:
            raise ValueError("full-iteration graph: captured for another plan")
        if self.input_metas is None:
            raise RuntimeError("full-iteration graph capture before a recorded step")
        started = time.perf_counter()
        states = [g.get_state() for g in self.generators]
        self.backend = backend = self.backend_factory(self.device)
        backend.synchronize()
        reserved_before = backend.reserved_bytes()
        self.static_inputs = [{name: torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                               for name, m in mb.items()} for mb in self.input_metas]
        self.static_losses = [torch.zeros((), dtype=torch.float32, device=self.device)
                              for _ in self.input_metas]
        backend.begin_warmup()
        with backend.side_stream():
            self._body()
        backend.end_warmup()
        backend.make_room(reserved_before, "the full-iteration CUDA graph")
        self.graph = backend.capture(self._body, self.generators)
        for generator, state in zip(self.generators, states):
            generator.set_state(state)
        backend.synchronize()
        self.pool_bytes = backend.reserved_bytes() - reserved_before
        self.capture_seconds = time.perf_counter() - started

    def _body(self) -> None:
        losses = self.executor.run(self.plan, self.static_inputs, self.loss_scale)
        with torch.no_grad():
            for static, loss in zip(self.static_losses, losses):
                static.copy_(loss)

    def graph_count(self) -> int:
        return int(self.graph is not None)

    def buffer_bytes(self) -> int:
        tensors = [t for mb in self.static_inputs for t in mb.values()] + self.static_losses
        return sum(t.numel() * t.element_size() for t in tensors)

    def release(self) -> None:
        """Free the graph (before process groups are torn down)."""
        if self.backend is not None:
            self.backend.synchronize()
        self.graph = None
        self.static_inputs, self.static_losses = [], []
        self.backend = None
