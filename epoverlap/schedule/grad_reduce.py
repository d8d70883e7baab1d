"""When each gradient bucket's data-parallel reduction is issued (--overlap-grad-reduce): plan
data, no streams.

Owns `ReduceBucket` (a bucket as the schedule sees it: its name and the owner whose actions
write its grads: a layer, or the `embed` / `loss` node), `ReduceAction` (one bucket's reduce as
the executor runs it and the span recorder names it, `grad_reduce.<bucket>`) and
`reduce_points`, which says after which action of a plan each bucket's reduce is issued. The
buckets themselves (views of the grad buffers, the groups) are `training.optimizer.grads`'.

A bucket is complete at the plan's last action that writes it: the last backward (B) of one of
its owner's nodes, or the last delayed weight grad (W) of one; pipeline transfers (`send`,
`recv`) write no grads. Its reduce is issued right after that action or, where the plan issues
comm-lane actions right after it (the chain's next all-to-all, the stage's grad sent back to
the previous stage), after those: the comm lane runs in issue order, and a reduce ahead of them
would hold up the chain. Buckets are issued in their order, each no earlier than the one before,
so every plan issues the same reduces in the same order, and the ranks of a data-parallel group
(which run one plan) issue them at the same place among their other collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from epoverlap.model.nodes import COMM
from epoverlap.schedule.plan import Action, action_lane

GRAD_REDUCE = "grad_reduce"  # the node name of a bucket's reduce in spans


@dataclass(frozen=True)
class ReduceBucket:
    """`layer`: the layer whose nodes write the bucket; None: the node `node` does (the
    embedding's `embed`, the final norm and head's `loss`)."""

    name: str
    layer: Optional[int]
    node: Optional[str] = None

    @property
    def owner(self) -> tuple[Optional[int], Optional[str]]:
        return (self.layer, None) if self.layer is not None else (None, self.node)


@dataclass(frozen=True)
class ReduceAction:
    """One bucket's reduce, issued after an action of `microbatch` (the step's last one to
    write the bucket)."""

    bucket: ReduceBucket
    microbatch: int

    def __str__(self) -> str:
        return f"{GRAD_REDUCE}.{self.bucket.name}"


class BucketReducer(Protocol):
    """What the executor reduces: the buckets, in their order, and one bucket's reduce (run on
    the comm lane, after the compute lane's work issued so far)."""

    buckets: Sequence[ReduceBucket]

    def reduce_bucket(self, index: int) -> None: ...


def _writer(action: Action, kinds: dict) -> Optional[tuple]:
    """The owner an action writes grads of (None: a forward, or a pipeline transfer)."""
    kind = kinds.get(action.node_key)
    if action.kind == "F" or kind is None or kind.p2p is not None:
        return None
    return (action.layer, None) if action.layer is not None else (None, action.node)


def reduce_points(plan: Sequence[Action], kinds: dict,
                  buckets: Sequence[ReduceBucket]) -> dict[int, list[int]]:
    """plan index -> the buckets (indices, in order) whose reduce is issued right after that
    action (module docstring). `kinds`: (layer, node) -> NodeKind of the plan's nodes. A bucket
    that no action writes is issued after the last action."""
    last: dict[tuple, int] = {}
    for index, action in enumerate(plan):
        owner = _writer(action, kinds)
        if owner is not None:
            last[owner] = index
    points: dict[int, list[int]] = {}
    previous = 0
    for number, bucket in enumerate(buckets):
        due = last.get(bucket.owner, len(plan) - 1)
        while due + 1 < len(plan) and action_lane(plan[due + 1], kinds) == COMM:
            due += 1
        previous = max(due, previous)
        points.setdefault(previous, []).append(number)
    return points
