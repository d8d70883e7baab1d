"""Schedules as data: the action vocabulary, chunks and steps, pure plan builders, the
validator and the printer.

Owns `Action` (forward / backward / weight-grad x node x microbatch x layer, printed as
`F3.attn.L2`, `B2.dispatch.L5`, `W2.mlp.L5`, `F0.embed`, `B1.loss`, `F2.send.L3`, and parsed
back), `Chunk` (what one microbatch runs in one model chunk of a stage), `Step` (a forward and/or
a backward of a chunk) and `expand_steps`, which turns steps into node actions; the one-stage
builders (`sequential_plan`, `combined_1f1b_plan` and its early-attention-memory-release
variant, the paired ends); `PLANS`, the one registry from a plan's name to its form
(`PlanForm`; the one road from a name to its plans is `schedule.pipeline.named_plans`);
`validate_plan`, which rejects a stage's plan that breaks a dependency and prints the two-lane
grid with the bad step marked; and `format_plan`, the two-lane grid itself. Pipeline
schedules (1F1B, interleaved) make their steps in `schedule.pipeline` and expand them here.

A plan needs only the model's layout: the `NodeKind`s (name, lane, deferrable, p2p) of each
layer in forward order, e.g. attn/dispatch/mlp/combine for an MoE layer and attn/mlp for a dense
one, as the model's `NodeSpec`s declare them. A chunk starts with a head node (`embed`, or a
pipeline `recv` of the previous stage's activation) and ends with a tail node (`loss`, or a
pipeline `send` to the next stage); without pipeline parallelism the model is one chunk,
`embed` + layers + `loss` (both compute, weight grads inline).

Per-layer order of the combined 1F1B (forward of microbatch F, layer i, with backward of
microbatch B, layer N-1-i; overlap.md):
   B.combine | F.attn | B.mlp | F.dispatch | W.mlp | B.dispatch | F.mlp | F.combine | B.attn | W.attn
The early-release variant moves B.attn right after B.dispatch (frees attention activations
before F.mlp allocates, at the cost of exposing B.dispatch and F.combine). A combined step of
two chunks is: B's tail, F's head, the layer pairs, F's tail, B's head.
A layer whose attention gathers K/V on the comm lane (context parallelism, `model.context`)
has `qkv` (compute) and `kv_gather` (comm) before `attn`; the pair then runs
   B.combine | F.qkv | F.kv_gather | B.mlp | F.attn | F.dispatch | ... | B.attn | B.kv_gather
   | W.attn | B.qkv | W.qkv
so B.mlp hides the gather and W.attn its backward. A layout without them plans as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from epoverlap.model.nodes import COMM, COMPUTE, SEND, NodeKind

EMBED = NodeKind("embed", COMPUTE)
LOSS = NodeKind("loss", COMPUTE)
KINDS = {"F": "forward", "B": "backward", "W": "wgrad"}
_ACTION_RE = re.compile(r"^([FBW])(\d+)\.([a-z][a-z_0-9]*?)(?:\.L(\d+))?$")

Layout = Sequence[Sequence[NodeKind]]  # node kinds of each layer of a one-chunk model
NodeKey = tuple[Optional[int], str]  # (layer or None, node name)


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    microbatch: int
    node: str
    layer: Optional[int] = None

    def __str__(self) -> str:
        text = f"{self.kind}{self.microbatch}.{self.node}"
        return text if self.layer is None else f"{text}.L{self.layer}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ValueError(f"not an action: {text!r} (expected e.g. F3.attn.L2, B1.loss, "
                             f"W2.mlp.L0)")
        kind, mb, node, layer = match.groups()
        return cls(kind, int(mb), node, None if layer is None else int(layer))

    @property
    def phase(self) -> str:
        return KINDS[self.kind]

    @property
    def node_key(self) -> tuple[Optional[int], str]:
        return (self.layer, self.node)


def parse_plan(text: str) -> list[Action]:
    """Whitespace- or comma-separated action strings -> actions."""
    return [Action.parse(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]


def plan_to_string(plan: Iterable[Action]) -> str:
    return " ".join(str(a) for a in plan)


# --------------------------------------------------------------------------- chunks, steps
@dataclass(frozen=True)
class Chunk:
    """One model chunk as a microbatch runs it on a stage: `head`, the nodes of the layers
    first_layer, first_layer + 1, ..., then `tail`. A P2P head/tail takes the layer it borders
    as its node's layer (`recv.L4` receives layer 4's input, `send.L5` sends layer 5's output);
    `embed` and `loss` have none."""

    first_layer: int
    layers: tuple[tuple[NodeKind, ...], ...]
    head: NodeKind = EMBED
    tail: NodeKind = LOSS

    @property
    def head_key(self) -> NodeKey:
        return (self.first_layer if self.head.p2p else None, self.head.name)

    @property
    def tail_key(self) -> NodeKey:
        last = self.first_layer + len(self.layers) - 1
        return (last if self.tail.p2p else None, self.tail.name)

    def chain(self) -> list[tuple[Optional[int], NodeKind]]:
        """(layer, kind) of every node in forward order, head and tail included."""
        nodes = [(self.head_key[0], self.head)]
        for offset, kinds in enumerate(self.layers):
            nodes += [(self.first_layer + offset, kind) for kind in kinds]
        return nodes + [(self.tail_key[0], self.tail)]


StageLayout = Sequence[Chunk]  # a stage's chunks, by virtual stage index


def stage_layout(nodes: Sequence[tuple[Optional[int], NodeKind]]) -> list[Chunk]:
    """A stage's chunks from (layer, kind) of its nodes in forward order, as its model's
    NodeSpecs declare them: each chunk runs from a head (a node of no layer, or a P2P receive)
    through its layers' nodes to a tail (a node of no layer, or a P2P send)."""
    chunks: list[Chunk] = []
    head: Optional[NodeKind] = None
    layers: list[tuple[int, list[NodeKind]]] = []
    for layer, kind in nodes:
        if head is None:
            head = kind
        elif layer is None or kind.p2p == SEND:
            chunks.append(Chunk(layers[0][0], tuple(tuple(k) for _, k in layers), head, kind))
            head, layers = None, []
        elif layers and layers[-1][0] == layer:
            layers[-1][1].append(kind)
        else:
            layers.append((layer, [kind]))
    if head is not None:
        raise ValueError(f"the nodes end inside a chunk that starts with {head.name}")
    return chunks


