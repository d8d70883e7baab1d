"""The price of --deterministic-mode, and what it is made of.

    python -m benchmarks.harness.bench_determinism [--cli-rounds 1] [--steps 40] [--ab-rounds 20] [--ops 30]

Settings, each eager and with the partial CUDA graphs (attn moe_router moe_preprocess):
  - `free`: not deterministic;
  - `det`: --deterministic-mode (torch's fill of new memory left off, the default);
  - `det_fill`: --deterministic-mode --deterministic-fill-uninitialized-memory (the fill on:
    every new tensor written with NaN or the largest integer first, one more kernel each).

The training command (`torchrun --standalone --nproc-per-node 1 -m epoverlap.train --preset P
--bf16 --mock-data`, optimizer on), --cli-rounds rounds of one run per mode and setting, in an
order that rotates from round to round: each run's median step time after the first 10 steps,
and the bits: `det` and `det_fill` must give the same losses (the fill changes no result), and
`det` the same in every round (the same command twice). Separate runs of one command differ by
10-20% on the lent hosts, more than the fill costs, so the figures that decide are:

--ab-rounds R: one trainer per mode and setting in this process (each sets its switches before
every forward-backward; the graphed ones are captured under theirs), their forward-backward
passes (no optimizer step) alternated step by step (`benchmarks/harness/bench_host.py`'s `alternate`):
host CPU and wall time, kernel launches per step, per node. With --ops N, one eager step per
setting under torch.profiler: the N ops whose host self time grows most from `free` to `det`.
cuBLAS's fixed workspace holds for the whole process there (it must precede cuBLAS's start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {"free": [], "det": ["--deterministic-mode"],
            "det_fill": ["--deterministic-mode", "--deterministic-fill-uninitialized-memory"]}
MODES = {"eager": ["--cuda-graph-impl", "none"],  # pinned: on CUDA the default is "graphs"
         "graphs": ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
                    "moe_router", "moe_preprocess"]}
SKIP_STEPS = 10  # compiles, graph capture, the allocator's growth


def run_once(preset: str, steps: int, extra: list[str], log: Path, cpu: bool = False) -> dict:
    """One training run; {"step_ms": median after SKIP_STEPS, "losses": [loss_hex, ...]}.
    `cpu`: fp32 on the CPU (the tool's own test), else bf16 on the GPU."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "epoverlap.train", "--preset", preset, *(["--device", "cpu"] if cpu else
                                                          ["--bf16"]), "--mock-data",
           "--train-iters", str(steps), "--log-interval", str(steps), "--log-json", str(log),
           *extra]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    times = [r["step_time_s"] * 1e3 for r in records if r["step"] > SKIP_STEPS]
    return {"step_ms": statistics.median(times), "losses": [r["loss_hex"] for r in records]}


def price(preset: str, steps: int, rounds: int, cpu: bool = False) -> dict:
    """{mode: {setting: [run, ...]}}, the runs of each round in a rotated order (`cpu`: the
    eager mode only, on the CPU)."""
    modes = ["eager"] if cpu else list(MODES)
    names = [(mode, setting) for mode in modes for setting in SETTINGS]
    runs = {mode: {setting: [] for setting in SETTINGS} for mode in modes}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(rounds):
            shift = round_index % len(SETTINGS)
            for mode, setting in names[shift:] + names[:shift]:
                log = Path(folder) / f"{mode}_{setting}_{round_index}.jsonl"
                run = run_once(preset, steps, MODES[mode] + SETTINGS[setting], log, cpu)
                runs[mode][setting].append(run)
                print(f"round {round_index + 1}/{rounds} {mode} {setting}: "
                      f"{run['step_ms']:.1f} ms/step", flush=True)
    return runs


def check_bits(runs: dict) -> list[str]:
    """Lines saying whether the fill and the repetition changed any loss."""
    lines = []
    for mode, by_setting in runs.items():
        det = by_setting["det"]
        same_fill = all(a["losses"] == b["losses"] for a, b in zip(det, by_setting["det_fill"]))
        same_again = all(run["losses"] == det[0]["losses"] for run in det)
        lines.append(f"{mode}: det vs det_fill losses {'identical' if same_fill else 'DIFFER'}; "
                     f"det over {len(det)} rounds {'identical' if same_again else 'DIFFER'}")
    return lines


def print_price(runs: dict) -> None:
    print("\n| mode | " + " | ".join(f"{s} ms/step" for s in SETTINGS) +
          " | det price | det_fill price |\n|" + " --- |" * (len(SETTINGS) + 3))
    for mode, by_setting in runs.items():
        med = {s: statistics.median(run["step_ms"] for run in r) for s, r in by_setting.items()}
        cells = " | ".join(f"{med[s]:.1f}" for s in SETTINGS)
        print(f"| {mode} | {cells} | {med['det'] / med['free'] - 1:+.0%} | "
              f"{med['det_fill'] / med['free'] - 1:+.0%} |")


def _use(setting: str) -> None:
    """Set the process-wide switches of `setting` (read by every op as it is dispatched)."""
    import torch
    import torch.utils.deterministic

    torch.use_deterministic_algorithms(setting != "free")
    torch.utils.deterministic.fill_uninitialized_memory = setting == "det_fill"


