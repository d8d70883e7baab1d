"""Schedule simulator: `epoverlap-simulate [--spans DIR | --trace FILE | --flops] [options]
[-- TRAINING FLAGS]`.

Replays the plans the executor runs (built by epoverlap/schedule/plan.py's builders from the
model's own layout) on two lanes per rank (epoverlap/simulator/engine.py: the executor's lane and event
rules, the host, all-to-alls that couple the EP group), with durations from
(epoverlap/simulator/costs.py):
  compute  the compute spans of a profiled run (`--spans DIR`, or `--trace` the timeline tool's
           timeline_trace.json), or FLOP counts of the model shape (`--flops`) at a throughput
           given or calibrated on a measured time (`--calibrate comp:MS@EP`);
  comm     a link model (`--link nvlink|shm|ib`, bandwidth/latency overridable), one fitted to
           the run's own comm spans (`--link fit`), or those spans themselves (`--link
           measured`: each collective's time from its last rank's arrival);
  host     eager launch cost per node from a launch-bound run's spans (`--host-from`), none
           for `--graphed-nodes` (a CUDA-graph replay), none at all without `--host-from`.
The model shape (bytes of each all-to-all, FLOPs, plan size) comes from the training flags
after `--` (the training command's own flags, `--preset NAME` included).

Prints, for one EP group: T_seq (sequential plan), T_ovl (combined 1F1B), T_wgrad (plus
delayed weight grads, where W durations exist), T_comp (T_ovl's plan with every all-to-all a
local copy, the benchmark's definition), T_comm (the all-to-alls back to back), T_ovl/max,
the realized share of the attainable saving (T_seq - T_ovl) / (T_seq - max(T_comp, T_comm)),
exposed comm per layer (the timeline tool's definitions), and, for a recorded run, measured
against simulated step time per step. Writes to --out-dir the simulated overlapped step as a
PNG (epoverlap/cli/timeline.py's Gantt chart), a Perfetto trace, and simulation.json.
Exit status 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from epoverlap.config import parse_config, validate_config
from epoverlap.errors import ConfigError
from epoverlap.model.nodes import COMM
from epoverlap.profiling.spans import RankSpans, Span, SpanFileError, StepSpans, read_span_directory
from epoverlap.schedule.plan import Action, action_lane, build_plan, node_kinds
from epoverlap.simulator import costs as sc
from epoverlap.simulator.engine import INLINE, SERIAL, STREAM, THREAD, SimResult, simulate
from epoverlap.cli.timeline import (InputError, chrome_trace, draw_gantt, read_chrome_trace,
                                      span_summary)

MODES = ("seq", "ovl", "wgrad", "comp")
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
    sources: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- model shape
def model_config(args: argparse.Namespace, ep: Optional[int]):
    """The RunConfig of the simulated model: the training flags after `--`."""
    flags = list(args.train_flags)
    if ep is not None:
        flags += ["--expert-model-parallel-size", str(ep)]
    flags += ["--overlap-moe-expert-parallel-comm"]
    cfg = parse_config(flags)
    ep = cfg.parallel.expert_model_parallel_size
    if ep < 2:
        raise SimInputError(f"--ep {ep}: the simulator needs an EP group of 2 or more ranks "
                            "(--ep or --expert-model-parallel-size)")
    try:
        validate_config(cfg, ep, cfg.train.bf16)
    except ConfigError as error:
        raise SimInputError(str(error)) from None
    return cfg


def model_layout(cfg, ep: int) -> list:
    """The layout of the real model, built on the meta device (no memory, no values)."""
    import torch

    from epoverlap.model.transformer import MoEModel
    from epoverlap.parallel.comm import ExpertComm
    from epoverlap.kernels import make_moe_ops
    model = MoEModel(cfg, ExpertComm(None, ep), 0, make_moe_ops("torch"),
                     dtype=torch.bfloat16, device=torch.device("meta"))
    return model.layout()


# ---------------------------------------------------------------------------- duration sources
def read_recorded(args: argparse.Namespace) -> Optional[list[RankSpans]]:
    """The recorded run's spans (--spans DIR or --trace FILE), restricted to --steps."""
    if args.spans:
        ranks = read_span_directory(args.spans)
    elif args.trace:
        ranks = read_chrome_trace(args.trace)
    else:
        return None
    if args.steps:
        first, last = _step_range(args.steps)
        for rank in ranks:
            rank.steps = [s for s in rank.steps if first <= s.step <= last]
        if not ranks[0].steps:
            raise SimInputError(f"--steps {args.steps}: no recorded step in that range")
    return ranks


