"""One simulation's inputs, and its runs: `Scenario`, built from the options of
`epoverlap-simulate` (an `argparse.Namespace`: its parser is `parse_args` in
epoverlap/cli/simulate.py; the tests and benchmark scripts build one the same way).

Owns
  - the model shape: the training flags after `--` parsed into a RunConfig (`model_config`)
    and the real model's layout, built on the meta device (`model_layout`);
  - the duration sources (numbers from epoverlap/simulator/costs.py):
      compute  a recorded run's compute spans (`span_compute`: --spans DIR or --trace FILE,
               the timeline tool's timeline_trace.json), or FLOP counts at a throughput
               (`flop_compute`; `base_throughput`, or `calibrated_throughput`, the rates scaled
               so a simulated time matches a given one: --calibrate MODE:MS@EP);
      comm     a link model (`link_model`: nvlink, shm or ib, each figure overridable), one
               fitted to the run's comm spans (`fitted_link`), or those spans themselves
               (--link measured), all-to-all volumes from the shape, `load_factor` for an
               uneven routing (--imbalance); or each node's time measured by a microbenchmark
               of the dispatch's own calls (`comm_table`: --comm-from FILE, read by
               epoverlap/simulator/comm_table.py), which also gives the split-size sync;
               the recording then supplies compute only (no rank offsets, no replay);
      K/V      under context parallelism, each layer's exchange from the link and the shape
               (epoverlap/simulator/context_costs.py): the all-gather's `kv_gather` node
               (comm lane; a recording's own with --link measured), the ring inside `attn`
               (added to its FLOP time; a recording's attn spans hold it); the model built
               with the CP group (`model_layout`), a rank's tokens S / CP;
      host     eager launch cost per node from a launch-bound GPU run (`host_costs`), or a CPU
               recording's own host time outside spans (`recorded_cpu_host`);
  - `build_scenario`, which assembles them (and describes each source, `Scenario.sources`);
  - `run_mode` / `run_all`: the scenario replayed (epoverlap/simulator/engine.py) as each of
    MODES: seq (the sequential plan on serial lanes), ovl (the overlap plan), wgrad (the
    overlap plan with delayed weight grads, where W durations exist), comp (the overlap plan
    with every all-to-all a local copy: the compute-only baseline); ovl and wgrad with the
    lanes slowing each other by `Scenario.beside` (--comm-beside-compute,
    --compute-beside-comm: epoverlap/simulator/contention.py).
Bad input raises `SimInputError`, whose message the command prints as one line.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from epoverlap.config import parse_config, resolve_config, validate_config
from epoverlap.config.dispatch import DispatchMode
from epoverlap.errors import ConfigError
from epoverlap.model.nodes import COMM
from epoverlap.profiling.chrome_trace import read_chrome_trace
from epoverlap.profiling.spans import RankSpans, read_span_directory
from epoverlap.schedule.grad_reduce import GRAD_REDUCE
from epoverlap.schedule.pipeline import build_plan
from epoverlap.schedule.plan import Action, node_kinds
from epoverlap.simulator import context_costs as cc
from epoverlap.simulator import costs as sc
from epoverlap.simulator.comm_table import CommTable, CommTableError, read_comm_table
from epoverlap.simulator.contention import simulate_contended
from epoverlap.simulator.engine import INLINE, SERIAL, STREAM, THREAD, SimResult, simulate

MODES = ("seq", "ovl", "wgrad", "comp")
# Sustained rates assumed when none are given (--gemm-tflops, --attn-tflops, --hbm-gbs); with
# --calibrate only their ratio matters: all three are scaled by one factor to a measured time.
DEFAULT_THROUGHPUT = sc.Throughput(gemm_tflops=600.0, attn_tflops=400.0, hbm_gbs=3000.0)


class SimInputError(ValueError):
    """Bad input; the message is the one line printed before exit status 2."""


@dataclass
class Scenario:
    """Everything one simulation needs: shape, plan size, lanes and the duration sources."""

    cfg: object
    layout: list
    ep: int
    shape: sc.A2aShape
    overlap_lanes: str
    compute: "ComputeSource"
    comm: sc.ActionFn
    comm_local: sc.ActionFn
    wire: sc.ActionFn  # the all-to-alls alone: T_comm
    host: sc.ActionFn = sc.zero
    sync: sc.ActionFn = sc.zero
    recorded: Optional[list[RankSpans]] = None
    starts: Optional[list[float]] = None
    has_wgrad: bool = True
    comm_measured: bool = False
    # (all-to-all beside compute, compute beside an all-to-all): slowdowns of the overlapped
    # modes (epoverlap/simulator/contention.py)
    beside: tuple[float, float] = (1.0, 1.0)
    sources: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- model shape
def model_config(args: argparse.Namespace, ep: Optional[int]):
    """The RunConfig of the simulated model: the training flags after `--`. A link of nodes
    (`gpus_per_node`) the EP group spans several of makes them the job's hosts, as
    --emulate-hosts does, so the dispatch resolves as it would there (the hierarchical one by
    default; `-- --moe-dispatch-hierarchy flat` for one all-to-all over the group)."""
    flags = list(args.train_flags)
    if ep is not None:
        flags += ["--expert-model-parallel-size", str(ep)]
        per_node = _gpus_per_node(args)
        if per_node and ep > per_node and ep % per_node == 0 and "--emulate-hosts" not in flags:
            flags += ["--emulate-hosts", str(ep // per_node)]
    flags += ["--overlap-moe-expert-parallel-comm"]
    cfg = parse_config(flags)
    ep = cfg.parallel.expert_model_parallel_size
    if ep is None or ep < 2:
        raise SimInputError(f"--ep {ep}: the simulator needs an EP group of 2 or more ranks "
                            "(--ep or --expert-model-parallel-size)")
    world = math.lcm(ep, cfg.parallel.context_parallel_size)  # the EP and CP groups' ranks
    try:  # the simulated job's GPUs run bf16 only where its flags say so
        cfg = resolve_config(cfg, world, cuda_available=bool(cfg.train.bf16))
        validate_config(cfg, world, bool(cfg.train.bf16))
    except ConfigError as error:
        raise SimInputError(str(error)) from None
    return cfg


def model_layout(cfg, ep: int) -> list:
    """The layout of the real model, built on the meta device (no memory, no values)."""
    import torch

    from epoverlap.model.transformer import MoEModel
    from epoverlap.parallel.comm import ExpertComm, HostComms
    from epoverlap.kernels import make_moe_ops
    hosts = cfg.parallel.emulate_hosts  # the hierarchical dispatch's stages (no groups here)
    by_host = HostComms(ExpertComm(None, hosts), ExpertComm(None, ep // hosts), 0) \
        if cfg.moe.moe_dispatch_hierarchy == "node" else None
    cp = cfg.parallel.context_parallel_size
    model = MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                     ExpertComm(None, ep, by_host=by_host), 0, make_moe_ops("torch"),
                     dtype=torch.bfloat16, device=torch.device("meta"),
                     cp_comm=_CpGroupShape(cp) if cp > 1 else None)
    return model.layout(cfg.overlap.moe_a2a_waves)


class _CpGroupShape:
    """The CP group as the model's layout reads it (`model.context`): its size, and a comm
    lane's communicator for the all-gather; no process group."""

    def __init__(self, size: int):
        self.size, self.rank, self.group = size, 0, None
        self.lane = self