def in_process_sides(preset: str, groups, cpu: bool = False) -> dict:
    """One trainer per (mode, setting) in this process, each set to its setting before every
    forward-backward it runs; the graphed ones captured under theirs (a fill is a kernel
    inside the graph then). cuBLAS's fixed workspace holds for the whole process (it must
    precede cuBLAS's start), so `free` has it too here."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from epoverlap.config import parse_config
    from epoverlap.training.loop.trainer import Trainer
    from benchmarks.harness.bench_host import warm_up_and_capture

    sides = {}
    device = ["--device", "cpu", "--kernel-backend", "torch"] if cpu else ["--bf16"]
    for mode, flags in MODES.items():
        if cpu and mode != "eager":
            continue  # CUDA graphs need a GPU
        for setting in SETTINGS:
            _use(setting)
            argv = ["--preset", preset, *device, "--mock-data", "--skip-optimizer-step",
                    "--log-interval", "100000", *flags]
            trainer = Trainer(parse_config(argv), groups, log=lambda msg: None)
            warm_up_and_capture(trainer, trainer.microbatches(1), 3)
            run = trainer.run_microbatches
            trainer.run_microbatches = (  # noqa: E731 - every caller goes through the setting
                lambda *args, _run=run, _setting=setting: (_use(_setting), _run(*args))[1])
            sides[f"{mode} {setting}"] = trainer
    return sides


def in_process(preset: str, rounds: int, top: int, cpu: bool = False) -> None:
    """The sides' forward-backward passes alternated step by step (bench_host.alternate):
    host CPU and wall time, launches per step; with `top`, the ops whose host self time grows
    most in one eager step under torch.profiler."""
    from benchmarks.harness.bench_host import alternate, api_profile, print_ab
    from epoverlap.parallel.groups import destroy_distributed, init_distributed

    def profile(trainer, inputs):
        return {"api": api_profile(trainer, inputs, None), "python": ""} if top else None
    groups = init_distributed(1, "cpu" if cpu else "cuda")
    try:
        results = alternate(in_process_sides(preset, groups, cpu), rounds, 1, 2,
                            "determinism A/B",
                            profile=profile)
    finally:
        destroy_distributed(groups)
    if top:
        print_growth({side.split()[1]: {name: (calls, ms) for name, calls, ms in
                                        r.pop("profile")["api"]}
                      for side, r in results.items() if side.startswith("eager")}, top)
    for r in results.values():
        r.pop("profile", None)
    print(f"\nbench_determinism in one process: preset {preset}, forward-backward passes "
          f"(no optimizer step) alternated step by step, {rounds} rounds")
    print_ab(results)


def print_growth(rows: dict, top: int) -> None:
    """The `top` ops whose host self time grows most from `free` to `det`, in each setting."""
    totals = {s: sum(ms for _, ms in r.values()) for s, r in rows.items()}
    print("\nhost self ms of one eager step under torch.profiler: " +
          ", ".join(f"{s} {t:.1f}" for s, t in totals.items()))
    names = set().union(*rows.values())
    growth = sorted(names, key=lambda n: -(rows["det"].get(n, (0, 0))[1] -
                                           rows["free"].get(n, (0, 0))[1]))
    print("| op | calls free / det / det_fill | host self ms free / det / det_fill |\n"
          "| --- | --- | --- |")
    for name in growth[:top]:
        calls = " / ".join(str(rows[s].get(name, (0, 0))[0]) for s in SETTINGS)
        ms = " / ".join(f"{rows[s].get(name, (0, 0))[1]:.2f}" for s in SETTINGS)
        print(f"| {name} | {calls} | {ms} |")
    print()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--cli-rounds", type=int, default=1, metavar="R",
                        help="rounds of training-command runs (0: none)")
    parser.add_argument("--steps", type=int, default=40, help="steps of each command run")
    parser.add_argument("--ab-rounds", type=int, default=0, metavar="R",
                        help="rounds of the in-process A/B, one forward-backward per side each")
    parser.add_argument("--ops", type=int, default=0, metavar="N",
                        help="with --ab-rounds: the N ops whose host time grows most")
    parser.add_argument("--cpu", action="store_true",
                        help="eager only, on the CPU in fp32 (the tool's test)")
    args = parser.parse_args(argv)
    if args.steps <= SKIP_STEPS:
        parser.error(f"--steps must be > {SKIP_STEPS} (the first {SKIP_STEPS} are not timed)")
    if args.ops and not args.ab_rounds:
        parser.error("--ops profiles a step of the in-process A/B: give --ab-rounds too")
    if args.ab_rounds:
        in_process(args.preset, args.ab_rounds, args.ops, args.cpu)
    runs = price(args.preset, args.steps, args.cli_rounds, args.cpu) if args.cli_rounds else {}
    if runs:
        for line in check_bits(runs):
            print(line)
        print(f"\nbench_determinism: preset {args.preset}, the training command, {args.steps} "
              f"steps per run, median after step {SKIP_STEPS}, median of {args.cli_rounds} "
              "rounds")
        print_price(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
