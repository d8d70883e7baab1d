"""Per compute node: the time it computed, apart from the time it waited on the other lane;
per comm node: the time it ran and the part of it no compute covered.

Owns `NodePhase` (a layer's node in one phase: `2 mlp backward`; not the model's `NodePhase`, a
node type's lane), the per-node-phase figures of a run (`node_figures`: summed over the
microbatches of a step, mean over the steps and ranks that ran the kind) and the comparison of
two runs of one model (`compare_runs`: per kind and per layer, compute time of the second run
over the first's: with a sequential run first and an overlapped one second, the compute
slowdown under overlap); and the comm nodes' (`comm_node_figures`: each all-to-all, the
K/V all-gather of context parallelism, `kv_gather`, by name, with its exposed time).

From one span (spans.py): `compute_us = end_us - start_us` (the action ran), `wait_us =
start_us - queued_us` (its lane had reached it but its inputs from the other lane were not
ready: the CUDA stream's `wait_event`, the CPU thread's wait for the comm thread). Spans of
version-1 files carry no `queued_us`: their waits are None (unknown), their compute times
stand. From a comm-lane span: `comm_us = end_us - start_us`, `exposed_us` = the part of it
when no compute-lane span of its rank's step ran (the timeline's exposure, per span). All
times are microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from epoverlap.profiling.intervals import measure, subtract, union
from epoverlap.profiling.spans import RankSpans, Span

PHASE_ORDER = {"forward": 0, "backward": 1, "wgrad": 2}


@dataclass(frozen=True)
class NodePhase:
    """One node of one layer in one phase (layer None: embed, loss)."""

    layer: Optional[int]
    node: str
    phase: str

    @classmethod
    def of(cls, span: Span) -> NodePhase:
        return cls(span.layer, span.node, span.phase)

    def sort_key(self) -> tuple:
        """Layer (layer-less nodes last), phase (forward, backward, wgrad), node."""
        return (_layer_order(self.layer), PHASE_ORDER.get(self.phase, 9), self.node)

    def label(self) -> str:
        return f"{'-' if self.layer is None else self.layer} {self.node} {self.phase}"


def _layer_order(layer: Optional[int]) -> tuple[bool, int]:
    return (layer is None, layer or 0)


@dataclass(frozen=True)
class NodeFigures:
    """One node kind in one run: spans per step, compute and wait time per step (the mean of
    the steps and ranks that ran it); wait None where a span had no queued mark."""

    kind: NodePhase
    spans: float
    compute_us: float
    wait_us: Optional[float]

    def as_dict(self) -> dict:
        return {"layer": self.kind.layer, "node": self.kind.node, "phase": self.kind.phase,
                "spans": self.spans, "compute_us": self.compute_us, "wait_us": self.wait_us}


def step_node_sums(spans: Iterable[Span]) -> dict[NodePhase, tuple[int, float, Optional[float]]]:
    """Per node kind of one rank's step: (spans, compute_us, wait_us) summed over microbatches."""
    sums: dict[NodePhase, tuple[int, float, Optional[float]]] = {}
    for span in spans:
        if span.lane != "compute":
            continue
        kind = NodePhase.of(span)
        count, compute, wait = sums.get(kind, (0, 0.0, 0.0))
        span_wait = span.wait_us
        sums[kind] = (count + 1, compute + span.duration_us,
                      None if wait is None or span_wait is None else wait + span_wait)
    return sums


def node_figures(ranks: Sequence[RankSpans], steps: Optional[Sequence[int]] = None
                 ) -> list[NodeFigures]:
    """Per node kind, sorted by layer, phase, node: the mean over the (rank, step) pairs that ran
    it of its per-step sums (`steps`: these step numbers only; default all)."""
    samples: dict[NodePhase, list[tuple[int, float, Optional[float]]]] = {}
    for rank_spans in ranks:
        for step in rank_spans.steps:
            if steps is not None and step.step not in steps:
                continue
            for kind, sums in step_node_sums(step.spans).items():
                samples.setdefault(kind, []).append(sums)
    figures = []
    for kind in sorted(samples, key=NodePhase.sort_key):
        rows = samples[kind]
        waits = [wait for _, _, wait in rows]
        figures.append(NodeFigures(
            kind, sum(count for count, _, _ in rows) / len(rows),
            sum(compute for _, compute, _ in rows) / len(rows),
            None if None in waits else sum(waits) / len(rows)))
    return figures


