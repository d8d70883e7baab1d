"""The simulator against the measured steps of the GPUs as 2 emulated hosts, from inputs
measured apart from the runs it predicts (issue 44: within 10%, flat and by host).

    python -m benchmarks.harness.sim_hosts_check DIR [--out FILE] [--train-flags FLAGS]
    python -m benchmarks.harness.sim_hosts_check DIR --hold-of DISPATCH

DIR is laid out by the GPU recipe `hosts_sim_inputs` (benchmarks/gpu/recipes.py):
  host_timing.json              bench_host_bytes --time at the run's shape: each comm node of
                                each dispatch timed alone, and the split-size exchange
  a2a_links.json                bench_a2a_links --beside-gemm (optional): each link's
                                all-to-all alone and beside a GEMM loop; the slowdown of the
                                group a run's inter-host bytes take (flat: every rank; by host:
                                a rail), at its largest size, is the run's
                                --comm-beside-compute (1 where not measured)
  profile_comp_seq/             span files of the run, sequential, all-to-alls as local copies,
                                each held on the comm lane (--local-copy-hold-us) for the
                                median of the flat dispatch's nodes in host_timing.json
                                (`--hold-of per_expert` prints it), so the host runs ahead of
                                the compute as in the runs predicted and the compute spans are
                                the device's (an unheld local-copy step is bound by the host's
                                launches: its spans hold the gaps between them); recordings
                                made before the hold existed are unheld, the row says which
  profile_comp_wgrad/           the same, overlap + delayed weight grads
  profile_comp_node_{seq,wgrad}/  the same by host (its own preprocess and reorders; held for
                                the by-host nodes' median); where absent, the by-host runs
                                take the flat ones
  profile_{flat,node}_{seq,ovl}/  the runs predicted: flat or by host, sequential or overlap +
                                delayed weight grads (HOSTS_SIDES)
Each recorded run is simulated (`epoverlap-simulate`, through the functions the command runs)
from the independent inputs only: compute from the local-copy recording of its schedule and
dispatch (sequential: comp_seq; overlap: comp_wgrad, whose W spans the overlap plan needs), every
all-to-all and the forward dispatch's host sync from host_timing.json (`--comm-from`), its
slowdown beside compute from a2a_links.json, no host launch cost; the model and plan from the
run's training flags (the recipe's HOSTS_FLAGS, or --train-flags, and the side's). A run not
recorded is listed as such.

What is compared. The simulator's T of the run's mode (T_seq, or T_wgrad for the overlap with
delayed weight grads) is the plan's actions on both lanes from the first action: the
forward-backward. A recorded step's window is its `step_time_us` (the recorder's step: from its
start, before the first action, to its last action's end; span format 3 keeps the grad
reduction, clip and optimizer apart, in `step_parts`, outside it) or, in a file whose steps
also hold spans of actions outside the plan's grammar (another tool's, e.g. a
`grad_allreduce`), the end of its last plan action; the table's measured figure is that
window's mean over steps and ranks. The window also holds the host's time before
the first action (the step's data, zeroed grads: the prelude), which the simulator does not
model: the simulated figure is T plus the compute recording's prelude (mean over its steps and
ranks), an input independent of the all-to-alls; both are shown.

What is read from a local-copy recording: its compute spans (each node's mean time; the
comm spans and the step's length, which the hold lengthens, are not read) and its prelude
(before the first action, where the hold has not started yet).

Prints a markdown table (run, simulated, measured, error, the compute recording's hold, the
exact `epoverlap-simulate` command of each row) and writes the rows to --out (default
DIR/sim_hosts_check.json). `--hold-of DISPATCH` instead prints the hold (whole us) a local-copy
recording of that dispatch takes: the median of its four comm nodes in DIR/host_timing.json at
the recipe's case (HOSTS_CASE).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

if not torch.cuda.is_available():  # the run's flags pick Triton kernels: interpreted on a CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.gpu.recipes import HOSTS_CASE, HOSTS_FLAGS, HOSTS_SIDES  # noqa: E402
from epoverlap.cli import simulate as sim  # noqa: E402
from epoverlap.simulator.comm_table import NODES  # noqa: E402
from epoverlap.profiling.spans import (RankSpans, StepSpans, parse_action,  # noqa: E402
                                       read_span_directory)

TIMING = "host_timing.json"
LINKS = "a2a_links.json"  # bench_a2a_links --beside-gemm: the all-to-all's slowdown beside GEMMs
BESIDE_GROUP = {"flat": "flat", "node": "inter"}  # the group whose bytes cross hosts
RUNS = ("flat_seq", "flat_ovl", "node_seq", "node_ovl")
COMPUTE_FROM = {"seq": "profile_comp_seq", "ovl": "profile_comp_wgrad"}  # schedule -> recording
SIMULATED_MODE = {"seq": "seq", "ovl": "wgrad"}  # the *_ovl sides delay the weight grads


# ---------------------------------------------------------------------------- measured
def plan_spans(step: StepSpans) -> list:
    """The step's spans of plan actions (`[FBW]<mb>.<node>[.L<layer>]`)."""
    def in_plan(action: str) -> bool:
        try:
            parse_action(action)
        except ValueError:
            return False
        return True
    return [span for span in step.spans if in_plan(span.action)]


