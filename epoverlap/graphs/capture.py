"""Partial CUDA graphs of node segments, per (layer, microbatch, phase), under any plan.

Owns `GraphRunner`, the run factory the executor asks for a node's callable (`epoverlap.
schedule.executor.RunFactory`): before capture it hands out the nodes' own callables; during the
last warmup step it records the inputs and outputs of every graphed range; after `capture(plan)`
it hands out callables that run the eager segments of a node as before and replace each range
of graphed segments by graph replays (`_Replay`, an autograd function: forward replays the
range's forward graph, backward its backward graph, and with delayed wgrad the backward defers
the replay of its weight-grad graph to the plan's W action).

What a range is: a maximal run of consecutive `Segment`s of one node whose names are in
`--cuda-graph-modules` (attn, moe_router, moe_preprocess on MoE layers; attn, mlp on dense ones;
`moe` or the whole layer: the one-node MoE layer's segments through the dispatch, the experts
and the combine, which a sync-free dispatch (`DispatchMode.dispatch_syncs_host` False) allows:
the all-to-alls then have static sizes and run inside the graph). Under context parallelism
the `attn` range holds the K/V exchange where it runs inside the attention (`model.context`):
its collectives on the CP group are captured and replayed in plan order on every rank.

Memory (the rules of `torch.cuda.graph` pools, and how they are kept):
  * One graph per (range, microbatch, phase), all in one private pool, captured in the order
    the plan replays them (a walk over the plan), each replayed once per step: a block the pool
    hands to a later capture was free at that point of the walk, so at replay it is free too.
  * What crosses a graph's boundary lives outside the pool, in buffers per (range, slot): the
    static inputs the forward reads and the output grads the backward reads (copied in before a
    replay, on the compute stream), and the outputs and input grads the graphs write (copied out
    inside the graph). A slot is a microbatch's place while it is alive in the plan (from its
    first action to its last: `microbatch_slots`); the combined 1F1B needs two, the sequential
    plan one. Every reader of a slot buffer is an action of that microbatch, chained by its
    event, so nothing reads a buffer after the next microbatch of the slot overwrites it.
  * Saved activations stay in the pool from the forward capture to the backward capture (the
    autograd graph holds them), as in eager mode; weight-grad inputs until the W capture.
  * The warm-up run on the capture stream before the walk allocates outside the pool: its
    cached blocks are released before the capture, and a capture the free memory cannot hold
    is refused before it starts (`CudaGraphBackend.make_room`, `GraphMemoryError`).

Capture-safety: warmup steps (`--cuda-graph-warmup-steps`) run first (Triton compiles,
cuBLAS/autograd initialize); the router's balancing generator is registered with every graph
that draws from it and its state restored after the capture walk; grads accumulate into
`main_grad` (fixed addresses) through the same code as eager. `release()` frees every graph;
the trainer calls it before process groups are destroyed (environment.md: a live graph hangs
`destroy_process_group` on 4 ranks).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from epoverlap.model.nodes import NodeSpec, Segment, run_segments
from epoverlap.schedule.plan import Action

Key = tuple  # (layer, node name, first segment index)


def graphed_ranges(segments: Sequence[Segment], graphed: set) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of consecutive segments whose names are in `graphed`."""
    ranges, start = [], None
    for index, segment in enumerate(list(segments) + [None]):
        inside = segment is not None and segment.name in graphed
        if inside and start is None:
            start = index
        elif not inside and start is not None:
            ranges.append((start, index))
            start = None
    return ranges


def microbatch_slots(plan: Sequence[Action]) -> dict[int, int]:
    """microbatch -> slot: a microbatch holds its slot from its first to its last action; the
    lowest free slot is taken (interval colouring in plan order)."""
    first, last = {}, {}
    for index, action in enumerate(plan):
        first.setdefault(action.microbatch, index)
        last[action.microbatch] = index
    slots, busy_until = {}, []  # busy_until[slot] = last action index of its holder
    for mb in sorted(first, key=first.get):
        free = [s for s, end in enumerate(busy_until) if end < first[mb]]
        slot = free[0] if free else len(busy_until)
        if slot == len(busy_until):
            busy_until.append(last[mb])
        busy_until[slot] = last[mb]
        slots[mb] = slot
    return slots


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tuple(tensor.shape), tensor.dtype, tensor.requires_grad, tensor.device)

    def matches(self, tensor: torch.Tensor) -> bool:
        return (tuple(tensor.shape) == self.shape and tensor.dtype == self.dtype
                and tensor.device == self.device)