def as_chunks(layout) -> list[Chunk]:
    """A stage's chunks; a per-layer `Layout` is the one chunk of a whole model."""
    if layout and all(isinstance(item, Chunk) for item in layout):
        return list(layout)
    return [Chunk(0, tuple(tuple(kinds) for kinds in layout))]


@dataclass(frozen=True)
class Step:
    """One forward and/or one backward of a (microbatch, chunk index) on a stage; or, with
    `partner`, two forwards (or two backwards) of the same chunk interleaved node by node: the
    one given as `forward` (or `backward`) and `partner`."""

    forward: Optional[tuple[int, int]] = None
    backward: Optional[tuple[int, int]] = None
    partner: Optional[tuple[int, int]] = None

    def __post_init__(self):
        if self.partner is not None and (self.forward is None) == (self.backward is None):
            raise ValueError("a step with a partner has one forward or one backward, not both")

    def label(self, with_chunks: bool = False) -> str:
        """'F3+B1', 'F0+F1', or with chunks 'F3c0+B1c1'."""
        parts = [(kind, work) for kind, work in (("F", self.forward), ("B", self.backward))
                 if work is not None]
        if self.partner is not None:
            parts.append((parts[0][0], self.partner))
        return "+".join(f"{kind}{mb}" + (f"c{chunk}" if with_chunks else "")
                        for kind, (mb, chunk) in parts)