# ---------------------------------------------------------------------------- duration sources
def read_recorded(args: argparse.Namespace) -> Optional[list[RankSpans]]:
    """The recorded run's spans (--spans DIR or --trace FILE), restricted to --steps."""
    if not args.spans and not args.trace:
        return None
    ranks = read_plan_spans(args.spans or args.trace, trace=not args.spans)
    if args.steps:
        first, last = _step_range(args.steps)
        for rank in ranks:
            rank.steps = [s for s in rank.steps if first <= s.step <= last]
        if not ranks[0].steps:
            raise SimInputError(f"--steps {args.steps}: no recorded step in that range")
    return ranks


def read_plan_spans(path: str, trace: bool) -> list[RankSpans]:
    """A recording's spans (a span directory, or a Chrome trace), the plan's actions only: the
    gradient buckets' reduces (--overlap-grad-reduce) are not simulated."""
    ranks = read_chrome_trace(path) if trace else read_span_directory(path)
    for rank in ranks:
        rank.steps = [replace(step, spans=[s for s in step.spans if s.node != GRAD_REDUCE])
                      for step in rank.steps]
    return ranks


def _step_range(text: str) -> tuple[int, int]:
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        raise SimInputError(f"--steps {text}: expected START:END, e.g. 2:4") from None
    return first, last