def _step_range(text: str) -> tuple[int, int]:
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        raise SimInputError(f"--steps {text}: expected START:END, e.g. 2:4") from None
    return first, last


def link_model(args: argparse.Namespace, recorded, shape: sc.A2aShape) -> sc.LinkModel:
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


def flop_compute(cfg, ep: int, throughput: sc.Throughput, load) -> ComputeSource:
    models = {flag: sc.FlopModel(cfg, ep, delay_wgrad=flag) for flag in (False, True)}

    def duration(rank: int, action: Action, delay_wgrad: bool) -> float:
        return throughput.time_us(models[delay_wgrad].work(action))
    return ComputeSource(duration, load, wgrad_recorded=True)


@functools.lru_cache(maxsize=8)
def _host_tables(path: str, like_layout: tuple, sync_us: float) -> tuple[dict, dict]:
    """(host gaps, compute span means) of a GPU recording, per (phase, node) and finer."""
    ranks = read_span_directory(path) if Path(path).is_dir() else read_chrome_trace(path)
    if ranks[0].clock == "host":
        raise SimInputError(f"--host-from {path}: a CPU recording (clock host) has no separate "
                            "host; give a GPU run's spans")
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
    ep = args.ep or (recorded[0].world_size if recorded else None)
    cfg = model_config(args, ep)
    ep = cfg.parallel.expert_model_parallel_size
    if not 1.0 <= args.imbalance <= ep:
        raise SimInputError(f"--imbalance {args.imbalance}: allowed 1 (balanced) .. {ep} (EP)")
    shape = sc.A2aShape.from_config(cfg, ep)
    link = link_model(args, recorded, shape)
    load = load_factor(args.imbalance, ep)
    if recorded is None and throughput is None:
        throughput = calibrated_throughput(args) if args.calibrate else base_throughput(args)
    compute = span_compute(recorded, load) if recorded else \
        flop_compute(cfg, ep, throughput, load)
    comm, local, wire, sources = comm_sources(args, recorded, shape, link, cfg, throughput)
    lanes = args.lanes if args.lanes != "auto" else (
        THREAD if recorded and recorded[0].clock == "host" else STREAM)
    gpu = lanes != THREAD
    layout = model_layout(cfg, ep)
    host = host_costs(args.host_from, args.graphed_nodes, layout, link.sync_us,
                      args.host_scale) if gpu else \
        recorded_cpu_host(recorded, layout)
    scenario = Scenario(cfg, layout, ep, shape, lanes, compute, comm, local, wire, host=host,
                        sync=_dispatch_sync(link.sync_us if gpu else 0.0),
                        recorded=recorded, starts=_mean_offsets(recorded, ep),
                        has_wgrad=compute.wgrad_recorded, comm_measured=args.link == "measured")
    scenario.sources = _describe(args, recorded, throughput, lanes) + sources
    return scenario


def _dispatch_sync(sync_us: float) -> sc.ActionFn:
    def sync(rank: int, action: Action) -> float:
        return sync_us if (action.kind, action.node) == ("F", "dispatch") else 0.0
    return sync


def _mean_offsets(recorded, ep: int) -> Optional[list[float]]:
    if not recorded or recorded[0].world_size != ep:
        return None
    offsets = sc.aligned_comm(recorded).offsets.values()
    return [statistics.fmean(step[r] for step in offsets) for r in range(ep)]


def comm_sources(args, recorded, shape, link, cfg, throughput):
    """(comm-lane time, the same as a local copy, the all-to-alls alone, description) for the
    chosen --link; the comm lane also runs the combine's unpermute (its epilogue)."""
    epilogue = (lambda a: throughput.time_us(sc.FlopModel(cfg, shape.ep).work(a))) \
        if throughput is not None else (lambda a: 0.0)
    local = lambda r, a: link.local_copy_us(shape, a) + epilogue(a)  # noqa: E731
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
                            f"of {', '.join(MODES)}, e.g. comp:144.89@4") from None
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
    name = "sequential" if mode == "seq" else cfg.overlap.overlap_plan
    plan = build_plan(name, scenario.layout, cfg.train.num_microbatches, delay)
    costs = sc.NodeCosts(compute or scenario.compute.for_plan(delay),
                         scenario.comm_local if mode == "comp" else comm or scenario.comm,
                         host or scenario.host, scenario.sync)
    lanes = scenario.overlap_lanes
    if mode == "seq":
        lanes = INLINE if lanes == THREAD else SERIAL
    return simulate(plan, scenario.layout, costs, scenario.ep, lanes, starts)