def _forward_chunk(chunk: Chunk, mb: int) -> list[Action]:
    return [Action("F", mb, kind.name, layer) for layer, kind in chunk.chain()]


def _backward_chunk(chunk: Chunk, mb: int, delay_wgrad: bool) -> list[Action]:
    actions = []
    for layer, kind in reversed(chunk.chain()):
        actions.append(Action("B", mb, kind.name, layer))
        if delay_wgrad and kind.deferrable:
            actions.append(Action("W", mb, kind.name, layer))
    return actions


def _layer_pair(f_mb: Optional[int], f_layer: Optional[int], f_nodes: Sequence[NodeKind],
                b_mb: Optional[int], b_layer: Optional[int], b_nodes: Sequence[NodeKind],
                delay_wgrad: bool, early_release: bool) -> list[Action]:
    """One layer's forward (microbatch f_mb) interleaved with one layer's backward (b_mb)."""
    def fwd(slot):
        return [Action("F", f_mb, name, f_layer) for name in _slot_nodes(f_nodes, slot)] \
            if f_mb is not None else []

    def bwd(slot):
        return [Action("B", b_mb, name, b_layer) for name in _slot_nodes(b_nodes, slot)[::-1]] \
            if b_mb is not None else []

    def wgrad(slot):
        return [Action("W", b_mb, name, b_layer)
                for name in _slot_nodes(b_nodes, slot, deferrable=True)[::-1]] \
            if delay_wgrad and b_mb is not None else []

    gathers = f_mb is not None and bool(_slot_nodes(f_nodes, GATHER))
    head = (fwd("qkv") + fwd(GATHER) + bwd("mlp") + fwd("attn") if gathers
            else fwd("attn") + bwd("mlp"))
    order = bwd("combine") + head + fwd("dispatch") + wgrad("mlp") + bwd("dispatch")
    if early_release:
        order += bwd("attn") + bwd(GATHER)
    order += fwd("mlp") + fwd("combine")
    if not early_release:
        order += bwd("attn") + bwd(GATHER)
    return order + wgrad("attn") + bwd("qkv") + wgrad("qkv")


def _slot_nodes(nodes: Sequence[NodeKind], slot: str, deferrable: bool = False) -> list[str]:
    """Names of the nodes that run in `slot`, in forward order: the node of that name, or
    the nodes of an MoE layer in waves in its place (`NodeKind.group`); `deferrable`: only
    those with weight grads to defer."""
    return [node.name for node in nodes
            if node.group == slot and (node.deferrable or not deferrable)]


# Two microbatches' nodes of one layer, same direction, each split-size read (F dispatch) issued
# once the other microbatch has compute queued behind it, each all-to-all beside the other's
# compute. A layer with other nodes interleaves them one by one in chain order.
# With a K/V gather (context parallelism) each microbatch's gather runs beside the other's
# qkv or attn compute.
GATHER = "kv_gather"
_FORWARD_PAIR = ("a.qkv", "a.kv_gather", "b.qkv", "b.kv_gather", "a.attn", "b.attn",
                 "a.dispatch", "a.mlp", "b.dispatch", "b.mlp", "a.combine", "b.combine")
_BACKWARD_PAIR = ("a.combine", "b.combine", "a.mlp", "a.dispatch", "b.mlp", "a.W.mlp",
                  "b.dispatch", "b.W.mlp", "a.attn", "a.kv_gather", "a.W.attn", "b.attn",
                  "b.kv_gather", "b.W.attn", "a.qkv", "a.W.qkv", "b.qkv", "b.W.qkv")


