"""How far runs' losses are from a reference run's, step by step: for runs that do the same
math in another order (context parallelism against CP 1, where the bits differ), where
`epoverlap-compare-losses` asks for the same bits.

    python -m benchmarks.harness.loss_gap REF.jsonl RUN.jsonl [RUN.jsonl ...] [--rtol R]
        [--out FILE.json]

Each RUN's relative gap |loss - ref| / |ref| at every step both logs hold (the training
command's --log-json files); prints one line per run (steps compared, the largest gap and its
step, the first step's gap) and writes them, with every step's gap, to --out. Exit status 0
every run within --rtol, 1 a run past it or sharing no step with the reference, 2 an
unreadable log (one line naming it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from epoverlap.cli.compare_losses import LossLogError, read_loss_log


def gaps(reference: dict[int, float], run: dict[int, float]) -> dict[int, float]:
    """{step: |run - reference| / |reference|} over the steps both hold."""
    return {step: abs(run[step] - reference[step]) / abs(reference[step])
            for step in sorted(set(reference) & set(run))}


def run_row(name: str, step_gaps: dict[int, float], rtol: float) -> dict:
    if not step_gaps:
        return {"run": name, "steps": 0, "within": False, "gaps": {}}
    worst = max(step_gaps, key=step_gaps.get)
    first = min(step_gaps)
    return {"run": name, "steps": len(step_gaps), "max_gap": step_gaps[worst],
            "max_gap_step": worst, "first_step_gap": step_gaps[first],
            "within": step_gaps[worst] <= rtol, "gaps": step_gaps}


def describe(row: dict) -> str:
    if not row["steps"]:
        return f"{row['run']}: no step in common with the reference"
    return (f"{row['run']}: {row['steps']} steps, largest gap {row['max_gap']:.2e} at step "
            f"{row['max_gap_step']}, first step {row['first_step_gap']:.2e}"
            + ("" if row["within"] else "  PAST --rtol"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="loss_gap", description=__doc__.split("\n")[0])
    parser.add_argument("reference")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--rtol", type=float, default=1e-3,
                        help="the largest relative gap allowed (default 1e-3)")
    parser.add_argument("--out", type=Path, help="write every run's gaps here (JSON)")
    args = parser.parse_args(argv)
    try:
        reference = read_loss_log(args.reference)
        rows = [run_row(path, gaps(reference, read_loss_log(path)), args.rtol)
                for path in args.runs]
    except LossLogError as error:
        print(f"loss_gap: error: {error}", file=sys.stderr)
        return 2
    print(f"loss gaps against {args.reference} (--rtol {args.rtol:g})")
    for row in rows:
        print("  " + describe(row))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"reference": args.reference, "rtol": args.rtol,
                                        "runs": rows}, indent=1) + "\n", encoding="utf-8")
    return 0 if all(row["within"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