def _gpus_per_node(args: argparse.Namespace) -> int:
    """The GPUs of one node of the chosen link (0: every peer over the link)."""
    if args.gpus_per_node is not None:
        return args.gpus_per_node
    link = sc.LINKS.get(args.link)
    return link.gpus_per_node if link is not None else 0


def comm_table(args: argparse.Namespace, cfg, shape: sc.A2aShape, layout: list
               ) -> Optional[CommTable]:
    """--comm-from FILE: the measured node times of the run's case and dispatch (None
    without it). Refused where the benchmark timed another dispatch (it times the dropless
    ones) or the comm lane runs other nodes (all-to-alls in waves, pipeline transfers)."""
    path = getattr(args, "comm_from", None)
    if path is None:
        return None
    mode = DispatchMode.of(cfg.moe).name
    if mode != "dropless":
        raise SimInputError(f"--comm-from {path} times the dropless dispatch; this run's is "
                            f"{mode}")
    others = sorted({kind.name for layer in layout for kind in layer
                     if kind.lane == COMM and kind.name not in ("dispatch", "combine")})
    if others:
        raise SimInputError(f"--comm-from {path} times the dispatch and combine nodes; this "
                            f"model's comm lane also runs {', '.join(others)}")
    try:
        return read_comm_table(path, shape)
    except CommTableError as error:
        raise SimInputError(str(error)) from None


def chosen_link(args: argparse.Namespace, recorded) -> str:
    """--link, or where not given: the recording's own all-to-all times (measured) for a
    recorded run with comm spans and no --comm-from, else the NVLink model."""
    if args.link is not None:
        return args.link
    has_comm = recorded and any(span.lane == COMM for rank in recorded for step in rank.steps
                                for span in step.spans)
    return "measured" if has_comm and not getattr(args, "comm_from", None) else "nvlink"


def link_model(args: argparse.Namespace, recorded, shape: sc.A2aShape,
               table: Optional[CommTable] = None) -> sc.LinkModel:
    """The link of --link and its overrides; with a comm table, its split-size sync is the
    measured exchange's (unless --sync-us)."""
    if table is not None and args.sync_us is None:
        return replace(link_model(args, recorded, shape), sync_us=table.exchange_us)
    if args.link in ("fit", "measured"):
        if recorded is None:
            raise SimInputError(f"--link {args.link} needs a recorded run (--spans or --trace)")
        link = fitted_link(recorded, shape)
    else:
        link = sc.LINKS[args.link]
    overrides = {"bandwidth_gbs": args.link_bandwidth_gbs, "latency_us": args.link_latency_us,
                 "gpus_per_node": args.gpus_per_node, "sync_us": args.sync_us}
    return replace(link, **{k: v for k, v in overrides.items() if v is not None})


def fitted_link(recorded: list[RankSpans], shape: sc.A2aShape) -> sc.LinkModel:
    """Latency and bandwidth fitted to each all-to-all node's own time in the recording
    (median per phase and node, over microbatches, layers, ranks and steps)."""
    table = sc.aligned_comm(recorded).durations
    points = []
    for kind in ("F", "B"):
        for node in ("dispatch", "combine"):
            key = (kind, node)
            if key in table.means:
                action = Action(kind, 0, node, 0)
                remote = sc.a2a_volume(shape, action)[0] * (shape.ep - 1) / shape.ep
                points.append((remote, sc.a2a_volume(shape, action)[1], table.means[key]))
    if not points:
        raise SimInputError("the recorded run has no all-to-all spans to fit a link model to")
    return sc.fit_link(points)


