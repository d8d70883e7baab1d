"""Schedules as data: the action vocabulary, pure plan builders, the validator and the printer.

Owns `Action` (forward / backward / weight-grad x node x microbatch x layer, printed as
`F3.attn.L2`, `B2.dispatch.L5`, `W2.mlp.L5`, `F0.embed`, `B1.loss`, and parsed back), the plan
builders (`sequential_plan`, `combined_1f1b_plan` and its early-attention-memory-release
variant), `validate_plan`, which rejects plans that break a dependency and prints the two-lane
grid with the bad step marked, and `format_plan`, the two-lane grid itself.

A plan needs only the model's layout: the `NodeKind`s (name, lane, deferrable) of each layer in
forward order, e.g. attn/dispatch/mlp/combine for an MoE layer and attn/mlp for a dense one,
as the model's `NodeSpec`s declare them. Every microbatch also has an `embed` node first and a
`loss` node last (both compute, weight grads inline).

Per-layer order of the combined 1F1B (forward of microbatch F, layer i, with backward of
microbatch B, layer N-1-i; overlap.md):
   B.combine | F.attn | B.mlp | F.dispatch | W.mlp | B.dispatch | F.mlp | F.combine | B.attn | W.attn
The early-release variant moves B.attn right after B.dispatch (frees attention activations
before F.mlp allocates, at the cost of exposing B.dispatch and F.combine).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from epoverlap.model.nodes import COMM, COMPUTE, NodeKind

EMBED = NodeKind("embed", COMPUTE)
LOSS = NodeKind("loss", COMPUTE)
KINDS = {"F": "forward", "B": "backward", "W": "wgrad"}
_ACTION_RE = re.compile(r"^([FBW])(\d+)\.([a-z_]+)(?:\.L(\d+))?$")

Layout = Sequence[Sequence[NodeKind]]


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


# --------------------------------------------------------------------------- builders
def _forward_microbatch(layout: Layout, mb: int) -> list[Action]:
    actions = [Action("F", mb, "embed")]
    for layer, nodes in enumerate(layout):
        actions.extend(Action("F", mb, node.name, layer) for node in nodes)
    return actions + [Action("F", mb, "loss")]


def _backward_microbatch(layout: Layout, mb: int, delay_wgrad: bool) -> list[Action]:
    actions = [Action("B", mb, "loss")]
    for layer in reversed(range(len(layout))):
        for node in reversed(layout[layer]):
            actions.append(Action("B", mb, node.name, layer))
            if delay_wgrad and node.deferrable:
                actions.append(Action("W", mb, node.name, layer))
    return actions + [Action("B", mb, "embed")]


def sequential_plan(layout: Layout, num_microbatches: int,
                    delay_wgrad: bool = False) -> list[Action]:
    """The reference: each microbatch's whole forward, then its whole backward."""
    plan: list[Action] = []
    for mb in range(num_microbatches):
        plan += _forward_microbatch(layout, mb) + _backward_microbatch(layout, mb, delay_wgrad)
    return plan


def _layer_pair(f_mb: Optional[int], f_layer: Optional[int], f_nodes: Sequence[NodeKind],
                b_mb: Optional[int], b_layer: Optional[int], b_nodes: Sequence[NodeKind],
                delay_wgrad: bool, early_release: bool) -> list[Action]:
    """One layer's forward (microbatch f_mb) interleaved with one layer's backward (b_mb)."""
    f_names = {node.name for node in f_nodes}
    b_kinds = {node.name: node for node in b_nodes}

    def fwd(node):
        return [Action("F", f_mb, node, f_layer)] if f_mb is not None and node in f_names else []

    def bwd(node):
        return [Action("B", b_mb, node, b_layer)] if b_mb is not None and node in b_kinds else []

    def wgrad(node):
        deferrable = node in b_kinds and b_kinds[node].deferrable
        return [Action("W", b_mb, node, b_layer)] if delay_wgrad and deferrable and bwd(node) \
            else []

    order = (bwd("combine") + fwd("attn") + bwd("mlp") + fwd("dispatch") + wgrad("mlp")
             + bwd("dispatch"))
    if early_release:
        order += bwd("attn")
    order += fwd("mlp") + fwd("combine")
    if not early_release:
        order += bwd("attn")
    return order + wgrad("attn")


def combined_1f1b_plan(layout: Layout, num_microbatches: int, delay_wgrad: bool = False,
                       early_release: bool = False) -> list[Action]:
    """F0 alone; then F(i) paired with B(i-1) layer by layer; then B(M-1) alone."""
    num_layers = len(layout)
    plan = _forward_microbatch(layout, 0)
    for mb in range(1, num_microbatches + 1):
        f_mb = mb if mb < num_microbatches else None
        b_mb = mb - 1
        plan.append(Action("B", b_mb, "loss"))
        if f_mb is not None:
            plan.append(Action("F", f_mb, "embed"))
        for i in range(num_layers):
            b_layer = num_layers - 1 - i
            plan += _layer_pair(f_mb, i, layout[i], b_mb, b_layer, layout[b_layer],
                                delay_wgrad, early_release)
        if f_mb is not None:
            plan.append(Action("F", f_mb, "loss"))
        plan.append(Action("B", b_mb, "embed"))
    return plan