def run_all(scenario: Scenario) -> dict[str, SimResult]:
    modes = [m for m in MODES if m != "wgrad" or scenario.has_wgrad]
    return {mode: run_mode(scenario, mode, scenario.starts) for mode in modes}


def t_comm_us(scenario: Scenario) -> float:
    """The step's all-to-alls alone, back to back (the benchmark's T_comm): per collective
    the slowest rank's time."""
    cfg = scenario.cfg
    plan = build_plan(cfg.overlap.overlap_plan, scenario.layout, cfg.train.num_microbatches)
    kinds = node_kinds(scenario.layout)
    return sum(max(scenario.wire(r, a) for r in range(scenario.ep)) for a in plan
               if action_lane(a, kinds) == COMM)


def figures(results: dict[str, SimResult], t_comm: float) -> dict:
    """The headline numbers (ms) and ratios of one scenario."""
    out = {f"T_{mode}_ms": result.step_us / 1e3 for mode, result in results.items()}
    out["T_comm_ms"] = t_comm / 1e3
    best = max(out["T_comp_ms"], out["T_comm_ms"])
    out["ovl_over_max"] = out["T_ovl_ms"] / best
    out["seq_over_ovl"] = out["T_seq_ms"] / out["T_ovl_ms"]
    attainable = out["T_seq_ms"] - best
    for mode in ("ovl", "wgrad"):
        if f"T_{mode}_ms" in out:
            saved = out["T_seq_ms"] - out[f"T_{mode}_ms"]
            out[f"realized_share_{mode}"] = saved / attainable if attainable > 0 else math.nan
    return out


def as_rank_spans(result: SimResult, world_size: int) -> list[RankSpans]:
    """A simulated step in the span-file records (times relative to each rank's start), so
    the timeline tool's metrics, trace and PNG apply unchanged."""
    out = []
    for rank in result.ranks:
        spans = [Span.from_action(s.lane, str(s.action), s.start_us - rank.start_us,
                                  s.end_us - rank.start_us) for s in rank.spans]
        out.append(RankSpans(rank.rank, world_size, "simulated", "simulated",
                             [StepSpans(1, rank.step_us, spans)], "simulated"))
    return out


def layer_exposure(result: SimResult, ep: int) -> list[dict]:
    """Exposed comm per layer, mean over ranks (timeline definitions)."""
    summary = span_summary(as_rank_spans(result, ep), [1])["steps"][0]["ranks"]
    layers: dict = {}
    for rank in summary:
        for entry in rank["layers"]:
            layers.setdefault(entry["layer"], []).append(entry)
    return [{"layer": layer, **{key: statistics.fmean(e[key] for e in entries) / 1e3
                                for key in ("comm_us", "exposed_comm_us")}}
            for layer, entries in layers.items() if layer is not None]


def replay_steps(scenario: Scenario) -> list[dict]:
    """Per recorded step: its measured time (slowest rank) against a simulation driven by that
    step's own compute spans, rank start offsets and, on a GPU, each rank's host time before
    its first action (`gpu_prelude_us`); comm as chosen."""
    mode = sc.recorded_mode(scenario.recorded)
    aligned = sc.aligned_comm(scenario.recorded)
    rows = []
    for step in scenario.recorded[0].steps:
        one = [RankSpans(r.rank, r.world_size, r.device, r.clock,
                         [s for s in r.steps if s.step == step.step], r.path)
               for r in scenario.recorded]
        compute = span_compute(one, lambda r, a: 1.0).for_plan(mode == "wgrad")
        comm = sc.aligned_comm(one).durations if scenario.comm_measured else None
        on_threads = scenario.overlap_lanes == THREAD
        host = recorded_cpu_host(one, scenario.layout) if on_threads else None
        offsets = aligned.offsets[step.step]
        preludes = [0.0] * len(one) if on_threads else [gpu_prelude_us(r) for r in one]
        result = run_mode(scenario, mode, [o + p for o, p in zip(offsets, preludes)], compute,
                          comm, host)
        simulated = max(t.end_us - o for t, o in zip(result.ranks, offsets))
        measured = max(s.step_time_us for r in one for s in r.steps)
        rows.append({"step": step.step, "mode": mode, "measured_ms": measured / 1e3,
                     "simulated_ms": simulated / 1e3, "prelude_ms": max(preludes) / 1e3,
                     "error": simulated / measured - 1.0})
    return rows