@dataclass
class RangeSignature:
    """What a graphed range reads and writes (recorded in the last warmup step)."""

    inputs: dict  # local name -> TensorMeta
    outputs: dict  # local name -> TensorMeta


class SlotBuffers:
    """Buffers outside the graph pool through which one slot's graphs of a range talk to the
    eager world: static inputs, outputs, output grads, input grads."""

    def __init__(self, signature: RangeSignature, device: torch.device):
        def zeros(meta):
            return torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
        self.inputs = {n: zeros(m) for n, m in signature.inputs.items()}
        self.outputs = {n: zeros(m) for n, m in signature.outputs.items()}
        self.output_grads = {n: zeros(m) for n, m in signature.outputs.items()
                             if m.requires_grad}
        self.input_grads = {n: zeros(m) for n, m in signature.inputs.items() if m.requires_grad}

    def nbytes(self) -> int:
        groups = (self.inputs, self.outputs, self.output_grads, self.input_grads)
        return sum(t.numel() * t.element_size() for g in groups for t in g.values())


class RangeGraphs:
    """The forward, backward and (delayed wgrad) weight-grad graphs of one range for one
    microbatch, and the capture-time state that lives from one capture to the next."""

    def __init__(self, name: str, segments: Sequence[Segment], signature: RangeSignature,
                 slot: SlotBuffers, context: "CaptureContext"):
        self.name, self.segments, self.signature = name, tuple(segments), signature
        self.slot, self.context = slot, context
        self.forward_graph = self.backward_graph = self.wgrad_graph = None
        self.input_has_grad: dict = {}
        self._leaves: Optional[dict] = None
        self._inner_outputs: Optional[dict] = None

    # -------------------------------------------------------------- capture (plan order)
    def capture_forward(self) -> None:
        self.forward_graph = self.context.capture(self._forward_body, draws_random=True)

    def capture_backward(self) -> None:
        self.backward_graph = self.context.capture(self._backward_body)
        self._leaves = self._inner_outputs = None  # saved activations go back to the pool

    def capture_wgrad(self) -> None:
        if self._wgrad_key() not in self.context.queue.pending_keys():
            return  # nothing in this range defers its weight grads
        self.wgrad_graph = self.context.capture(self._wgrad_body)

    def _forward_body(self) -> None:
        """Segments on leaves aliasing the static inputs; outputs copied to the slot."""
        self._leaves = {n: buf.detach().requires_grad_(self.signature.inputs[n].requires_grad)
                        for n, buf in self.slot.inputs.items()}
        with torch.enable_grad():
            self._inner_outputs = run_segments(self.segments, tuple(self.signature.outputs),
                                               self._leaves)
        with torch.no_grad():
            for name, buf in self.slot.outputs.items():
                buf.copy_(self._inner_outputs[name])

    def _backward_body(self) -> None:
        """Backward from the static output grads; input grads copied to the slot; deferrable
        weight grads queued under this range's own key (for the W graph)."""
        queue = self.context.queue
        roots = [n for n in self.slot.output_grads if self._inner_outputs[n].requires_grad]
        with queue.collecting(self._wgrad_key()) if queue.enabled else contextlib.nullcontext():
            torch.autograd.backward([self._inner_outputs[n] for n in roots],
                                    [self.slot.output_grads[n] for n in roots])
        with torch.no_grad():
            for name, buf in self.slot.input_grads.items():
                grad = self._leaves[name].grad
                self.input_has_grad[name] = grad is not None
                if grad is not None:
                    buf.copy_(grad)
                self._leaves[name].grad = None

    def _wgrad_body(self) -> None:
        self.context.queue.run(self._wgrad_key())

    def _wgrad_key(self) -> tuple:
        return ("cuda-graph", id(self))

    # -------------------------------------------------------------- replay
    def replay_forward(self, inputs: dict, where: str) -> list[torch.Tensor]:
        for name, value in inputs.items():
            static = self.slot.inputs[name]
            if self.context.check_inputs and not self.signature.inputs[name].matches(value):
                raise RuntimeError(_mismatch(where, "forward input", name,
                                             self.signature.inputs[name], value))
            if value.data_ptr() != static.data_ptr():
                static.copy_(value)
        with self.context.replay_watch():
            self.forward_graph.replay()
        return [buf.detach() for buf in self.slot.outputs.values()]

    def replay_backward(self, grads: dict, where: str) -> list[Optional[torch.Tensor]]:
        for name, static in self.slot.output_grads.items():
            grad = grads.get(name)
            if grad is None:
                static.zero_()
                continue
            if self.context.check_inputs and not self.signature.outputs[name].matches(grad):
                raise RuntimeError(_mismatch(where, "output grad", name,
                                             self.signature.outputs[name], grad))
            static.copy_(grad)
        with self.context.replay_watch():
            self.backward_graph.replay()
        if self.wgrad_graph is not None and not self.context.queue.defer(self.wgrad_graph.replay):
            self.wgrad_graph.replay()
        return [self.slot.input_grads[n].detach() if self.input_has_grad.get(n) else None
                for n in self.signature.inputs]


