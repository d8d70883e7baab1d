"""Where the simulator's durations come from: measured spans, a link model for the all-to-alls,
FLOP counts for compute. `epoverlap/simulator/engine.py` asks; this module answers.

Owns
  - `DurationTable`: per (rank, action) durations with fallbacks (same node, layer and phase on
    another microbatch or rank), built from span files (`compute_table`) or by cross-rank
    alignment of the comm spans (`aligned_comm`: a collective starts when its last rank
    arrives, so its own duration is its end minus that arrival; ranks' clocks are aligned on
    the collectives' ends, which all ranks see at the same moment);
  - `A2aShape` and `a2a_volume`: the bytes and calls of each all-to-all node, from the model
    shape (the dispatcher of epoverlap/model/moe.py: forward dispatch = split sizes + tokens +
    probs, backward dispatch = token and prob grads, combine = tokens, each way);
  - `LinkModel` (`LINKS`: nvlink, shm = NCCL_P2P_DISABLE=1, ib; `fit_link` for a measured
    run): latency per call + the bytes leaving the GPU over its per-GPU bandwidth, nodes of
    `gpus_per_node` GPUs keeping their intra-node share on NVLink, the most loaded rank
    (`imbalance` = max / mean tokens received) setting the collective's time;
  - `FlopModel`: per-node GEMM and attention FLOPs and memory bytes of one microbatch, turned
    into time at a given TFLOP/s and HBM bandwidth;
  - `NodeCosts`: the engine's `Costs` assembled from one source per kind of duration.
Times in microseconds, bandwidths in GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Sequence

from epoverlap.config.dispatch import group_reach
from epoverlap.profiling.spans import RankSpans
from epoverlap.schedule.plan import Action

ActionFn = Callable[[int, Action], float]


def zero(rank: int, action: Action) -> float:
    return 0.0


@dataclass
class NodeCosts:
    """The engine's Costs from one function per kind of duration."""

    compute: ActionFn
    comm: ActionFn
    host: ActionFn = zero
    sync: ActionFn = zero

    def compute_us(self, rank: int, action: Action) -> float:
        return self.compute(rank, action)

    def comm_us(self, rank: int, action: Action) -> float:
        return self.comm(rank, action)

    def host_us(self, rank: int, action: Action) -> float:
        return self.host(rank, action)

    def sync_us(self, rank: int, action: Action) -> float:
        return self.sync(rank, action)


# ---------------------------------------------------------------------------- measured spans
class MissingDuration(KeyError):
    """No measured duration for an action (nor for its node and phase anywhere)."""


class DurationTable:
    """Durations (us) per (rank, action), mean over samples; an action never measured takes the
    mean of the same phase, node and layer on other microbatches (same rank, then any rank),
    then of the same phase and node on any layer. Ranks beyond the measured ones wrap."""

    def __init__(self, samples: Iterable[tuple[int, Action, float]]):
        groups: dict[tuple, list[float]] = {}
        ranks = set()
        for rank, action, duration in samples:
            ranks.add(rank)
            for key in self._keys(rank, action):
                groups.setdefault(key, []).append(duration)
        self.means = {key: statistics.fmean(values) for key, values in groups.items()}
        self.num_ranks = max(ranks) + 1 if ranks else 0

    @staticmethod
    def _keys(rank: int, action: Action) -> list[tuple]:
        kind, node, layer = action.kind, action.node, action.layer
        return [(rank, str(action)), (rank, kind, node, layer), (kind, node, layer), (kind, node)]

    def __call__(self, rank: int, action: Action) -> float:
        for key in self._keys(rank % max(self.num_ranks, 1), action):
            if key in self.means:
                return self.means[key]
        raise MissingDuration(f"no measured duration for {action} (nor any {action.kind} "
                              f"{action.node})")


def _steps(rank_spans: RankSpans, steps: Optional[Sequence[int]]):
    return [s for s in rank_spans.steps if steps is None or s.step in steps]