def gpu_prelude_us(rank_spans: RankSpans) -> float:
    """A GPU recording's host time from the step's start to its first action: the recorder
    syncs the GPU when the step starts, so nothing runs on it until the host reaches that
    action (the step's data, zeroing the grads); its `queued_us` marks when it did. (A CPU
    recording's is the first action's own gap, `recorded_cpu_host`.)"""
    spans = rank_spans.steps[0].spans
    return min((s.queued_us if s.queued_us is not None else s.start_us) for s in spans) \
        if spans else 0.0


# ---------------------------------------------------------------------------- report
def report(scenario: Scenario, results: dict[str, SimResult], replay: list[dict]) -> str:
    cfg, fig = scenario.cfg, figures(results, t_comm_us(scenario))
    lines = [f"epoverlap-simulate: EP {scenario.ep}, {cfg.model.num_layers} layer(s), "
             f"{cfg.train.num_microbatches} microbatches of {scenario.shape.tokens} tokens per "
             f"rank, hidden {scenario.shape.hidden}, top-{scenario.shape.topk}",
             *("  " + text for text in scenario.sources), ""]
    names = {"seq": "sequential plan", "ovl": f"{cfg.overlap.overlap_plan}",
             "wgrad": f"{cfg.overlap.overlap_plan} + delayed wgrad",
             "comp": "overlap plan, all-to-alls as local copies"}
    for mode in results:
        lines.append(f"T_{mode:<6} {fig[f'T_{mode}_ms']:10.2f} ms   ({names[mode]})")
    lines.append(f"T_comm   {fig['T_comm_ms']:10.2f} ms   (all-to-alls back to back)")
    lines.append(f"T_ovl / max(T_comp, T_comm) = {fig['ovl_over_max']:.3f};  T_seq / T_ovl = "
                 f"{fig['seq_over_ovl']:.3f}")
    for mode in ("ovl", "wgrad"):
        if f"realized_share_{mode}" in fig:
            lines.append(f"realized share of the attainable saving, {mode}: (T_seq - T_{mode}) /"
                         f" (T_seq - max) = {fig[f'realized_share_{mode}']:.3f}")
    lines += ["", "exposed comm per layer, overlapped step (ms, mean over ranks)",
              "layer      comm   exposed"]
    lines += [f"{e['layer']:5d} {e['comm_us']:9.2f} {e['exposed_comm_us']:9.2f}"
              for e in layer_exposure(results["ovl"], scenario.ep)]
    if replay:
        lines += ["", f"recorded run ({replay[0]['mode']}): measured vs simulated step "
                  "(slowest rank; a GPU recording's host time before its first action, "
                  "replayed as recorded: prelude)",
                  " step  measured ms  simulated ms   error  prelude ms"]
        lines += [f"{r['step']:5d} {r['measured_ms']:11.2f} {r['simulated_ms']:13.2f} "
                  f"{r['error']:+7.1%} {r['prelude_ms']:11.2f}" for r in replay]
        mean_m = statistics.fmean(r["measured_ms"] for r in replay)
        mean_s = statistics.fmean(r["simulated_ms"] for r in replay)
        lines.append(f" mean {mean_m:11.2f} {mean_s:13.2f} {mean_s / mean_m - 1:+7.1%}")
    return "\n".join(lines)