def _mismatch(where: str, what: str, name: str, meta: TensorMeta, value: torch.Tensor) -> str:
    return (f"CUDA graph {where}: {what} {name!r} is {tuple(value.shape)} {value.dtype} on "
            f"{value.device}, the graph was captured for {meta.shape} {meta.dtype} on "
            f"{meta.device} (--cuda-graph-check-inputs)")


class _Replay(torch.autograd.Function):
    """A graphed range inside a node's autograd graph: replays instead of running segments."""

    @staticmethod
    def forward(ctx, graphs: RangeGraphs, where: str, *inputs):
        names = tuple(graphs.signature.inputs)
        outputs = graphs.replay_forward(dict(zip(names, inputs)), f"{where} forward")
        ctx.graphs, ctx.where = graphs, where
        metas = tuple(graphs.signature.outputs.values())
        ctx.mark_non_differentiable(*[o for o, m in zip(outputs, metas) if not m.requires_grad])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        graphs = ctx.graphs
        named = dict(zip(graphs.signature.outputs, grads))
        input_grads = graphs.replay_backward(named, f"{ctx.where} backward")
        return (None, None, *input_grads)


CAPTURE_ROOM = 1.05  # free memory a capture needs, over its warm-up run's reserve


class GraphMemoryError(MemoryError):
    """A capture refused before it started: the device has too little free memory for it."""