def compute_table(ranks: list[RankSpans], steps: Optional[Sequence[int]] = None) -> DurationTable:
    """Compute-lane span durations, mean over the chosen steps (all by default)."""
    return DurationTable((r.rank, Action.parse(span.action), span.duration_us)
                         for r in ranks for step in _steps(r, steps)
                         for span in step.spans if span.lane == "compute")


@dataclass
class AlignedComm:
    """Per step: rank start offsets (rank 0's step start = 0) and each collective's own
    duration on each rank (its end minus the last rank's arrival)."""

    offsets: dict[int, list[float]]  # step -> per-rank offset of the step start (us)
    durations: DurationTable


def aligned_comm(ranks: list[RankSpans], steps: Optional[Sequence[int]] = None) -> AlignedComm:
    offsets, samples = {}, []
    for index, step in enumerate(_steps(ranks[0], steps)):
        per_rank = [{span.action: span for span in _steps(r, [step.step])[0].spans
                     if span.lane == "comm"} for r in ranks]
        common = sorted(set.intersection(*(set(p) for p in per_rank)))
        shift = [0.0] + [statistics.median(per_rank[0][a].end_us - p[a].end_us for a in common)
                         if common else 0.0 for p in per_rank[1:]]
        offsets[step.step] = [s - min(shift) for s in shift]
        for name in common:
            arrival = max(p[name].start_us + shift[r] for r, p in enumerate(per_rank))
            for r, p in enumerate(per_rank):
                own = max(p[name].end_us + shift[r] - arrival, 0.0)
                samples.append((ranks[r].rank, Action.parse(name), own))
    return AlignedComm(offsets, DurationTable(samples))