def window_us(step: StepSpans) -> tuple[float, str]:
    """(the step's forward-backward window, which figure it is) (module docstring)."""
    spans = plan_spans(step)
    if len(spans) == len(step.spans) or not spans:
        return step.step_time_us, "step_time_us"
    return max(span.end_us for span in spans), "last plan action's end"


def prelude_us(step: StepSpans) -> float:
    """The host's time from the step's start to its first plan action's queueing."""
    spans = plan_spans(step)
    return min((s.queued_us if s.queued_us is not None else s.start_us) for s in spans) \
        if spans else 0.0


def measured(ranks: list[RankSpans]) -> dict:
    """The recorded windows (ms): mean over steps and ranks, the slowest rank's per step."""
    windows = [[window_us(step) for step in rank.steps] for rank in ranks]
    per_step = [max(w for w, _ in column) / 1e3 for column in zip(*windows)]
    flat = [w / 1e3 for rank in windows for w, _ in rank]
    return {"ms": statistics.fmean(flat), "slowest_rank_per_step_ms": per_step,
            "window": sorted({name for rank in windows for _, name in rank}),
            "steps": [step.step for step in ranks[0].steps], "ranks": len(ranks)}


def mean_prelude_ms(ranks: list[RankSpans]) -> float:
    return statistics.fmean(prelude_us(step) for rank in ranks for step in rank.steps) / 1e3


# ---------------------------------------------------------------------------- simulated
def run_flags(train_flags: str, run: str, world: int) -> list[str]:
    """The training flags of one run: the model's, then its side's."""
    return shlex.split(train_flags.format(gpus=world)) + shlex.split(HOSTS_SIDES[run])


def compute_from(folder: Path, run: str) -> Path:
    """The local-copy recording a run's compute comes from: its schedule's, by host its own
    dispatch's where recorded (`profile_comp_node_*`), else the flat one."""
    dispatch, schedule = run.rsplit("_", 1)
    flat = folder / COMPUTE_FROM[schedule]
    own = flat.with_name(flat.name.replace("profile_comp_", f"profile_comp_{dispatch}_"))
    return own if dispatch == "node" and own.exists() else flat


def beside_factor(folder: Path, run: str) -> tuple[float, str]:
    """(the all-to-all's slowdown beside compute, where it comes from) for a run: from
    DIR/a2a_links.json's `beside_gemm` record of the group its inter-host bytes take (flat:
    every rank; by host: a rail), at the largest size; 1 where not measured."""
    group = BESIDE_GROUP[run.rsplit("_", 1)[0]]
    try:
        results = json.loads((folder / LINKS).read_text(encoding="utf-8"))["results"]
    except (OSError, ValueError, KeyError, TypeError):
        return 1.0, f"none ({LINKS} absent or unreadable)"
    measured = [r for r in results if r.get("group") == group and "beside_gemm" in r]
    if not measured:
        return 1.0, f"none (no beside_gemm record of group {group} in {LINKS})"
    largest = max(measured, key=lambda r: r["bytes"])
    factor = max(1.0, float(largest["beside_gemm"]["slowdown"]))
    return factor, f"{LINKS} group {group}, {largest['bytes'] / 2 ** 20:g} MiB per rank"


def simulator_flags(compute: Path, timing: Path, train: list[str],
                    beside: float = 1.0) -> list[str]:
    contention = ["--comm-beside-compute", f"{beside:.4g}"] if beside != 1.0 else []
    return ["--spans", str(compute), "--comm-from", str(timing), *contention, "--no-png",
            "--", *train]


def command(flags: list[str]) -> str:
    """The flags as a shell command (with the environment the simulator needed here)."""
    env = "TRITON_INTERPRET=1 " if os.environ.get("TRITON_INTERPRET") == "1" \
        and not torch.cuda.is_available() else ""
    return f"{env}epoverlap-simulate {shlex.join(flags)}"