@dataclass(frozen=True)
class CommNodeFigures:
    """One comm node kind in one run: spans per step, their time and its exposed part per step
    (the mean of the steps and ranks that ran it)."""

    kind: NodePhase
    spans: float
    comm_us: float
    exposed_us: float

    def as_dict(self) -> dict:
        return {"layer": self.kind.layer, "node": self.kind.node, "phase": self.kind.phase,
                "spans": self.spans, "comm_us": self.comm_us, "exposed_us": self.exposed_us}


def comm_node_figures(ranks: Sequence[RankSpans], steps: Optional[Sequence[int]] = None
                      ) -> list[CommNodeFigures]:
    """Per comm node kind, sorted as `node_figures`: per step sums of its spans' time and
    exposed time, mean over the (rank, step) pairs that ran it."""
    samples: dict[NodePhase, list[tuple[int, float, float]]] = {}
    for rank_spans in ranks:
        for step in rank_spans.steps:
            if steps is not None and step.step not in steps:
                continue
            compute = union((s.start_us, s.end_us) for s in step.spans if s.lane == "compute")
            sums: dict[NodePhase, tuple[int, float, float]] = {}
            for span in step.spans:
                if span.lane != "comm":
                    continue
                count, total, exposed = sums.get(NodePhase.of(span), (0, 0, 0.0))
                alone = measure(subtract([(span.start_us, span.end_us)], compute))
                sums[NodePhase.of(span)] = (count + 1, total + span.duration_us, exposed + alone)
            for kind, row in sums.items():
                samples.setdefault(kind, []).append(row)
    return [CommNodeFigures(kind, *(sum(row[i] for row in samples[kind]) / len(samples[kind])
                                    for i in range(3)))
            for kind in sorted(samples, key=NodePhase.sort_key)]


@dataclass(frozen=True)
class Comparison:
    """One row of a two-run comparison: a node kind, a layer's total ("all") or the run's."""

    label: str
    base_compute_us: Optional[float]
    other_compute_us: Optional[float]
    base_wait_us: Optional[float]
    other_wait_us: Optional[float]

    @property
    def slowdown(self) -> Optional[float]:
        """other / base compute time (None when either run lacks the row, or base is 0)."""
        if not self.base_compute_us or self.other_compute_us is None:
            return None
        return self.other_compute_us / self.base_compute_us

    def as_dict(self) -> dict:
        return {"row": self.label, "base_compute_us": self.base_compute_us,
                "other_compute_us": self.other_compute_us, "slowdown": self.slowdown,
                "base_wait_us": self.base_wait_us, "other_wait_us": self.other_wait_us}


def compare_runs(base: Sequence[NodeFigures], other: Sequence[NodeFigures]) -> list[Comparison]:
    """Per node kind (in either run), then per layer ("L<i> all", "- all" for layer-less nodes:
    every compute node of the layer, so a run whose weight grads are deferred into W actions
    still compares with one that computes them inside the backward), then "all layers"."""
    by_kind = [{f.kind: f for f in base}, {f.kind: f for f in other}]
    kinds = sorted(set(by_kind[0]) | set(by_kind[1]), key=NodePhase.sort_key)
    rows = [_row(kind.label(), [[by_kind[i][kind]] if kind in by_kind[i] else [] for i in (0, 1)])
            for kind in kinds]
    for layer in sorted({kind.layer for kind in kinds}, key=_layer_order):
        members = [[f for f in run if f.kind.layer == layer] for run in (base, other)]
        rows.append(_row(f"{'-' if layer is None else f'L{layer}'} all", members))
    rows.append(_row("all layers", [list(base), list(other)]))
    return rows


def _row(label: str, runs: list[list[NodeFigures]]) -> Comparison:
    compute = [sum(f.compute_us for f in run) if run else None for run in runs]
    waits = [None if not run or any(f.wait_us is None for f in run)
             else sum(f.wait_us for f in run) for run in runs]
    return Comparison(label, compute[0], compute[1], waits[0], waits[1])