def _same_direction_layer(kind: str, a: int, b: int, layer: int, nodes: Sequence[NodeKind],
                          delay_wgrad: bool) -> list[Action]:
    """Layer `layer` of microbatches a and b, both forward (kind "F") or both backward ("B")."""
    slots = list(dict.fromkeys(node.group for node in nodes))
    template = _FORWARD_PAIR if kind == "F" else _BACKWARD_PAIR
    known = {entry.split(".")[-1] for entry in template}
    if not set(slots) <= known:  # an unknown layout: one node of each in turn
        order = slots if kind == "F" else slots[::-1]
        template = tuple(f"{who}.{slot}" for slot in order for who in "ab")
        if kind == "B":
            template += tuple(f"{who}.W.{slot}" for slot in order for who in "ab")
    plan = []
    for entry in template:
        who, *wgrad, slot = entry.split(".")
        if wgrad and not delay_wgrad:
            continue
        names = _slot_nodes(nodes, slot, deferrable=bool(wgrad))
        mb = a if who == "a" else b
        plan += [Action("W" if wgrad else kind, mb, name, layer)
                 for name in (names if kind == "F" else names[::-1])]
    return plan


def _paired_step(kind: str, chunk: Chunk, a: int, b: int, delay_wgrad: bool) -> list[Action]:
    """Microbatches a and b through one chunk in the same direction, layer by layer."""
    layers = list(enumerate(chunk.layers))
    if kind == "B":
        layers.reverse()
    edges = [(chunk.head, chunk.head_key), (chunk.tail, chunk.tail_key)]
    first, last = edges if kind == "F" else edges[::-1]
    plan = [Action(kind, mb, first[0].name, first[1][0]) for mb in (a, b)]
    for offset, nodes in layers:
        plan += _same_direction_layer(kind, a, b, chunk.first_layer + offset, nodes,
                                      delay_wgrad)
    return plan + [Action(kind, mb, last[0].name, last[1][0]) for mb in (a, b)]


def _combined_step(f_chunk: Chunk, f_mb: int, b_chunk: Chunk, b_mb: int, delay_wgrad: bool,
                   early_release: bool) -> list[Action]:
    """F's chunk and B's chunk node by node: forward layer i beside backward layer n-1-i."""
    f_layers, b_layers = f_chunk.layers, b_chunk.layers
    plan = [Action("B", b_mb, b_chunk.tail.name, b_chunk.tail_key[0]),
            Action("F", f_mb, f_chunk.head.name, f_chunk.head_key[0])]
    for i in range(max(len(f_layers), len(b_layers))):
        f = (f_mb, f_chunk.first_layer + i, f_layers[i]) if i < len(f_layers) \
            else (None, None, ())
        j = len(b_layers) - 1 - i
        b = (b_mb, b_chunk.first_layer + j, b_layers[j]) if j >= 0 else (None, None, ())
        plan += _layer_pair(*f, *b, delay_wgrad, early_release)
    return plan + [Action("F", f_mb, f_chunk.tail.name, f_chunk.tail_key[0]),
                   Action("B", b_mb, b_chunk.head.name, b_chunk.head_key[0])]


def expand_steps(steps: Sequence[Step], chunks: StageLayout, combined: bool,
                 delay_wgrad: bool = False, early_release: bool = False) -> list[Action]:
    """Steps -> node actions. `combined`: a step with both a forward and a backward interleaves
    them node by node (the combined 1F1B); otherwise it runs the forward, then the backward."""
    plan: list[Action] = []
    for step in steps:
        if step.partner is not None:
            kind, work = ("F", step.forward) if step.forward else ("B", step.backward)
            if not combined or work[1] != step.partner[1]:
                plan += expand_steps([Step(**{"forward" if kind == "F" else "backward": w})
                                      for w in (work, step.partner)], chunks, False,
                                     delay_wgrad)
                continue
            plan += _paired_step(kind, chunks[work[1]], work[0], step.partner[0], delay_wgrad)
            continue
        f_chunk = chunks[step.forward[1]] if step.forward else None
        b_chunk = chunks[step.backward[1]] if step.backward else None
        if combined and f_chunk and b_chunk:
            plan += _combined_step(f_chunk, step.forward[0], b_chunk, step.backward[0],
                                   delay_wgrad, early_release)
            continue
        if f_chunk:
            plan += _forward_chunk(f_chunk, step.forward[0])
        if b_chunk:
            plan += _backward_chunk(b_chunk, step.backward[0], delay_wgrad)
    return plan