def write_outputs(scenario: Scenario, results, replay, out_dir: Path, png: bool,
                  mode: str = "ovl") -> list[Path]:
    """simulation.json (every figure), the trace and PNG of the `mode` step (8 ranks at most
    in the PNG, 16 in the trace)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if mode not in results:
        raise SimInputError(f"--draw {mode}: this scenario has no such mode (no W durations in "
                            "the recording)")
    ranks = as_rank_spans(results[mode], scenario.ep)
    written = [out_dir / "simulation.json", out_dir / "simulated_trace.json"]
    document = {"format": "epoverlap-simulation", "version": 1, "sources": scenario.sources,
                "ep": scenario.ep, "figures": figures(results, t_comm_us(scenario)),
                "exposed_per_layer_ms": layer_exposure(results["ovl"], scenario.ep),
                "replay": replay}
    written[0].write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    written[1].write_text(json.dumps(chrome_trace(ranks[:16], [1], "simulated")) + "\n",
                          encoding="utf-8")
    if png:
        title = f"simulated {mode}, EP {scenario.ep}: " + scenario.sources[-1]
        draw_gantt(ranks[:8], 1, out_dir / "simulated.png", title=title[:160])
        written.append(out_dir / "simulated.png")
    return written


# ---------------------------------------------------------------------------- command line
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="epoverlap-simulate",
        description="Replay the executor's plans on simulated lanes; print T_seq, T_ovl, "
                    "T_ovl/max, exposed comm per layer. Training flags after `--` give the "
                    "model shape.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--spans", metavar="DIR", help="span files of a profiled run")
    source.add_argument("--trace", metavar="FILE", help="the timeline tool's timeline_trace.json")
    source.add_argument("--flops", action="store_true", help="compute from FLOP counts")
    parser.add_argument("--steps", help="START:END recorded steps to use (default: all)")
    parser.add_argument("--ep", type=int, help="EP size (default: the recording's world size "
                        "or --expert-model-parallel-size)")
    parser.add_argument("--link", default="nvlink",
                        choices=["nvlink", "shm", "ib", "fit", "measured"])
    parser.add_argument("--link-bandwidth-gbs", type=float, help="per-GPU GB/s (400 Gb/s = 50)")
    parser.add_argument("--link-latency-us", type=float, help="per all-to-all call")
    parser.add_argument("--gpus-per-node", type=int, help="peers in a node use NVLink (ib)")
    parser.add_argument("--sync-us", type=float, help="split-size host sync after this long")
    parser.add_argument("--imbalance", type=float, default=1.0,
                        help="max / mean tokens received per rank (1 = balanced)")
    parser.add_argument("--gemm-tflops", type=float)
    parser.add_argument("--attn-tflops", type=float)
    parser.add_argument("--hbm-gbs", type=float)
    parser.add_argument("--calibrate", metavar="MODE:MS@EP", help="scale the rates so the "
                        "simulated T_MODE (seq, ovl, wgrad, comp) at EP is MS, e.g. "
                        "comp:144.89@4")
    parser.add_argument("--host-from", metavar="PATH", help="eager host launch cost per node "
                        "from this launch-bound run's spans (DIR or timeline trace)")
    parser.add_argument("--host-scale", type=float, default=1.0, help="multiply the "
                        "--host-from costs (a faster or slower host than the recording's)")
    parser.add_argument("--graphed-nodes", default="", help="comma list of nodes replayed as "
                        "CUDA graphs (no host launch cost), e.g. attn")
    parser.add_argument("--lanes", default="auto", choices=["auto", STREAM, THREAD])
    parser.add_argument("--out-dir", default="runs/simulate")
    parser.add_argument("--no-png", action="store_true")
    parser.add_argument("--draw", default="ovl", choices=MODES,
                        help="the simulated mode drawn in simulated.png / simulated_trace.json")
    args = parser.parse_args(argv[:split])
    args.train_flags = argv[split + 1:]
    args.graphed_nodes = [n for n in args.graphed_nodes.split(",") if n]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        _check_args(args)
        scenario = build_scenario(args)
        results = run_all(scenario)
        replay = replay_steps(scenario) if scenario.recorded else []
        print(report(scenario, results, replay))
        for path in write_outputs(scenario, results, replay, Path(args.out_dir), not args.no_png,
                                  args.draw):
            print(f"wrote {path}")
    except (SimInputError, SpanFileError, InputError, sc.MissingDuration) as error:
        print(f"epoverlap-simulate: error: {str(error).strip(chr(34))}", file=sys.stderr)
        return 2
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if not (args.spans or args.trace or args.flops):
        raise SimInputError("give a duration source: --spans DIR, --trace FILE or --flops")
    for name in ("link_bandwidth_gbs", "link_latency_us", "sync_us", "gemm_tflops",
                 "attn_tflops", "hbm_gbs", "host_scale"):
        value = getattr(args, name)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise SimInputError(f"--{name.replace('_', '-')} {value}: must be a finite number "
                                ">= 0")
    if args.calibrate and not args.flops:
        raise SimInputError("--calibrate needs --flops (recorded spans are measured)")
    unknown = [n for n in args.graphed_nodes if n not in ("attn", "mlp", "embed", "loss")]
    if unknown:
        raise SimInputError(f"--graphed-nodes {','.join(unknown)}: allowed attn, mlp, embed, "
                            "loss (compute nodes)")


if __name__ == "__main__":
    sys.exit(main())