def load_factor(imbalance: float, ep: int):
    """The expert work of each rank relative to a balanced one: the most loaded rank of a
    (layer, microbatch) gets `imbalance`, the others share the rest; the hot rank rotates."""
    def factor(rank: int, action: Action) -> float:
        if imbalance == 1.0 or action.node != "mlp":
            return 1.0
        hot = ((action.layer or 0) + action.microbatch) % ep
        return imbalance if rank == hot else (ep - imbalance) / (ep - 1)
    return factor


class ComputeSource:
    """Compute durations for a plan with or without delayed weight grads: a B action of a
    plan without W actions also does the work a recorded W action did."""

    def __init__(self, table, load, wgrad_recorded: bool = False):
        self.table, self.load = table, load  # table(rank, action, delay_wgrad) -> us
        self.wgrad_recorded = wgrad_recorded

    def for_plan(self, delay_wgrad: bool) -> sc.ActionFn:
        def duration(rank: int, action: Action) -> float:
            value = self.table(rank, action, delay_wgrad)
            return value * self.load(rank, action)
        return duration


def span_compute(recorded: list[RankSpans], load) -> ComputeSource:
    table = sc.compute_table(recorded)
    has_w = any(key[0] == "W" for key in table.means if len(key) == 2)

    def duration(rank: int, action: Action, delay_wgrad: bool) -> float:
        value = table(rank, action)
        if action.kind == "B" and has_w and not delay_wgrad:
            w = Action("W", action.microbatch, action.node, action.layer)
            try:
                value += table(rank, w)
            except sc.MissingDuration:
                pass  # a node with no weight grads to defer
        return value
    return ComputeSource(duration, load, wgrad_recorded=has_w)


def flop_compute(cfg, ep: int, throughput: sc.Throughput, load,
                 ring: sc.ActionFn = sc.zero) -> ComputeSource:
    """`ring`: the CP ring's transfers inside an `attn` action (context_costs.ring_us)."""
    models = {flag: sc.FlopModel(cfg, ep, delay_wgrad=flag) for flag in (False, True)}

    def duration(rank: int, action: Action, delay_wgrad: bool) -> float:
        return throughput.time_us(models[delay_wgrad].work(action)) + ring(rank, action)
    return ComputeSource(duration, load, wgrad_recorded=True)


@functools.lru_cache(maxsize=8)
def _host_tables(path: str, like_layout: tuple, sync_us: float) -> tuple[dict, dict]:
    """(host gaps, compute span means) of a GPU recording, per (phase, node) and finer."""
    ranks = read_plan_spans(path, trace=not Path(path).is_dir())
    if ranks[0].clock == "host":
        raise SimInputError(f"--host-from {path}: a CPU recording (clock host) has no separate "
                            "host; give a GPU run's spans")
    if ranks[0].local_copy_hold_us:
        raise SimInputError(f"--host-from {path}: a held local-copy recording "
                            f"(--local-copy-hold-us {ranks[0].local_copy_hold_us:g}): its host "
                            "ran ahead, its gaps do not show the launches; give an unheld "
                            "launch-bound run's spans")
    plan, layout = sc.recorded_plan(ranks, list(like_layout))
    return (sc.host_gaps(ranks, plan, node_kinds(layout), sync_us).means,
            sc.compute_table(ranks).means)


def host_costs(path: Optional[str], graphed: Sequence[str], like_layout: list,
               sync_us: float, scale: float = 1.0) -> sc.ActionFn:
    """Eager host launch cost per (phase, node), read from the gaps of a launch-bound GPU run
    (sc.host_gaps); a compute node the gaps do not show costs its mean span there (its
    launches were what it waited for), a comm node the mean of the comm nodes they show.
    Graphed nodes cost nothing (a graph replay)."""
    if path is None:
        return sc.zero
    gaps, spans = _host_tables(path, tuple(like_layout), sync_us)
    comm_nodes = [v for k, v in gaps.items() if len(k) == 2 and k[1] in ("dispatch", "combine")]
    comm_default = statistics.fmean(comm_nodes) if comm_nodes else 0.0

    def host(rank: int, action: Action) -> float:
        key = (action.kind, action.node)
        if action.node in graphed:
            return 0.0
        if key in gaps:
            return gaps[key] * scale
        default = comm_default if action.node in ("dispatch", "combine") else 0.0
        return spans.get(key, default) * scale
    return host


