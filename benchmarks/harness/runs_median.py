"""A target row's figure over every run of one measurement: each run's figure from its folder,
then their median and range, the way the reports' target tables read them
(benchmarks/README.md, "How verdicts are read").

    python -m benchmarks.harness.runs_median --figure hand|seq|tune DIR [DIR ...]

Each DIR is one run of `bench_train_rounds` with a `default` side (a `default_path_*` recipe's
folder: `train_rounds.json`, and for `tune` the tuning run's `tune_first.jsonl` and
`tune_first.log` beside it, or in the `raw.tar.xz` of a folder above it: data_archive). A
side's step time is its `median_ms` in the JSON: every step after the warmup of all its rounds,
pooled. The figures:
  hand  the default's step over the fastest other side's (target: <= 1.02)
  seq   the fastest sequential side's step (a name starting with `seq`) over the default's
        (targets: >= 1.10 over NVLink, >= 1.50 with P2P off, >= 1.00 everywhere)
  tune  the tuning run's steps 2 to its last over the default's step, as a share of 1000 such
        steps (target: <= 5%); the steps after the tuner's window count too, since a run that
        tuned may run slower after it, and the line says how much slower they ran (their mean
        over the default's step; the window's end from the log's `tune: steps A-B` line): a
        slowdown that lasts past the run's last step is not in the figure
Prints one line per run, the folder named, and the summary last: runs, median, min - max and
the last folder given (name the runs in date order). Exit status: 0, or 2 when a folder lacks
what its figure needs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from benchmarks.harness.data_archive import read_text

FIGURES = ("hand", "seq", "tune")


def side_steps(rounds: dict) -> dict:
    """Each side with steps: its median step ms (the steps after the warmup, pooled)."""
    return {name: side["median_ms"] for name, side in rounds["sides"].items()
            if side.get("steps_timed")}


def hand_figure(rounds: dict) -> float:
    """The default's step over the fastest other side's."""
    steps = side_steps(rounds)
    return steps["default"] / min(ms for name, ms in steps.items() if name != "default")


def seq_figure(rounds: dict) -> float:
    """The fastest sequential side's step over the default's."""
    steps = side_steps(rounds)
    return min(ms for name, ms in steps.items() if name.startswith("seq")) / steps["default"]


def tune_figure(step_ms: list, default_ms: float) -> float:
    """A tuning run's steps 2 to its last (`step_ms`, step 1 first) over `default_ms` each, as
    a share of 1000 steps at `default_ms`."""
    return (sum(step_ms[1:]) - (len(step_ms) - 1) * default_ms) / (1000 * default_ms)


def after_window(step_ms: list, window_end: int, default_ms: float) -> float:
    """The mean of the steps after the tuner's window (its last step `window_end`, 1-based) over
    `default_ms`; nan where the run ends with the window."""
    after = step_ms[window_end:]
    return statistics.fmean(after) / default_ms if after else float("nan")


def window_end(log: str) -> int:
    """The tuner's last step, from its `tune: steps A-B` line."""
    found = re.search(r"tune: steps \d+-(\d+)", log)
    if found is None:
        raise ValueError("no 'tune: steps A-B' line: the run did not tune")
    return int(found.group(1))


def run_figure(folder: Path, figure: str) -> tuple:
    """(the run's figure, a note for its line)."""
    rounds = json.loads((folder / "train_rounds.json").read_text())
    if figure == "hand":
        return hand_figure(rounds), ""
    if figure == "seq":
        return seq_figure(rounds), ""
    records = [json.loads(line) for line in read_text(folder / "tune_first.jsonl").splitlines()]
    step_ms = [r["step_time_s"] * 1e3 for r in sorted(records, key=lambda r: r["step"])]
    default_ms = side_steps(rounds)["default"]
    end = window_end(read_text(folder / "tune_first.log"))
    return tune_figure(step_ms, default_ms), (
        f"(window ends at step {end} of {len(step_ms)}; the steps after it "
        f"{after_window(step_ms, end, default_ms):.3f}x the default's)")


def summary(values: list) -> dict:
    return {"runs": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--figure", choices=FIGURES, required=True)
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    values = []
    for folder in args.folders:
        try:
            value, note = run_figure(folder, args.figure)
        except (OSError, KeyError, ValueError) as error:
            print(f"runs_median: {folder}: no {args.figure} figure: {type(error).__name__}: "
                  f"{error}", file=sys.stderr)
            return 2
        values.append(value)
        print(f"{args.figure} {value:.4f}  {folder} {note}".rstrip())
    s = summary(values)
    print(f"{args.figure}: {s['runs']} run(s), median {s['median']:.4f}, "
          f"{s['min']:.4f} - {s['max']:.4f}, latest {args.folders[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