# --------------------------------------------------------------------------- one-stage builders
def sequential_plan(layout, num_microbatches: int, delay_wgrad: bool = False) -> list[Action]:
    """The reference: each microbatch's whole forward, then its whole backward."""
    steps = [Step((mb, 0), (mb, 0)) for mb in range(num_microbatches)]
    return expand_steps(steps, as_chunks(layout), False, delay_wgrad)


def combined_1f1b_plan(layout, num_microbatches: int, delay_wgrad: bool = False,
                       early_release: bool = False) -> list[Action]:
    """F0 alone; then F(i) paired with B(i-1) layer by layer; then B(M-1) alone."""
    m = num_microbatches
    steps = ([Step((0, 0))] + [Step((mb, 0), (mb - 1, 0)) for mb in range(1, m)]
             + [Step(None, (m - 1, 0))])
    return expand_steps(steps, as_chunks(layout), True, delay_wgrad, early_release)


def paired_ends_steps(num_microbatches: int) -> list[Step]:
    """The combined 1F1B with its ends overlapped too: F0 beside F1, then F(i) beside B(i-2),
    then B(M-2) beside B(M-1). The plain form leaves F0 and B(M-1) alone (no compute beside
    their all-to-alls: at 4 microbatches two of five phases); this one holds one microbatch's
    activations more (three microbatches in flight in the steady state instead of two)."""
    m = num_microbatches
    if m < 2:
        return [Step((0, 0)), Step(None, (0, 0))]
    return ([Step((0, 0), partner=(1, 0))]
            + [Step((mb, 0), (mb - 2, 0)) for mb in range(2, m)]
            + [Step(None, (m - 2, 0), partner=(m - 1, 0))])


def combined_1f1b_paired_ends_plan(layout, num_microbatches: int,
                                   delay_wgrad: bool = False) -> list[Action]:
    return expand_steps(paired_ends_steps(num_microbatches), as_chunks(layout), True,
                        delay_wgrad)


@dataclass(frozen=True)
class PlanForm:
    """What a plan's name means to the builders: the combined 1F1B order or the sequential one,
    and the combined order's variants."""

    combined: bool
    early_release: bool = False  # each paired step runs B.attn before F.mlp (memory)
    paired_ends: bool = False  # F0 beside F1, B(M-2) beside B(M-1) (one stage of one chunk)


# the one registry from a plan's name to its form, read by `pipeline.named_plans` (every
# stage's plans; one stage's, `pipeline.build_plan`) for training and the simulator alike
PLANS = {
    "sequential": PlanForm(combined=False),
    "combined_1f1b": PlanForm(combined=True),
    "combined_1f1b_early_release": PlanForm(combined=True, early_release=True),
    "combined_1f1b_paired_ends": PlanForm(combined=True, paired_ends=True),
}


def plan_form(name: str) -> PlanForm:
    if name not in PLANS:
        raise ValueError(f"plan {name!r}: allowed {', '.join(PLANS)}")
    return PLANS[name]


# --------------------------------------------------------------------------- printing
def node_kinds(layout) -> dict:
    """(layer, name) -> NodeKind for every node of a stage's chunks, head and tail included."""
    return {(layer, kind.name): kind for chunk in as_chunks(layout)
            for layer, kind in chunk.chain()}


def action_lane(action: Action, kinds: dict) -> str:
    """The lane an action runs on: its node's lane, except W actions (always compute)."""
    kind = kinds.get(action.node_key)
    return COMM if kind is not None and kind.lane == COMM and action.kind != "W" else COMPUTE