PLAN_BUILDERS = {
    "sequential": lambda layout, m, d: sequential_plan(layout, m, d),
    "combined_1f1b": lambda layout, m, d: combined_1f1b_plan(layout, m, d),
    "combined_1f1b_early_release": lambda layout, m, d: combined_1f1b_plan(
        layout, m, d, early_release=True),
}


def build_plan(name: str, layout: Layout, num_microbatches: int,
               delay_wgrad: bool = False) -> list[Action]:
    if name not in PLAN_BUILDERS:
        raise ValueError(f"plan {name!r}: allowed {', '.join(PLAN_BUILDERS)}")
    return PLAN_BUILDERS[name](layout, num_microbatches, delay_wgrad)


# --------------------------------------------------------------------------- printing
def node_kinds(layout: Layout) -> dict:
    """(layer, name) -> NodeKind for every node of a microbatch's chain, embed and loss included."""
    kinds = {(None, EMBED.name): EMBED, (None, LOSS.name): LOSS}
    for layer, nodes in enumerate(layout):
        kinds.update({(layer, node.name): node for node in nodes})
    return kinds


def action_lane(action: Action, kinds: dict) -> str:
    """The lane an action runs on: its node's lane, except W actions (always compute)."""
    kind = kinds.get(action.node_key)
    return COMM if kind is not None and kind.lane == COMM and action.kind != "W" else COMPUTE


def format_plan(plan: Sequence[Action], layout: Layout, mark: Optional[int] = None,
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

    def __init__(self, plan: Sequence[Action], layout: Layout, step: Optional[int], reason: str):
        self.step, self.reason = step, reason
        where = f"step {step} ({plan[step]})" if step is not None and step < len(plan) else "end"
        super().__init__(f"invalid plan at {where}: {reason}\n"
                         + format_plan(plan, layout, mark=step, note=reason))


def _chain(layout: Layout) -> list[tuple[Optional[int], str]]:
    """Node keys of one microbatch in forward order."""
    keys: list[tuple[Optional[int], str]] = [(None, EMBED.name)]
    for layer, nodes in enumerate(layout):
        keys.extend((layer, node.name) for node in nodes)
    return keys + [(None, LOSS.name)]


def _dependency_error(action: Action, done: set, chain_index: dict, chain: list,
                      kinds: dict, num_microbatches: int) -> Optional[str]:
    key = action.node_key
    if key not in chain_index:
        return f"unknown node {action.node}" + ("" if action.layer is None
                                                 else f" in layer {action.layer}")
    if not 0 <= action.microbatch < num_microbatches:
        return f"microbatch {action.microbatch} outside 0..{num_microbatches - 1}"
    if (action.kind, action.microbatch, key) in done:
        return "runs twice"
    pos, mb = chain_index[key], action.microbatch
    if action.kind == "F" and pos > 0 and ("F", mb, chain[pos - 1]) not in done:
        return f"needs F{mb} of {_label(chain[pos - 1])} first"
    if action.kind == "B":
        if ("F", mb, key) not in done:
            return "backward before its forward"
        if pos + 1 < len(chain) and ("B", mb, chain[pos + 1]) not in done:
            return f"needs B{mb} of {_label(chain[pos + 1])} first"
    if action.kind == "W":
        if not kinds[key].deferrable:
            return f"node {action.node} has no weight grads to defer"
        if ("B", mb, key) not in done:
            return "weight grad before its backward"
    return None


def _label(key) -> str:
    layer, node = key
    return node if layer is None else f"{node}.L{layer}"


def validate_plan(plan: Sequence[Action], layout: Layout, num_microbatches: int,
                  delay_wgrad: bool = False) -> None:
    """Raise PlanError unless the plan runs every node of every microbatch legally, once."""
    chain = _chain(layout)
    chain_index = {key: i for i, key in enumerate(chain)}
    kinds = node_kinds(layout)
    done: set = set()
    for step, action in enumerate(plan):
        if action.kind == "W" and not delay_wgrad:
            raise PlanError(plan, layout, step, "W action while weight-grad deferral is off")
        error = _dependency_error(action, done, chain_index, chain, kinds, num_microbatches)
        if error:
            raise PlanError(plan, layout, step, error)
        done.add((action.kind, action.microbatch, action.node_key))
    for mb in range(num_microbatches):
        for key in chain:
            actions = ("F", "B") + (("W",) if delay_wgrad and kinds[key].deferrable else ())
            for kind in actions:
                if (kind, mb, key) not in done:
                    raise PlanError(plan, layout, None, f"{kind}{mb}.{_label(key)} never runs")