# ---------------------------------------------------------------------------- all-to-all volume
@dataclass(frozen=True)
class A2aShape:
    """What sets an all-to-all's bytes: tokens per microbatch per rank, top-k, hidden, experts,
    bytes per activation element, EP size, and whether a token goes to a rank once
    (--moe-dispatch-once-per-rank) or once per expert there."""

    tokens: int
    topk: int
    hidden: int
    num_experts: int
    dtype_bytes: int
    ep: int
    once_per_rank: bool = False
    hosts: int = 1  # hosts the EP group spans (ranks host-major, ep / hosts per host)
    by_host: bool = False  # --moe-dispatch-hierarchy node

    @classmethod
    def from_config(cls, cfg, ep: Optional[int] = None) -> "A2aShape":
        m, t = cfg.model, cfg.train
        return cls(tokens=tokens_per_rank(cfg), topk=cfg.moe.moe_router_topk,
                   hidden=m.hidden_size, num_experts=cfg.moe.num_experts or 0,
                   dtype_bytes=2 if t.bf16 else 4,
                   ep=ep or cfg.parallel.expert_model_parallel_size,
                   once_per_rank=cfg.moe.moe_dispatch_once_per_rank,
                   hosts=cfg.parallel.emulate_hosts,
                   by_host=cfg.moe.moe_dispatch_hierarchy == "node")

    @property
    def sends_once_per_rank(self) -> bool:
        return self.once_per_rank and self.ep > 1

    @property
    def sends_by_host(self) -> bool:
        return self.by_host and self.hosts > 1

    @property
    def rows(self) -> float:
        """Rows a rank sends per microbatch, routing balanced: one per (token, expert); once
        per rank, one per (token, rank holding one of its experts): a token's k experts drawn
        from E miss a given rank's L with probability C(E - L, k) / C(E, k); by host, stage 1's
        rows: one per (token, host holding one of its experts)."""
        if self.sends_by_host:
            return self.tokens * self.hosts * self._reach(self.hosts)
        if not self.sends_once_per_rank:
            return self.tokens * self.topk
        return self.tokens * self.ep * self._reach(self.ep)

    @property
    def forwarded_rows(self) -> float:
        """By host, stage 2: the rows a rank forwards to the other ranks of its host per
        microbatch. It receives `rows` (balanced: what it sends); each goes to every rank of
        the host holding one of the token's experts, a given rank with probability
        reach(ranks) / reach(hosts)."""
        per_host = self.ep // self.hosts
        return (self.rows * (per_host - 1) * self._reach(self.ep) / self._reach(self.hosts))

    def _reach(self, groups: int) -> float:
        """Chance that a token's k experts hit a given one of `groups` equal groups of them."""
        return group_reach(self.num_experts, self.topk, groups)

    @property
    def rows_between_hosts(self) -> float:
        """Rows a rank sends to other hosts per microbatch, routing balanced: once per expert,
        the topk x (G - 1) / G of its rows whose experts live elsewhere; once per rank, one per
        (token, rank of another host it reaches); by host, one per (token, other host it
        reaches)."""
        hosts = self.hosts
        if hosts <= 1:
            return 0.0
        if self.sends_by_host:
            return self.tokens * (hosts - 1) * self._reach(hosts)
        if self.sends_once_per_rank:
            return self.tokens * (self.ep - self.ep // hosts) * self._reach(self.ep)
        return self.tokens * self.topk * (hosts - 1) / hosts

    @property
    def bytes_between_hosts(self) -> float:
        """The dispatch's bytes a rank sends to other hosts per microbatch: rows and their
        fp32 probs (`probs_per_row`)."""
        return self.rows_between_hosts * (self.hidden * self.dtype_bytes
                                          + self.probs_per_row * PROBS_BYTES)

    @property
    def probs_per_row(self) -> int:
        """fp32 probs each row carries: its expert's, or once per rank its rank's L experts',
        by host (stage 1) its host's experts'."""
        if self.sends_by_host:
            return self.num_experts // self.hosts
        return self.num_experts // self.ep if self.sends_once_per_rank else 1

    @property
    def counts(self) -> int:
        """int64 counts each rank sends in the split-size exchange (per expert; + per rank; by
        host, to every rank: + per host and per rank)."""
        if self.sends_by_host:
            return self.ep * (self.num_experts + self.ep + self.hosts)
        return self.num_experts + (self.ep if self.sends_once_per_rank else 0)


def tokens_per_rank(cfg) -> int:
    """A microbatch's tokens on one rank: its sequences' S / CP (context parallelism)."""
    return cfg.train.micro_batch_size * cfg.model.seq_length \
        // cfg.parallel.context_parallel_size


PROBS_BYTES = 4  # router probs travel in fp32
COUNT_BYTES = 8  # per-expert counts, int64


def a2a_volume(shape: A2aShape, action: Action) -> tuple[float, int]:
    """(bytes one rank sends in the node, including the share it keeps; all-to-all calls)."""
    token_bytes = shape.rows * shape.hidden * shape.dtype_bytes
    probs_bytes = shape.rows * shape.probs_per_row * PROBS_BYTES
    if action.node == "dispatch" and action.kind == "F":
        return token_bytes + probs_bytes + shape.counts * COUNT_BYTES, 3
    if action.node == "dispatch":
        return token_bytes + probs_bytes, 2
    return token_bytes, 1


# ---------------------------------------------------------------------------- link model
@dataclass(frozen=True)
class LinkModel:
    """t = calls x latency + max(inter-node bytes / bandwidth, intra-node bytes / nvlink)."""

    kind: str
    bandwidth_gbs: float  # per GPU, per direction, bytes leaving it (GB/s)
    latency_us: float  # per all-to-all call
    gpus_per_node: int = 0  # 0: every peer over this link; n: peers in the node use nvlink_gbs
    nvlink_gbs: float = 0.0
    local_gbs: float = 1500.0  # the rows a rank keeps: a device copy (read + write at HBM speed)
    sync_us: float = 0.0  # forward dispatch: split sizes back on the host after this long

    def time_us(self, shape: A2aShape, action: Action, imbalance: float = 1.0) -> float:
        if shape.sends_by_host:
            return self._by_host_us(shape, action, imbalance)
        total, calls = a2a_volume(shape, action)
        ep = shape.ep
        heaviest = total * imbalance  # the most loaded rank sets the collective's time
        in_node = min(self.gpus_per_node, ep) if self.gpus_per_node else 1
        inter = heaviest * (ep - in_node) / ep if self.gpus_per_node else heaviest * (ep - 1) / ep
        intra = heaviest * (in_node - 1) / ep if self.gpus_per_node else 0.0
        local = heaviest / ep
        wire = max(inter / (self.bandwidth_gbs * 1e3),
                   intra / (self.nvlink_gbs * 1e3) if intra else 0.0,
                   local / (self.local_gbs * 1e3))
        return calls * self.latency_us + wire

    def _by_host_us(self, shape: A2aShape, action: Action, imbalance: float) -> float:
        """The hierarchical dispatch: stage 1 between hosts (its rows' share for other hosts
        over this link, its own host's a local copy), then stage 2 inside the host over NVLink
        (the forwarded rows, with their ranks' probs); one after the other in the node."""
        total, calls = a2a_volume(shape, action)
        heaviest = total * imbalance
        hosts = shape.hosts
        between = max(heaviest * (hosts - 1) / hosts / (self.bandwidth_gbs * 1e3),
                      heaviest / hosts / (self.local_gbs * 1e3))
        probs = shape.num_experts // shape.ep * PROBS_BYTES if action.node == "dispatch" else 0
        row = shape.hidden * shape.dtype_bytes + probs
        inside_gbs = self.nvlink_gbs or self.bandwidth_gbs
        inside = shape.forwarded_rows * row * imbalance / (inside_gbs * 1e3)
        return 2 * calls * self.latency_us + between + inside

    def local_copy_us(self, shape: A2aShape, action: Action) -> float:
        """The compute-only baseline's stand-in: every byte copied locally, no wire."""
        total, calls = a2a_volume(shape, action)
        return total / (self.local_gbs * 1e3)


# Per-GPU figures. nvlink: fitted to the overlap benchmark's measured all-to-all times (the fit
# is recorded in benchmarks/). shm (NCCL_P2P_DISABLE=1) and ib (a 400 Gb/s NIC per GPU at about
# 80% of line rate, 8 GPUs per node over NVLink): assumptions, not fits.
LINKS = {
    "nvlink": LinkModel("nvlink", bandwidth_gbs=245.0, latency_us=25.0, sync_us=60.0),
    "shm": LinkModel("shm", bandwidth_gbs=20.0, latency_us=40.0, sync_us=80.0),
    "ib": LinkModel("ib", bandwidth_gbs=40.0, latency_us=30.0, gpus_per_node=8,
                    nvlink_gbs=245.0, sync_us=80.0),
}


def fit_link(points: Sequence[tuple[float, int, float]], kind: str = "fitted") -> LinkModel:
    """Least squares of t = calls x latency + bytes / bandwidth over (bytes, calls, t_us)
    points (latency and 1/bandwidth kept >= 0)."""
    def solve(use_latency: bool, use_bw: bool) -> tuple[float, float, float]:
        cols = [(c if use_latency else 0.0, b if use_bw else 0.0) for b, c, _ in points]
        saa = sum(a * a for a, _ in cols); sbb = sum(b * b for _, b in cols)
        sab = sum(a * b for a, b in cols)
        sat = sum(a * t for (a, _), (_, _, t) in zip(cols, points))
        sbt = sum(b * t for (_, b), (_, _, t) in zip(cols, points))
        det = saa * sbb - sab * sab
        if use_latency and use_bw and det > 0:
            lat, inv = (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det
        else:
            lat = sat / saa if use_latency and saa else 0.0
            inv = sbt / sbb if use_bw and sbb else 0.0
        err = sum((lat * a + inv * b - t) ** 2 for (a, b), (_, _, t) in zip(cols, points))
        return lat, inv, err
    candidates = [solve(True, True), solve(True, False), solve(False, True)]
    lat, inv, _ = min((c for c in candidates if c[0] >= 0 and c[1] >= 0), key=lambda c: c[2])
    bandwidth = 1.0 / (inv * 1e3) if inv > 0 else math.inf
    return LinkModel(kind, bandwidth_gbs=bandwidth, latency_us=lat, local_gbs=math.inf,
                     sync_us=lat)  # the split-size exchange: one call


# ---------------------------------------------------------------------------- FLOP model
@dataclass(frozen=True)
class NodeWork:
    gemm_flops: float = 0.0
    attn_flops: float = 0.0  # attention scores and values (flash attention)
    mem_bytes: float = 0.0

    def __add__(self, other: "NodeWork") -> "NodeWork":
        return NodeWork(self.gemm_flops + other.gemm_flops, self.attn_flops + other.attn_flops,
                        self.mem_bytes + other.mem_bytes)

    def times(self, factor: float) -> "NodeWork":
        return NodeWork(self.gemm_flops * factor, self.attn_flops * factor,
                        self.mem_bytes * factor)


@dataclass(frozen=True)
class FlopModel:
    """Per-node work of one microbatch on one rank, from the model config.

    Forward GEMMs 2 x tokens x weights; backward = activation grads (same FLOPs) + weight grads
    (same FLOPs; a W action when delayed); attention 2 x T x S x heads x head_dim forward
    (causal; under CP a rank's T = S / CP queries over the sequence, balanced), 2x that
    backward; memory-bound passes (norms, rotary, permute, chunk sort,
    SwiGLU, unpermute, residual adds) as bytes read + written. `load` scales the expert work
    of the most loaded rank."""

    cfg: object
    ep: int
    delay_wgrad: bool = False

    def _dims(self):
        m, moe, t = self.cfg.model, self.cfg.moe, self.cfg.train
        tokens = tokens_per_rank(self.cfg)
        return m, moe, tokens, (2 if t.bf16 else 4)

    def forward(self, node: str, layer: Optional[int]) -> NodeWork:
        m, moe, tokens, b = self._dims()
        h = m.hidden_size
        if node == "embed":
            return NodeWork(mem_bytes=2 * tokens * h * b)
        if node == "loss":
            vocab = m.padded_vocab_size  # the logit GEMM's rows
            return NodeWork(gemm_flops=2 * tokens * h * vocab,
                            mem_bytes=tokens * vocab * 4 * 2 + 2 * tokens * h * b)
        if node == "attn":
            return self._attn(m, moe, tokens, b)
        if node == "mlp":
            return self._mlp(m, moe, tokens, b)
        if node == "combine":  # unpermute (probs already applied) + residual add, comm lane
            return NodeWork(mem_bytes=(self._sent_rows() * h + 4 * tokens * h) * b)
        return NodeWork()

    def _sent_rows(self) -> float:
        """Rows of the permuted tokens a rank sends (and gets back), routing balanced."""
        return A2aShape.from_config(self.cfg, self.ep).rows

    def _attn(self, m, moe, tokens, b) -> NodeWork:
        h, d = m.hidden_size, m.head_dim
        weights = h * (m.num_attention_heads + 2 * m.kv_heads) * d + m.num_attention_heads * d * h
        weights += h * (moe.num_experts or 0) + 3 * h * (moe.moe_shared_expert_intermediate_size
                                                          or 0)
        attn = 2 * tokens * m.seq_length * m.num_attention_heads * d
        mem = (12 * tokens * h + 2 * self._sent_rows() * h) * b  # norms, rotary, residual,
        # permute
        if m.qk_layernorm:  # the query and key heads copied to rows, then normed: 2 passes
            mem += 4 * tokens * (m.num_attention_heads + m.kv_heads) * d * b
        return NodeWork(gemm_flops=2 * tokens * weights, attn_flops=attn, mem_bytes=mem)

    def _mlp(self, m, moe, tokens, b) -> NodeWork:
        h = m.hidden_size
        ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size
        rows = tokens * moe.moe_router_topk  # the experts' rows per rank when balanced
        # chunk sort + unsort (or, once per rank, the copy to the experts and the sum back:
        # the received rows read and written once more each way), SwiGLU
        mem = (2 * (self._sent_rows() + rows) * h + 3 * rows * ffn) * b
        return NodeWork(gemm_flops=6 * rows * h * ffn, mem_bytes=mem)

    def work(self, action: Action) -> NodeWork:
        fwd = self.forward(action.node, action.layer)
        if action.kind == "F":
            return fwd
        wgrad = NodeWork(gemm_flops=fwd.gemm_flops)
        if action.kind == "W":
            return wgrad
        dgrad = NodeWork(fwd.gemm_flops, 2 * fwd.attn_flops, 2 * fwd.mem_bytes)
        return dgrad if self._delayed(action) else dgrad + wgrad

    def _delayed(self, action: Action) -> bool:
        return self.delay_wgrad and action.node in ("attn", "mlp")


@dataclass(frozen=True)
class Throughput:
    """Sustained rates that turn NodeWork into time: GEMM and attention TFLOP/s, HBM GB/s."""

    gemm_tflops: float
    attn_tflops: float
    hbm_gbs: float

    def time_us(self, work: NodeWork) -> float:
        return (work.gemm_flops / (self.gemm_tflops * 1e6) + work.attn_flops
                / (self.attn_tflops * 1e6) + work.mem_bytes / (self.hbm_gbs * 1e3))

    def scaled(self, factor: float) -> "Throughput":
        return replace(self, gemm_tflops=self.gemm_tflops * factor,
                       attn_tflops=self.attn_tflops * factor, hbm_gbs=self.hbm_gbs * factor)


# ---------------------------------------------------------------------------- host launch cost
def host_gaps(ranks: list[RankSpans], plan: Sequence[Action], kinds: dict,
              sync_us: float = 0.0, slack_us: float = 20.0) -> DurationTable:
    """Eager host cost per action, read from a stream-lanes recording's gaps.

    An action whose span starts more than `slack_us` after its own dependencies (its lane
    free, its microbatch's previous F/B action done) started when the host issued it. For two
    such actions next to each other in the plan, the host spent the time between their starts
    on the first one (after the split-size read, for the forward dispatch: the host waited for
    the exchange, `sync_us` from when the last rank had counted its rows, engine.py)."""
    from epoverlap.schedule.plan import action_lane
    aligned = aligned_comm(ranks)
    counted_by = _counting_actions(plan)
    samples = []
    for rank_spans in ranks:
        for step in rank_spans.steps:
            by_name = {span.action: span for span in step.spans}
            issued = _issue_times(plan, kinds, by_name, slack_us, action_lane)
            shift = aligned.offsets[step.step][rank_spans.rank]
            for this, following in zip(plan, plan[1:]):
                if str(this) not in issued or str(following) not in issued:
                    continue
                begin = issued[str(this)]
                if (this.kind, this.node) == ("F", "dispatch") and this in counted_by:
                    begin = max(begin, _last_end(ranks, step.step, str(counted_by[this]),
                                                 aligned) - shift + sync_us)
                cost = issued[str(following)] - begin
                if cost >= 0:
                    samples.append((rank_spans.rank, this, cost))
    return DurationTable(samples)


def _counting_actions(plan: Sequence[Action]) -> dict[Action, Action]:
    """Each action -> the F/B action before it in its microbatch's chain (plan order)."""
    last: dict[int, Action] = {}
    before = {}
    for action in plan:
        if action.kind == "W":
            continue
        if action.microbatch in last:
            before[action] = last[action.microbatch]
        last[action.microbatch] = action
    return before


def _issue_times(plan, kinds, by_name, slack_us, action_lane) -> dict[str, float]:
    """Start times of the actions that started late for their own dependencies."""
    lane_end: dict[str, float] = {}
    event: dict[int, float] = {}
    issued = {}
    for action in plan:
        span = by_name.get(str(action))
        if span is None:
            continue
        lane = action_lane(action, kinds)
        chain = action.kind != "W"
        ready = max(lane_end.get(lane, 0.0), event.get(action.microbatch, 0.0) if chain else 0.0)
        if span.start_us > ready + slack_us:
            issued[str(action)] = span.start_us
        lane_end[lane] = span.end_us
        if chain:
            event[action.microbatch] = span.end_us
    return issued


def _last_end(ranks, step: int, name: str, aligned: AlignedComm) -> float:
    """When the action had ended on every rank, on the common clock."""
    ends = []
    for rank_spans in ranks:
        for s in rank_spans.steps:
            if s.step == step:
                span = next(x for x in s.spans if x.action == name)
                ends.append(span.end_us + aligned.offsets[step][rank_spans.rank])
    return max(ends)


# ---------------------------------------------------------------------------- recorded plan
def recorded_mode(ranks: list[RankSpans]) -> str:
    """seq, ovl or wgrad: from a recording's order (W actions; F1 issued before B0 ends)."""
    spans = sorted(ranks[0].steps[0].spans, key=lambda s: s.start_us)
    names = [s.action for s in spans]
    if any(name.startswith("W") for name in names):
        return "wgrad"
    if "F1.embed" not in names:
        return "seq"
    last_b0 = max(i for i, n in enumerate(names) if n.startswith("B0."))
    return "ovl" if names.index("F1.embed") < last_b0 else "seq"


def recorded_plan(ranks: list[RankSpans], like_layout) -> tuple[list[Action], list]:
    """The plan a recording ran and its layout: layers and microbatches counted from its
    spans, each layer's node kinds taken from the layer of `like_layout` with the same nodes."""
    from epoverlap.schedule.pipeline import build_plan
    actions = [Action.parse(s.action) for s in ranks[0].steps[0].spans]
    layers = sorted({a.layer for a in actions if a.layer is not None})
    kinds_by_names = {frozenset(k.name for k in layer): layer for layer in like_layout}
    layout = []
    for layer in layers:
        names = frozenset(a.node for a in actions if a.layer == layer)
        if names not in kinds_by_names:
            raise ValueError(f"recorded layer {layer} has nodes {sorted(names)}, unlike any "
                             "layer of the simulated model")
        layout.append(kinds_by_names[names])
    mode = recorded_mode(ranks)
    microbatches = max(a.microbatch for a in actions) + 1
    name = "sequential" if mode == "seq" else "combined_1f1b"
    return build_plan(name, layout, microbatches, mode == "wgrad"), layout


def cpu_gaps(ranks: list[RankSpans], plan: Sequence[Action], kinds: dict,
             inline: bool) -> DurationTable:
    """A CPU recording's host time outside spans, per action: how long after the host was free
    (its previous action done and, for a compute F/B action on thread lanes, the last comm
    action of its microbatch done) the action's span began. `inline`: a sequential run, where
    the host also runs the comm actions."""
    from epoverlap.schedule.plan import action_lane
    samples = []
    for rank_spans in ranks:
        for step in rank_spans.steps:
            by_name = {span.action: span for span in step.spans}
            host, pending = 0.0, {}
            for action in plan:
                span = by_name.get(str(action))
                if span is None:
                    continue
                if action_lane(action, kinds) == "comm" and not inline:
                    pending[action.microbatch] = span.end_us
                    continue
                wait = pending.pop(action.microbatch, 0.0) if action.kind != "W" else 0.0
                samples.append((rank_spans.rank, action, max(span.start_us - max(host, wait),
                                                             0.0)))
                host = span.end_us
    return DurationTable(samples)