def recorded_cpu_host(recorded: Optional[list[RankSpans]], layout: list) -> sc.ActionFn:
    """A CPU recording's own host time outside spans (sc.cpu_gaps), 0 where it has none."""
    if not recorded:
        return sc.zero
    plan, rec_layout = sc.recorded_plan(recorded, layout)
    table = sc.cpu_gaps(recorded, plan, node_kinds(rec_layout),
                        inline=sc.recorded_mode(recorded) == "seq")

    def host(rank: int, action: Action) -> float:
        try:
            return table(rank, action)
        except sc.MissingDuration:
            return 0.0
    return host


# ---------------------------------------------------------------------------- scenario
def build_scenario(args: argparse.Namespace,
                   throughput: Optional[sc.Throughput] = None) -> Scenario:
    recorded = read_recorded(args)
    given = args.link
    args = argparse.Namespace(**{**vars(args), "link": chosen_link(args, recorded)})
    ep = args.ep or (recorded[0].world_size if recorded else None)
    cfg = model_config(args, ep)
    ep = cfg.parallel.expert_model_parallel_size
    if not 1.0 <= args.imbalance <= ep:
        raise SimInputError(f"--imbalance {args.imbalance}: allowed 1 (balanced) .. {ep} (EP)")
    shape = sc.A2aShape.from_config(cfg, ep)
    layout = model_layout(cfg, ep)
    table = comm_table(args, cfg, shape, layout)
    link = link_model(args, recorded, shape, table)
    load = load_factor(args.imbalance, ep)
    if recorded is None and throughput is None:
        throughput = calibrated_throughput(args) if args.calibrate else base_throughput(args)
    kv = cc.KvShape.from_config(cfg)
    compute = span_compute(recorded, load) if recorded else \
        flop_compute(cfg, ep, throughput, load, lambda r, a: cc.ring_us(link, kv, a))
    comm, local, wire, sources = comm_sources(args, recorded, shape, link, cfg, throughput,
                                              table)
    if kv.cp > 1:
        measured = args.link == "measured"
        comm, wire = (_with_kv_gather(fn, kv, link, measured) for fn in (comm, wire))
        local = _with_kv_gather(local, kv, link, as_copy=True)
        sources.append(describe_kv(kv, link, measured, recorded is not None))
    if given is None:  # say which link the default chose
        why = "for a recording with all-to-all spans" if args.link == "measured" else \
            "without a recording's all-to-all spans"
        sources = [f"{sources[0]} (--link {args.link}: the default {why})", *sources[1:]]
    lanes = args.lanes if args.lanes != "auto" else (
        THREAD if recorded and recorded[0].clock == "host" else STREAM)
    gpu = lanes != THREAD
    host = host_costs(args.host_from, args.graphed_nodes, layout, link.sync_us,
                      args.host_scale) if gpu else \
        recorded_cpu_host(recorded, layout)
    simulated_run = None if table else recorded  # with a comm table: compute only
    scenario = Scenario(cfg, layout, ep, shape, lanes, compute, comm, local, wire, host=host,
                        sync=_dispatch_sync(link.sync_us if gpu else 0.0),
                        recorded=simulated_run, starts=_mean_offsets(simulated_run, ep),
                        has_wgrad=compute.wgrad_recorded, comm_measured=args.link == "measured",
                        beside=(getattr(args, "comm_beside_compute", 1.0),
                                getattr(args, "compute_beside_comm", 1.0)))
    scenario.sources = _describe(args, recorded, throughput, lanes) + sources
    if scenario.beside != (1.0, 1.0):
        scenario.sources.append(f"lanes beside each other (ovl, wgrad): all-to-alls x "
                                f"{scenario.beside[0]:g}, compute x {scenario.beside[1]:g}")
    return scenario