class CudaGraphBackend:
    """Captures with `torch.cuda.graph` into one private pool on one side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, body: Callable[[], None], generators: Sequence[torch.Generator]):
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                              capture_error_mode="thread_local"):
            body()
        return graph

    def side_stream(self):
        return torch.cuda.stream(self.stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def reserved_bytes(self) -> int:
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def make_room(self, reserved_before: int, what: str) -> None:
        """After the warm-up run on the capture stream, before the capture: release the blocks
        the warm-up left cached (the capture allocates in its own pool, so they would sit beside
        it unused) and refuse the capture, before it starts, where the device has less free
        than the warm-up needed (its reserve over `reserved_before`, measured with the cache
        empty): a capture that runs out of memory midway can leave the stream and NCCL's
        communicators in a state that later steps hang on."""
        self.synchronize()
        needed = torch.cuda.memory_reserved(self.device) - reserved_before
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(self.device)[0]
        if free < needed * CAPTURE_ROOM:
            raise GraphMemoryError(
                f"{what}: its capture needs about {needed / 2**30:.1f} GiB (what its warm-up "
                f"run took), {free / 2**30:.1f} GiB of the device are free")

    def begin_warmup(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def end_warmup(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


@dataclass
class CaptureContext:
    """What every capture and replay of a run shares."""

    device: torch.device
    queue: object  # the WeightGradQueue
    generators: tuple = ()
    check_inputs: bool = False
    backend: object = None  # CudaGraphBackend (tests: an emulation with the same methods)
    # wraps each forward/backward replay: the watch of the groups whose collectives the graphs
    # hold (EP: the dispatch; CP: the K/V exchange, the aux loss's counts)
    replay_watch: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def capture(self, body: Callable[[], None], draws_random: bool = False):
        """A graph of `body`; generators that body may draw from are registered with it."""
        return self.backend.capture(body, self.generators if draws_random else ())


class GraphRunner:
    """The run factory of a run with `--cuda-graph-impl local` (see the module docstring)."""

    def __init__(self, specs: Sequence[NodeSpec], graphed_modules: set, *,
                 device: torch.device, queue, generators: Sequence[torch.Generator] = (),
                 check_inputs: bool = False, backend_factory=CudaGraphBackend,
                 replay_watch: Callable[[], contextlib.AbstractContextManager]
                 = contextlib.nullcontext):
        self.context = CaptureContext(device=device, queue=queue, generators=tuple(generators),
                                      check_inputs=check_inputs, replay_watch=replay_watch)
        self.backend_factory = backend_factory
        self.ranges = {spec.key: graphed_ranges(spec.segments, graphed_modules)
                       for spec in specs if spec.segments}
        self.ranges = {key: ranges for key, ranges in self.ranges.items() if ranges}
        self.segments = {spec.key: spec.segments for spec in specs}
        self.outputs = {spec.key: tuple(spec.outputs) for spec in specs}
        self.signatures: dict[Key, RangeSignature] = {}
        self.graphs: dict[tuple, RangeGraphs] = {}  # (layer, node, start, microbatch)
        self.slot_buffers: dict[tuple, SlotBuffers] = {}  # (layer, node, start, slot)
        self.recording = False
        self.capture_seconds: Optional[float] = None
        self.pool_bytes = 0

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    @property
    def recorded(self) -> bool:
        """Whether a recording step gave every graphed range its signature (`capture` can
        run)."""
        return all(key + (start,) in self.signatures
                   for key, ranges in self.ranges.items() for start, _ in ranges)

    def __call__(self, spec: NodeSpec, microbatch: int) -> Callable[..., dict]:
        if spec.key not in self.ranges:
            return spec.fn
        if self.recording:
            return self._recording_fn(spec)
        if not self.captured:
            return spec.fn
        return self._replaying_fn(spec, microbatch)

    # -------------------------------------------------------------- node callables
    def _node_fn(self, spec: NodeSpec, run_range) -> Callable[..., dict]:
        """The node's forward with each graphed range run by `run_range(key, start, end,
        values) -> outputs`; the other segments run as they are."""
        ranges, outputs = self.ranges[spec.key], self.outputs[spec.key]

        def node_fn(**inputs):
            values, index = dict(inputs), 0
            for start, end in ranges:
                values.update(run_segments(spec.segments[index:start],
                                           _produced(spec.segments[index:start]), values))
                values.update(run_range(spec, start, end, values))
                index = end
            values.update(run_segments(spec.segments[index:], _produced(spec.segments[index:]),
                                       values))
            return {name: values[name] for name in outputs}
        return node_fn

    def _recording_fn(self, spec: NodeSpec) -> Callable[..., dict]:
        def record(spec, start, end, values):
            segments = spec.segments[start:end]
            names = _range_outputs(spec.segments, start, end, self.outputs[spec.key])
            produced = run_segments(segments, names, values)
            self.signatures[spec.key + (start,)] = RangeSignature(
                {n: TensorMeta.of(values[n]) for n in _range_inputs(segments)},
                {n: TensorMeta.of(v) for n, v in produced.items()})
            return produced
        return self._node_fn(spec, record)

    def _replaying_fn(self, spec: NodeSpec, microbatch: int) -> Callable[..., dict]:
        def replay(spec, start, end, values):
            graphs = self.graphs[spec.key + (start, microbatch)]
            where = f"{spec.label()} {graphs.name} microbatch {microbatch}"
            outputs = _Replay.apply(graphs, where, *[values[n] for n in graphs.signature.inputs])
            return dict(zip(graphs.signature.outputs, outputs))
        return self._node_fn(spec, replay)

    # -------------------------------------------------------------- capture
    def capture(self, plan: Sequence[Action]) -> None:
        """Capture every graph, walking the plan in its replay order (see the module docstring).
        Needs a recorded step first (`recording = True` for one eager step)."""
        missing = [k for k, ranges in self.ranges.items() for s, _ in ranges
                   if k + (s,) not in self.signatures]
        if missing:
            raise RuntimeError(f"CUDA graph capture before a recorded warmup step: no signature "
                               f"for {missing}")
        ctx = self.context
        started = time.perf_counter()
        states = [g.get_state() for g in ctx.generators]
        ctx.backend = backend = self.backend_factory(ctx.device)
        backend.synchronize()
        reserved_before = backend.reserved_bytes()
        slots = microbatch_slots(plan)
        self._warm_up_on_capture_stream()
        backend.make_room(reserved_before, "per-layer CUDA graphs")
        for action in plan:
            for graphs in self._graphs_of(action, slots[action.microbatch]):
                {"F": graphs.capture_forward, "B": graphs.capture_backward,
                 "W": graphs.capture_wgrad}[action.kind]()
        for generator, state in zip(ctx.generators, states):
            generator.set_state(state)
        backend.synchronize()
        self.pool_bytes = backend.reserved_bytes() - reserved_before
        self.capture_seconds = time.perf_counter() - started

    def _graphs_of(self, action: Action, slot: int) -> list[RangeGraphs]:
        key = action.node_key
        ranges = self.ranges.get(key, [])
        if action.kind != "F":
            ranges = list(reversed(ranges))  # backward and wgrad run the ranges last to first
        found = []
        for start, end in ranges:
            graph_key = key + (start, action.microbatch)
            if graph_key not in self.graphs:
                signature = self.signatures[key + (start,)]
                slot_key = key + (start, slot)
                if slot_key not in self.slot_buffers:
                    self.slot_buffers[slot_key] = SlotBuffers(signature, self.context.device)
                segments = self.segments[key][start:end]
                name = "+".join(s.name for s in segments)
                self.graphs[graph_key] = RangeGraphs(name, segments, signature,
                                                     self.slot_buffers[slot_key], self.context)
            found.append(self.graphs[graph_key])
        return found

    def _warm_up_on_capture_stream(self) -> None:
        """One eager forward + backward (+ deferred wgrad) of each range on the capture stream,
        so per-stream handles and workspaces exist before any capture."""
        backend = self.context.backend
        backend.begin_warmup()
        with backend.side_stream():
            for key, ranges in self.ranges.items():
                for start, end in ranges:
                    signature = self.signatures[key + (start,)]
                    self._warm_up_range(self.segments[key][start:end], signature)
        backend.end_warmup()

    def _warm_up_range(self, segments: Sequence[Segment], signature: RangeSignature) -> None:
        ctx = self.context
        buffers = SlotBuffers(signature, ctx.device)
        leaves = {n: b.requires_grad_(signature.inputs[n].requires_grad)
                  for n, b in buffers.inputs.items()}
        key = ("cuda-graph-warmup", id(buffers))
        with torch.enable_grad():
            outputs = run_segments(segments, tuple(signature.outputs), leaves)
        roots = [n for n in buffers.output_grads if outputs[n].requires_grad]
        collect = ctx.queue.collecting(key) if ctx.queue.enabled else contextlib.nullcontext()
        with collect:
            torch.autograd.backward([outputs[n] for n in roots],
                                    [buffers.output_grads[n] for n in roots])
        ctx.queue.run(key)

    # -------------------------------------------------------------- reporting, teardown
    def graph_count(self) -> int:
        return sum(g is not None for r in self.graphs.values()
                   for g in (r.forward_graph, r.backward_graph, r.wgrad_graph))

    def buffer_bytes(self) -> int:
        return sum(b.nbytes() for b in self.slot_buffers.values())

    def release(self) -> None:
        """Free every graph and buffer (before process groups are torn down)."""
        backend = self.context.backend
        if backend is not None:
            backend.synchronize()
        self.graphs.clear()
        self.slot_buffers.clear()
        self.context.backend = None
        if backend is not None:
            backend.synchronize()


def _range_inputs(segments: Sequence[Segment]) -> tuple[str, ...]:
    """Names a run of segments reads that it does not produce itself, in first-use order."""
    produced, needed = set(), []
    for segment in segments:
        needed += [n for n in segment.inputs if n not in produced and n not in needed]
        produced.update(segment.outputs)
    return tuple(needed)


def _produced(segments: Sequence[Segment]) -> tuple[str, ...]:
    return tuple(n for s in segments for n in s.outputs)


def _range_outputs(segments: Sequence[Segment], start: int, end: int,
                   node_outputs: Sequence[str]) -> tuple[str, ...]:
    """What segments[start:end] produce that is read after them: by a later segment or as a
    node output. Values used only inside the range stay inside its graph."""
    later = set(node_outputs) | {n for s in segments[end:] for n in s.inputs}
    return tuple(n for n in _produced(segments[start:end]) if n in later)


# --cuda-graph-modules name -> the segments it graphs (`moe`: the one-node MoE layer's
# segments from the router to the combine; see epoverlap.model.transformer)
MODULE_SEGMENTS = {
    "attn": ("attn",),
    "mlp": ("mlp",),
    "moe_router": ("moe_router",),
    "moe_preprocess": ("moe_preprocess",),
    "moe": ("moe_router", "moe_preprocess", "moe_dispatch", "moe_experts", "moe_combine"),
}


def graphed_modules(modules: Sequence[str]) -> set:
    """Segment names to graph: those of the listed modules, or of every module when the list
    is empty (the whole layer; validation allows that for MoE layers only with a sync-free
    dispatch and no EP overlap, and then the MoE layer is one node)."""
    return {segment for module in (modules or MODULE_SEGMENTS)
            for segment in MODULE_SEGMENTS[module]}


def graphs_span_moe_layer(impl: str, modules: Sequence[str]) -> bool:
    """True when per-layer graphs reach past the dispatch (`moe` or the whole layer): the
    model must then expose each MoE layer as one node (`one_node_moe_layers`)."""
    return impl == "local" and (not modules or "moe" in modules)
