"""The training command's step time per path, the paths run in interleaved rounds.

    python -m benchmarks.harness.bench_train_rounds --side NAME=FLAGS [--side NAME@TREE=FLAGS ...]
        [--rounds 3] [--warmup 3] [--out DIR] -- COMMAND...

COMMAND is the one training command every side runs, launcher included (e.g. `python -m
torch.distributed.run --standalone --nproc-per-node=2 -m epoverlap.train --preset megatron-cmp
--mock-data --bf16 --expert-model-parallel-size 2 --train-iters 15`); a side appends its FLAGS
(shell words, may be empty) and `--log-json DIR/logs/NAME_ROUND.jsonl`. A side named NAME@TREE
runs from the folder TREE (another tree, e.g. .baseline/ from `git archive COMMIT | tar x -C
.baseline`) with TREE first on PYTHONPATH: `python -m` puts its working folder ahead of
PYTHONPATH, so PYTHONPATH alone would run this tree's package on both sides.
Round r runs the sides in their order rotated by r - 1 (two sides: AB, BA, AB, ...), so no side
always runs first on a host whose speed drifts. Every step's step_time_s is kept from each run's
--log-json; a side's figure is the median over its runs' steps after --warmup (min and max
beside it). With the budget dispatch each step's budget and rows sent over the dropless
dispatch's (`dispatch_wire`) are kept too, and the side's median of the latter. Writes
DIR/train_rounds.json and prints a markdown table last. Exit status: 0, or 1 when a run failed
or wrote no steps, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_side(spec: str) -> dict:
    """`NAME=FLAGS` or `NAME@TREE=FLAGS` -> {"name", "tree", "flags"}."""
    head, sep, flags = spec.partition("=")
    name, _, tree = head.partition("@")
    if not sep or not name:
        raise ValueError(f"--side {spec!r}: expected NAME=FLAGS or NAME@TREE=FLAGS")
    return {"name": name, "tree": tree or None, "flags": shlex.split(flags)}


def round_order(sides: list, round_index: int) -> list:
    """The sides of round `round_index` (1-based): their order rotated by round_index - 1."""
    shift = (round_index - 1) % len(sides)
    return sides[shift:] + sides[:shift]


def side_figures(runs: list, warmup: int) -> dict:
    """The median, min and max step ms over the runs' steps after the warmup."""
    timed = [ms for run in runs for ms in run["step_ms"][warmup:]]
    if not timed:
        return {"steps_timed": 0}
    wire = [x for run in runs for x in run.get("dispatch_wire", [])[warmup:] if x is not None]
    return {"median_ms": statistics.median(timed), "min_ms": min(timed), "max_ms": max(timed),
            "steps_timed": len(timed),
            **({"median_wire": statistics.median(wire)} if wire else {})}


def run_side(side: dict, round_index: int, command: list, out: Path) -> dict:
    log = out / "logs" / f"{side['name']}_{round_index}.jsonl"
    log.unlink(missing_ok=True)
    argv = command + side["flags"] + ["--log-json", str(log)]
    env, cwd = dict(os.environ), None
    if side["tree"]:
        cwd = str(Path(side["tree"]).resolve())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH")]))
    start = time.time()
    with open(out / "logs" / f"{side['name']}_{round_index}.log", "w") as output:
        rc = subprocess.run(argv, stdout=output, stderr=subprocess.STDOUT, env=env,
                            cwd=cwd).returncode
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {"round": round_index, "rc": rc, "seconds": round(time.time() - start, 1),
            "command": shlex.join(argv), "log": str(log.relative_to(out)),
            "step_ms": [r["step_time_s"] * 1e3 for r in records],
            "loss_hex": [r.get("loss_hex") for r in records],
            "dispatch_budget": [r.get("dispatch_budget") for r in records],
            "dispatch_wire": [r.get("dispatch_wire") for r in records]}


def write_report(out: Path, command: list, rounds: int, warmup: int, sides: list,
                 runs: dict) -> dict:
    """DIR/train_rounds.json of the rounds finished so far."""
    report = {"command": command, "rounds": rounds, "warmup": warmup,
              "sides": {side["name"]: {"tree": side["tree"], "flags": side["flags"],
                                       **side_figures(runs[side["name"]], warmup),
                                       "runs": runs[side["name"]]} for side in sides}}
    (out / "train_rounds.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def markdown(report: dict) -> str:
    first = next(iter(report["sides"].values())).get("median_ms")
    lines = [f"| side | median step ms (steps after {report['warmup']}) | min - max | steps | "
             "/ first side | a2a rows / exact |", "| --- | --- | --- | --- | --- | --- |"]
    for name, side in report["sides"].items():
        if not side.get("steps_timed"):
            lines.append(f"| {name} | - | - | 0 | - | - |")
            continue
        ratio = f"{side['median_ms'] / first:.3f}" if first else "-"
        wire = f"{side['median_wire']:.3f}" if "median_wire" in side else "-"
        lines.append(f"| {name} | {side['median_ms']:.1f} | {side['min_ms']:.1f} - "
                     f"{side['max_ms']:.1f} | {side['steps_timed']} | {ratio} | {wire} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--side", action="append", default=[], metavar="NAME[@TREE]=FLAGS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the figures")
    parser.add_argument("--out", default="runs/train_rounds")
    args = parser.parse_args(own)
    try:
        sides = [parse_side(spec) for spec in args.side]
    except ValueError as error:
        parser.error(str(error))
    names = [side["name"] for side in sides]
    if not command or not sides or len(set(names)) != len(names) or args.rounds < 1:
        parser.error("needs --side (distinct names), --rounds >= 1 and a command after --")
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    runs = {name: [] for name in names}
    for round_index in range(1, args.rounds + 1):
        for position, side in enumerate(round_order(sides, round_index)):
            run = {**run_side(side, round_index, command, out), "position": position}
            runs[side["name"]].append(run)
            print(f"[bench_train_rounds] round {round_index} {side['name']}: rc {run['rc']}, "
                  f"{len(run['step_ms'])} steps, {run['seconds']} s", flush=True)
        # after every round, so a run cut off by a time limit keeps the rounds it finished
        report = write_report(out, command, round_index, args.warmup, sides, runs)
    print(f"\nbench_train_rounds: {args.rounds} rounds, sides in rotated order; "
          f"{shlex.join(command)}\n{markdown(report)}")
    failed = [run for side_runs in runs.values() for run in side_runs
              if run["rc"] != 0 or not run["step_ms"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