def _with_kv_gather(fn: sc.ActionFn, kv: cc.KvShape, link: sc.LinkModel,
                    measured: bool = False, as_copy: bool = False) -> sc.ActionFn:
    """`fn`, but a `kv_gather` action's time from the link (context_costs), or as a local
    copy (`as_copy`: the compute-only baseline); a recording's measured times kept."""
    if measured and not as_copy:
        return fn

    def duration(rank: int, action: Action) -> float:
        if not cc.is_gather(action):
            return fn(rank, action)
        return cc.gather_local_us(link, kv) if as_copy else \
            cc.kv_exchange_us(link, kv, "allgather")
    return duration


def describe_kv(kv: cc.KvShape, link: sc.LinkModel, measured: bool, recorded: bool) -> str:
    """The sources line of the K/V exchange: its bytes and time per layer and phase (a
    recording's own where its spans hold it)."""
    parts = []
    for kind in sorted(set(kv.comm_types)):
        sent, calls = cc.exchange_volume(kv, kind)
        gather = kind == "allgather"
        where = "kv_gather node, comm lane" if gather else "ring inside attn, compute lane"
        time = "recorded" if (measured if gather else recorded) else \
            f"{cc.kv_exchange_us(link, kv, kind):.1f} us"
        parts.append(f"{kind} ({where}): {sent / 2**20:.2f} MiB in {calls} call(s), {time}")
    return (f"K/V exchange, CP {kv.cp}, per layer and phase (K/V {kv.kv_bytes / 2**20:.2f} "
            f"MiB per rank): " + "; ".join(parts))


def _dispatch_sync(sync_us: float) -> sc.ActionFn:
    def sync(rank: int, action: Action) -> float:
        return sync_us if (action.kind, action.node) == ("F", "dispatch") else 0.0
    return sync


def _mean_offsets(recorded, ep: int) -> Optional[list[float]]:
    if not recorded or recorded[0].world_size != ep:
        return None
    offsets = sc.aligned_comm(recorded).offsets.values()
    return [statistics.fmean(step[r] for step in offsets) for r in range(ep)]


def comm_sources(args, recorded, shape, link, cfg, throughput,
                 nodes: Optional[CommTable] = None):
    """(comm-lane time, the same as a local copy, the all-to-alls alone, description) for the
    chosen --link; the comm lane also runs the combine's unpermute (its epilogue). A comm
    table's times are whole nodes, epilogue included, the recording's comm spans unused."""
    epilogue = (lambda a: throughput.time_us(sc.FlopModel(cfg, shape.ep).work(a))) \
        if throughput is not None else (lambda a: 0.0)
    local = lambda r, a: link.local_copy_us(shape, a) + epilogue(a)  # noqa: E731
    if nodes is not None:
        only = ["the recording supplies compute only: no rank offsets from it, no replay of "
                "its steps"] if recorded else []
        return nodes.comm_us, local, nodes.comm_us, [nodes.describe(), *only]
    if args.link == "measured":
        table = sc.aligned_comm(recorded).durations
        return table, local, table, ["comm: each all-to-all's own recorded time (end minus "
                                     "the last rank's arrival)"]
    wire = lambda r, a: link.time_us(shape, a, args.imbalance)  # noqa: E731
    comm = lambda r, a: wire(r, a) + epilogue(a)  # noqa: E731
    where = (f", {link.gpus_per_node} GPUs per node over NVLink {link.nvlink_gbs:.0f} GB/s"
             if link.gpus_per_node else "")
    return comm, local, wire, [f"comm: link {link.kind}: {link.bandwidth_gbs:.4g} GB/s per GPU, "
                         f"{link.latency_us:.4g} us per call{where}; imbalance "
                         f"{args.imbalance:g}; split sizes back on the host after "
                         f"{link.sync_us:.0f} us"]


