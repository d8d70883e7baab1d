"""Per-step times of --log-json runs: stalls after warmup, and a PNG of every step.

    python -m benchmarks.harness.plot_steps RUN.jsonl [RUN2.jsonl ...] [--warmup 3] [--png FILE.png]

For each log: the median step time after the warmup steps, the slowest step after them and
its ratio to the median (a ratio above 1.5 is a stall: a compile, an allocator flush, a host
hiccup), the load imbalance at the last step and averaged over the last 20, and the loss at the
end. With --png, one line per run of step time against step. Exit status 1 when any run has a
step after warmup above 1.5x its median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

STALL_RATIO = 1.5


def summarize(path: Path, warmup: int) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times_ms = [r["step_time_s"] * 1e3 for r in records]
    after = times_ms[warmup:] or times_ms
    median = statistics.median(after)
    slowest = max(range(len(after)), key=after.__getitem__)
    tail = records[-20:]
    return {"run": path.stem, "steps": len(records), "median_ms": median,
            "max_ms": after[slowest], "max_step": records[warmup + slowest]["step"]
            if len(times_ms) > warmup else records[slowest]["step"],
            "max_over_median": after[slowest] / median, "times_ms": times_ms,
            "imbalance_last": records[-1].get("load_imbalance"),
            "imbalance_last20": statistics.mean(r.get("load_imbalance", 0) for r in tail),
            "loss_last": records[-1]["loss"]}


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(10, 4))
    for row in rows:
        axes.plot(range(1, len(row["times_ms"]) + 1), row["times_ms"], label=row["run"],
                  linewidth=0.8)
    axes.set_xlabel("step")
    axes.set_ylabel("step time (ms)")
    axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(png, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.logs if not p.is_file()]
    if missing:
        print(f"plot_steps: no such log: {', '.join(missing)}")
        return 2
    rows = [summarize(path, args.warmup) for path in args.logs]
    print("| run | steps | median ms | slowest after warmup ms (step) | slowest / median | "
          "imbalance last / mean of last 20 | loss last |\n" + "| --- " * 7 + "|")
    for r in rows:
        print(f"| {r['run']} | {r['steps']} | {r['median_ms']:.1f} | {r['max_ms']:.1f} "
              f"({r['max_step']}) | {r['max_over_median']:.2f} | {r['imbalance_last']:.2f} / "
              f"{r['imbalance_last20']:.2f} | {r['loss_last']:.3f} |")
    if args.png:
        plot(rows, args.png)
    return 1 if any(r["max_over_median"] > STALL_RATIO for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
