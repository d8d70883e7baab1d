"""What a model exposes to a scheduler: `NodeSpec`, a piece of a layer with named inputs and
outputs, the lane its work belongs on, and whether it owns deferrable weight-grad work.

Values between nodes are named. A node's callable receives its inputs as keyword arguments
with *local* names and returns a dict with local output names; `NodeSpec.inputs` / `outputs`
map local names to the microbatch-wide value names: the hidden state entering a layer
(`hidden_value(2)` = "hidden.L2") or a value one layer passes between its own nodes
(`layer_value(2, "residual")` = "L2.residual"); models name them through these two helpers.
Every differentiable value has exactly one consumer, so grads never need summing across nodes.
Cutting a node out of autograd is the schedule's business (`epoverlap.schedule.node_run`).

Pipeline boundaries are nodes too: a `recv` node (kind p2p=RECV) at the start of a model chunk
receives the chunk's input activation from the previous pipeline stage in its forward and sends
that activation's grad back in its backward; a `send` node (p2p=SEND) at the end of a chunk sends
the output activation to the next stage and receives its grad. Both run on the comm lane, and
their backward is not autograd's: `NodeSpec.backward` takes the grads of the node's outputs and
returns those of its inputs (local names), as a transfer's reverse direction.

An MoE layer in waves (--moe-a2a-waves, `model.waves`) cuts its dispatch, mlp and combine
into per-wave nodes (`dispatch_w0`, `mlp_w0`, `return_w0`, ...). Each such node names its
`wave` (the executor chains a wave's nodes on their own event, so wave i's experts run while
wave i+1's all-to-all does) and its `slot`, the unsplit node whose place it takes in a plan
(dispatch_c* -> dispatch; mlp_c* and return_c* -> mlp); every other node's slot is its name.

A node may also declare its forward as `Segment`s run in order over one namespace of local
names (the node's inputs, then each segment's outputs). Segment names are the regions users
name in `--cuda-graph-modules` (attn, moe_router, moe_preprocess, mlp): a run factory can then
replace a contiguous range of segments by a graph replay without the model knowing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

COMPUTE = "compute"
COMM = "comm"
SEND = "send"  # pipeline boundary at a chunk's end: forward sends the activation, backward
#                receives its grad
RECV = "recv"  # pipeline boundary at a chunk's start: forward receives the activation,
#                backward sends its grad


def hidden_value(layer: int) -> str:
    """The hidden state entering layer `layer` (the one leaving layer - 1)."""
    return f"hidden.L{layer}"


def layer_value(layer: int, name: str) -> str:
    """A value layer `layer` passes between its own nodes (local name `name`)."""
    return f"L{layer}.{name}"


@dataclass(frozen=True)
class NodeKind:
    """The facts a plan needs about a node: its name, its lane, whether a W action can run its
    weight grads later, whether it is a pipeline boundary (`p2p`: SEND or RECV; None for
    every other node), and for the nodes of an MoE layer in waves their slot and wave. Written once,
    in the model's `NodeSpec`."""

    name: str
    lane: str
    deferrable: bool = False
    p2p: Optional[str] = None
    slot: Optional[str] = None  # the unsplit node this one's place is (None: its own name)
    wave: Optional[int] = None  # its wave in an MoE layer in waves, if any

    @property
    def group(self) -> str:
        """The plan slot this node runs in: `slot`, or its own name."""
        return self.slot or self.name


@dataclass(frozen=True)
class Segment:
    """A named piece of a node's forward: fn(**inputs) -> dict of outputs (local names)."""

    name: str
    fn: Callable[..., dict]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def run_segments(segments: Sequence[Segment], outputs: Sequence[str],
                 values: dict) -> dict:
    """Run `segments` in order over the namespace `values`; return the `outputs` picked from it."""
    values = dict(values)
    for segment in segments:
        produced = segment.fn(**{name: values[name] for name in segment.inputs})
        if set(produced) != set(segment.outputs):
            raise RuntimeError(f"segment {segment.name} returned {sorted(produced)}, declared "
                               f"{sorted(segment.outputs)}")
        values.update(produced)
    return {name: values[name] for name in outputs}


def segmented(segments: Sequence[Segment], outputs: Sequence[str]) -> Callable[..., dict]:
    """The node callable that runs `segments` in order and returns `outputs`."""
    segments, outputs = tuple(segments), tuple(outputs)

    def node_fn(**inputs):
        return run_segments(segments, outputs, inputs)
    return node_fn


@dataclass(frozen=True)
class NodeSpec:
    """A node a model exposes. `layer` is None for the embedding and loss nodes."""

    name: str
    layer: Optional[int]
    lane: str
    fn: Callable[..., dict]
    inputs: dict  # local name -> value name
    outputs: dict  # local name -> value name
    has_weights: bool = False  # owns weight-grad work that can be deferred
    loss: Optional[str] = None  # local name of the scalar loss this node outputs, if any
    segments: tuple[Segment, ...] = ()  # the forward as named pieces (fn runs them), if any
    p2p: Optional[str] = None  # SEND or RECV for a pipeline boundary node
    backward: Optional[Callable[..., dict]] = None  # P2P nodes: output grads -> input grads
    slot: Optional[str] = None  # MoE layers in waves: the unsplit node's name (NodeKind)
    wave: Optional[int] = None  # MoE layers in waves: the wave (NodeKind)

    @property
    def kind(self) -> NodeKind:
        return NodeKind(self.name, self.lane, self.has_weights, self.p2p, self.slot, self.wave)

    @property
    def key(self) -> tuple[Optional[int], str]:
        return (self.layer, self.name)

    def label(self) -> str:
        return self.name if self.layer is None else f"{self.name}.L{self.layer}"