def _describe(args, recorded, throughput, lanes) -> list[str]:
    if recorded:
        steps = [s.step for s in recorded[0].steps]
        source = f"compute: recorded spans of {args.spans or args.trace} (steps {steps[0]}.." \
                 f"{steps[-1]}, mean per action)"
    else:
        source = (f"compute: FLOP counts at {throughput.gemm_tflops:.0f} TFLOP/s GEMM, "
                  f"{throughput.attn_tflops:.0f} TFLOP/s attention, {throughput.hbm_gbs:.0f} "
                  f"GB/s HBM")
    host = "none" if not args.host_from or lanes == THREAD else \
        f"eager per node from {args.host_from} x {args.host_scale:g}" + (
            f", graphed: {','.join(args.graphed_nodes)}" if args.graphed_nodes else "")
    seq = INLINE if lanes == THREAD else SERIAL
    return [source, f"lanes: {lanes} (sequential plan: {seq}); host launch cost: {host}"]


def base_throughput(args: argparse.Namespace) -> sc.Throughput:
    return sc.Throughput(args.gemm_tflops or DEFAULT_THROUGHPUT.gemm_tflops,
                         args.attn_tflops or DEFAULT_THROUGHPUT.attn_tflops,
                         args.hbm_gbs or DEFAULT_THROUGHPUT.hbm_gbs)


def calibrated_throughput(args: argparse.Namespace) -> sc.Throughput:
    """The rates of --gemm-tflops etc., scaled (all by one factor) so that the simulated
    time of --calibrate MODE:MS@EP is MS at that EP size."""
    base = base_throughput(args)
    try:
        mode, rest = args.calibrate.split(":")
        target_ms, at_ep = rest.split("@")
        target_us, at_ep = float(target_ms) * 1e3, int(at_ep)
        if mode not in MODES:
            raise ValueError
    except ValueError:
        raise SimInputError(f"--calibrate {args.calibrate}: expected MODE:MS@EP with MODE one "
                            f"of {', '.join(MODES)}, e.g. comp:150@4") from None
    at_args = argparse.Namespace(**{**vars(args), "ep": at_ep, "calibrate": None})

    def simulated_us(factor: float) -> float:
        return run_mode(build_scenario(at_args, base.scaled(factor)), mode).step_us
    low, high = 1e-3, 1e3
    for _ in range(36):  # the time falls as the rates rise: bisect on a log scale
        mid = math.sqrt(low * high)
        low, high = (mid, high) if simulated_us(mid) > target_us else (low, mid)
    factor = math.sqrt(low * high)
    reached = simulated_us(factor)
    if abs(reached - target_us) > 0.01 * target_us:
        raise SimInputError(f"--calibrate {args.calibrate}: no throughput gives that time "
                            f"(closest {reached / 1e3:.2f} ms; the host launch costs alone may "
                            "exceed it)")
    return base.scaled(factor)


# ---------------------------------------------------------------------------- running modes
def run_mode(scenario: Scenario, mode: str, starts=None, compute=None, comm=None,
             host=None) -> SimResult:
    """One mode: seq (sequential plan, serial lanes), ovl, wgrad (overlap plan + W actions),
    comp (the overlap plan with every all-to-all a local copy)."""
    cfg = scenario.cfg
    delay = mode == "wgrad"
    name = "sequential" if mode == "seq" else cfg.overlap.overlap_plan_name
    plan = build_plan(name, scenario.layout, cfg.train.num_microbatches, delay)
    costs = sc.NodeCosts(compute or scenario.compute.for_plan(delay),
                         scenario.comm_local if mode == "comp" else comm or scenario.comm,
                         host or scenario.host, scenario.sync)
    lanes = scenario.overlap_lanes
    if mode == "seq":
        lanes = INLINE if lanes == THREAD else SERIAL
    if mode in ("ovl", "wgrad"):  # comp's all-to-alls are local copies: not the link measured
        return simulate_contended(plan, scenario.layout, costs, scenario.ep, lanes, starts,
                                  *scenario.beside)
    return simulate(plan, scenario.layout, costs, scenario.ep, lanes, starts)


def run_all(scenario: Scenario) -> dict[str, SimResult]:
    modes = [m for m in MODES if m != "wgrad" or scenario.has_wgrad]
    return {mode: run_mode(scenario, mode, scenario.starts) for mode in modes}
