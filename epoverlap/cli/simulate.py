"""Schedule simulator command: `epoverlap-simulate [--spans DIR | --trace FILE | --flops]
[options] [-- TRAINING FLAGS]`.

Replays the plans the executor runs (built by epoverlap/schedule/plan.py's builders from the
model's own layout) on two lanes per rank (epoverlap/simulator/engine.py: the executor's lane
and event rules, the host, all-to-alls that couple the EP group), with durations from
(epoverlap/simulator/scenario.py, its numbers from epoverlap/simulator/costs.py):
  compute  the compute spans of a profiled run (`--spans DIR`, or `--trace` the timeline tool's
           timeline_trace.json), or FLOP counts of the model shape (`--flops`) at a throughput
           given or calibrated on a measured time (`--calibrate comp:MS@EP`);
  comm     a link model (`--link nvlink|shm|ib`, bandwidth/latency overridable), one fitted to
           the run's own comm spans (`--link fit`), or those spans themselves (`--link
           measured`: each collective's time from its last rank's arrival; the default for a
           recording with all-to-all spans, `nvlink` otherwise, the report naming it); or each comm
           node's time from a microbenchmark of the dispatch's own calls (`--comm-from FILE`,
           benchmarks/harness/bench_host_bytes.py --time: the case and dispatch of the training
           flags, and its split-size exchange as the host sync), the recording then giving
           compute only;
  K/V      under --context-parallel-size, each layer's K/V exchange from the same link and
           the shape (epoverlap/simulator/context_costs.py): the all-gather's `kv_gather`
           node on the comm lane, the p2p ring inside `attn` on the compute lane;
  host     eager launch cost per node from a launch-bound run's spans (`--host-from`), none
           for `--graphed-nodes` (a CUDA-graph replay), none at all without `--host-from`.
The model shape (bytes of each all-to-all, FLOPs, plan size) comes from the training flags
after `--` (the training command's own flags, `--preset NAME` included).

Prints, for one EP group: T_seq (sequential plan), T_ovl (combined 1F1B), T_wgrad (plus
delayed weight grads, where W durations exist), T_comp (T_ovl's plan with every all-to-all a
local copy: the compute-only baseline), T_comm (the comm lane's collectives back to back:
the all-to-alls, and under CP the K/V gathers), T_ovl/max,
the realized share of the attainable saving (T_seq - T_ovl) / (T_seq - max(T_comp, T_comm)),
exposed comm per layer (the timeline tool's definitions), and, for a recorded run, measured
against simulated step time per step (epoverlap/simulator/replay.py). Writes to --out-dir the
simulated overlapped step as a PNG (the timeline's Gantt chart), a Perfetto trace, and
simulation.json. This module owns the command: its arguments, the printed report and the
output files. Exit status 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

from epoverlap.profiling.chrome_trace import chrome_trace
from epoverlap.profiling.gantt import draw_gantt
from epoverlap.profiling.spans import SpanFileError
from epoverlap.profiling.summary import InputError
from epoverlap.simulator import costs as sc
from epoverlap.simulator.engine import STREAM, THREAD, SimResult
from epoverlap.simulator.replay import (  # noqa: F401  (importable from here: tests, benchmarks)
    as_rank_spans, figures, layer_exposure, replay_steps, t_comm_us)
from epoverlap.simulator.scenario import (  # noqa: F401  (likewise)
    MODES, Scenario, SimInputError, build_scenario, calibrated_throughput, model_layout,
    run_all, run_mode)


# ---------------------------------------------------------------------------- report
def report(scenario: Scenario, results: dict[str, SimResult], replay: list[dict]) -> str:
    cfg, fig = scenario.cfg, figures(results, t_comm_us(scenario))
    lines = [f"epoverlap-simulate: EP {scenario.ep}, {cfg.model.num_layers} layer(s), "
             f"{cfg.train.num_microbatches} microbatches of {scenario.shape.tokens} tokens per "
             f"rank, hidden {scenario.shape.hidden}, top-{scenario.shape.topk}",
             *("  " + text for text in scenario.sources), ""]
    names = {"seq": "sequential plan", "ovl": f"{cfg.overlap.overlap_plan_name}",
             "wgrad": f"{cfg.overlap.overlap_plan_name} + delayed wgrad",
             "comp": "overlap plan, all-to-alls as local copies"}
    for mode in results:
        lines.append(f"T_{mode:<6} {fig[f'T_{mode}_ms']:10.2f} ms   ({names[mode]})")
    lines.append(f"T_comm   {fig['T_comm_ms']:10.2f} ms   (the comm lane's collectives back to "
                 "back: all-to-alls, K/V gathers)")
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
    parser.add_argument("--link", choices=["nvlink", "shm", "ib", "fit", "measured"],
                        help="all-to-all times (default: measured for recorded spans with "
                        "all-to-alls, else nvlink)")
    parser.add_argument("--comm-from", metavar="FILE", help="each all-to-all node's time and "
                        "the split-size host sync from this bench_host_bytes --time JSON (the "
                        "training flags' case and dispatch), in place of --link's")
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
                        "comp:150@4")
    parser.add_argument("--host-from", metavar="PATH", help="eager host launch cost per node "
                        "from this launch-bound run's spans (DIR or timeline trace)")
    parser.add_argument("--host-scale", type=float, default=1.0, help="multiply the "
                        "--host-from costs (a faster or slower host than the recording's)")
    parser.add_argument("--graphed-nodes", default="", help="comma list of nodes replayed as "
                        "CUDA graphs (no host launch cost), e.g. attn")
    parser.add_argument("--comm-beside-compute", type=float, default=1.0, metavar="F",
                        help="stretch factor (>= 1) of an all-to-all while its rank computes "
                        "beside it, for the share of it compute covers (1: none)")
    parser.add_argument("--compute-beside-comm", type=float, default=1.0, metavar="F",
                        help="stretch factor (>= 1) of a compute action beside an all-to-all")
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
    for name in ("comm_beside_compute", "compute_beside_comm"):
        value = getattr(args, name)
        if not (value >= 1 and math.isfinite(value)):
            raise SimInputError(f"--{name.replace('_', '-')} {value}: must be a finite number "
                                ">= 1 (a lane does not speed up beside the other)")
    if args.comm_from and args.link in ("fit", "measured"):
        raise SimInputError(f"--comm-from and --link {args.link}: both give the all-to-alls' "
                            "times; keep one")
    if args.calibrate and not args.flops:
        raise SimInputError("--calibrate needs --flops (recorded spans are measured)")
    unknown = [n for n in args.graphed_nodes if n not in ("attn", "mlp", "embed", "loss")]
    if unknown:
        raise SimInputError(f"--graphed-nodes {','.join(unknown)}: allowed attn, mlp, embed, "
                            "loss (compute nodes)")


if __name__ == "__main__":
    sys.exit(main())