def format_plan(plan: Sequence[Action], layout, mark: Optional[int] = None,
                note: str = "") -> str:
    """Two-lane grid: one row per step, the action in its lane's column; `mark` flags a row."""
    kinds = node_kinds(layout)
    width = max([len(str(a)) for a in plan] + [8])
    lines = [f"   step | {'compute':<{width}} | comm", "  " + "-" * (width * 2 + 12)]
    for step, action in enumerate(plan):
        text = str(action)
        cells = (text, "") if action_lane(action, kinds) == COMPUTE else ("", text)
        flag = ">>" if step == mark else "  "
        row = f"{flag}{step:5d} | {cells[0]:<{width}} | {cells[1]}"
        if step == mark and note:
            row += f"   <-- {note}"
        lines.append(row.rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------- validation
class PlanError(ValueError):
    """A plan that breaks a dependency; the message holds the grid with the bad step marked."""

    def __init__(self, plan: Sequence[Action], layout, step: Optional[int], reason: str):
        self.step, self.reason = step, reason
        where = f"step {step} ({plan[step]})" if step is not None and step < len(plan) else "end"
        super().__init__(f"invalid plan at {where}: {reason}\n"
                         + format_plan(plan, layout, mark=step, note=reason))


def _chains(layout) -> list[list[NodeKey]]:
    """Node keys of each chunk of one microbatch, in forward order."""
    return [[(layer, kind.name) for layer, kind in chunk.chain()] for chunk in as_chunks(layout)]


def _dependency_error(action: Action, done: set, position: dict, kinds: dict,
                      num_microbatches: int) -> Optional[str]:
    key = action.node_key
    if key not in position:
        return f"unknown node {action.node}" + ("" if action.layer is None
                                                 else f" in layer {action.layer}")
    if not 0 <= action.microbatch < num_microbatches:
        return f"microbatch {action.microbatch} outside 0..{num_microbatches - 1}"
    if (action.kind, action.microbatch, key) in done:
        return "runs twice"
    before, after, mb = *position[key], action.microbatch
    if action.kind == "F" and before is not None and ("F", mb, before) not in done:
        return f"needs F{mb} of {_label(before)} first"
    if action.kind == "B":
        if ("F", mb, key) not in done:
            return "backward before its forward"
        if after is not None and ("B", mb, after) not in done:
            return f"needs B{mb} of {_label(after)} first"
    if action.kind == "W":
        if not kinds[key].deferrable:
            return f"node {action.node} has no weight grads to defer"
        if ("B", mb, key) not in done:
            return "weight grad before its backward"
    return None


def _label(key) -> str:
    layer, node = key
    return node if layer is None else f"{node}.L{layer}"


def validate_plan(plan: Sequence[Action], layout, num_microbatches: int,
                  delay_wgrad: bool = False) -> None:
    """Raise PlanError unless the plan runs every node of every microbatch legally, once.

    Checks one stage: dependencies inside each chunk (a chunk's input from another stage is
    the P2P nodes' business; `schedule.pipeline.validate_pipeline` checks those across stages).
    """
    chains = _chains(layout)
    position = {key: (chain[i - 1] if i else None, chain[i + 1] if i + 1 < len(chain) else None)
                for chain in chains for i, key in enumerate(chain)}
    kinds = node_kinds(layout)
    done: set = set()
    for step, action in enumerate(plan):
        if action.kind == "W" and not delay_wgrad:
            raise PlanError(plan, layout, step, "W action while weight-grad deferral is off")
        error = _dependency_error(action, done, position, kinds, num_microbatches)
        if error:
            raise PlanError(plan, layout, step, error)
        done.add((action.kind, action.microbatch, action.node_key))
    for mb in range(num_microbatches):
        for key in (key for chain in chains for key in chain):
            actions = ("F", "B") + (("W",) if delay_wgrad and kinds[key].deferrable else ())
            for kind in actions:
                if (kind, mb, key) not in done:
                    raise PlanError(plan, layout, None, f"{kind}{mb}.{_label(key)} never runs")
