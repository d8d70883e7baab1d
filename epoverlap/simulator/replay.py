"""What a scenario's simulations show, and how well they reproduce a recorded run.

Owns `figures` (the headline numbers of a scenario: T per mode, T_comm = the all-to-alls alone
back to back from `t_comm_us`, T_ovl / max(T_comp, T_comm), T_seq / T_ovl, and the realized
share of the attainable saving (T_seq - T_ovl) / (T_seq - max(T_comp, T_comm))),
`layer_exposure` (exposed comm per layer, by the timeline tool's definitions), `as_rank_spans`
(a simulated step as span records, so the timeline's metrics, trace and PNG apply unchanged)
and `replay_steps` (each recorded step against a simulation driven by that step's own spans).
"""

from __future__ import annotations

import math
import statistics

from epoverlap.model.nodes import COMM
from epoverlap.profiling.spans import RankSpans, Span, StepSpans
from epoverlap.profiling.summary import span_summary
from epoverlap.schedule.pipeline import build_plan
from epoverlap.schedule.plan import action_lane, node_kinds
from epoverlap.simulator import costs as sc
from epoverlap.simulator.engine import THREAD, SimResult
from epoverlap.simulator.scenario import Scenario, recorded_cpu_host, run_mode, span_compute


def t_comm_us(scenario: Scenario) -> float:
    """The step's comm-lane collectives alone, back to back (T_comm: the all-to-alls, and
    under CP the K/V gathers): per collective the slowest rank's time."""
    cfg = scenario.cfg
    plan = build_plan(cfg.overlap.overlap_plan_name, scenario.layout, cfg.train.num_microbatches)
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