def simulate_ms(flags: list[str], mode: str) -> float:
    """The simulator's T of `mode` (ms), as `epoverlap-simulate` computes it."""
    scenario = sim.build_scenario(sim.parse_args(flags))
    if mode == "wgrad" and not scenario.has_wgrad:
        raise sim.SimInputError(f"{flags[1]}: no W spans, no T_wgrad")
    return sim.run_mode(scenario, mode, scenario.starts).step_us / 1e3


def check_run(folder: Path, run: str, train_flags: str) -> dict:
    """One recorded run against its simulation (`missing` where an input is not there)."""
    schedule, compute = run.rsplit("_", 1)[1], compute_from(folder, run)
    needed = [folder / f"profile_{run}", compute, folder / TIMING]
    missing = [path.name for path in needed if not path.exists()]
    if missing:
        return {"run": run, "missing": missing}
    recorded = read_span_directory(folder / f"profile_{run}")
    beside, beside_from = beside_factor(folder, run)
    flags = simulator_flags(compute, folder / TIMING, run_flags(train_flags, run,
                                                                recorded[0].world_size),
                            beside)
    mode = SIMULATED_MODE[schedule]
    t_ms = simulate_ms(flags, mode)
    compute_ranks = read_span_directory(compute)
    prelude = mean_prelude_ms(compute_ranks)
    got = measured(recorded)
    return {"run": run, "mode": mode, "compute_from": compute.name,
            "compute_hold_us": compute_ranks[0].local_copy_hold_us,
            "comm_beside_compute": beside, "comm_beside_compute_from": beside_from,
            "simulated_T_ms": t_ms, "prelude_ms": prelude,
            "simulated_ms": t_ms + prelude, "measured_ms": got["ms"], "measured": got,
            "error": (t_ms + prelude) / got["ms"] - 1.0, "command": command(flags)}


# ---------------------------------------------------------------------------- report
def table(rows: list[dict]) -> str:
    lines = ["| run | T | simulated T ms | + prelude ms | simulated ms | measured ms (window) "
             "| error | compute held us | all-to-all beside compute | command |",
             "|" + " --- |" * 10]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['run']} | - | - | - | - | not recorded: "
                         f"{', '.join(r['missing'])} missing | - | - | - | - |")
            continue
        window = " / ".join(r["measured"]["window"])
        lines.append(f"| {r['run']} | T_{r['mode']} | {r['simulated_T_ms']:.1f} | "
                     f"{r['prelude_ms']:.1f} | {r['simulated_ms']:.1f} | "
                     f"{r['measured_ms']:.1f} ({window}) | {r['error']:+.1%} | "
                     f"{r['compute_hold_us']:.0f} | x{r['comm_beside_compute']:.3g} | "
                     f"`{r['command']}` |")
    return "\n".join(lines)


def hold_of(folder: Path, dispatch: str) -> int:
    """The hold (whole us) of a local-copy recording of `dispatch` (module docstring)."""
    path = folder / TIMING
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        nodes = record["cases"][HOSTS_CASE][dispatch]["timing"]["nodes"]
        return round(statistics.median(float(nodes[node]["median_us"]) for node in NODES))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise sim.SimInputError(f"--hold-of {dispatch}: {path} has no median_us of the "
                                f"{', '.join(NODES)} nodes of case {HOSTS_CASE} "
                                f"({type(error).__name__}: {error})") from None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", metavar="DIR", help="the hosts_sim_inputs recipe's folder")
    parser.add_argument("--out", help="the rows as JSON (default DIR/sim_hosts_check.json)")
    parser.add_argument("--train-flags", default=HOSTS_FLAGS,
                        help="the runs' training flags before their side's ({gpus}: the "
                             "recording's ranks; default: the recipe's HOSTS_FLAGS)")
    parser.add_argument("--hold-of", metavar="DISPATCH",
                        choices=("per_expert", "per_rank", "by_host"),
                        help="print the hold a local-copy recording of DISPATCH takes (us) "
                             "and exit")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    try:
        if args.hold_of:
            print(hold_of(folder, args.hold_of))
            return 0
        rows = [check_run(folder, run, args.train_flags) for run in RUNS]
    except (sim.SimInputError, sim.SpanFileError, sim.sc.MissingDuration) as error:
        print(f"sim_hosts_check: {error}", file=sys.stderr)
        return 2
    print(table(rows))
    out = Path(args.out) if args.out else folder / "sim_hosts_check.json"
    out.write_text(json.dumps({"folder": str(folder), "train_flags": args.train_flags,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if any("missing" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
