"""The per-step wire rows over the exact rows (`dispatch_wire`) of every run here, summarized:
python summarize.py [DIR ...] -> a markdown table (median, min, max over all steps; the steps
whose wire rows equal the budget; reruns; the fitted budget at the end; distinct values; the
median of the step line's expert load imbalance, max/mean tokens per expert)."""

import glob
import json
import statistics
import sys


def row(path: str) -> str:
    records = [json.loads(line) for line in open(path)]
    wire = [r["dispatch_wire"] for r in records]
    at_budget = sum(r["dispatch_wire"] == r["dispatch_budget"] for r in records)
    reruns = sum(r["dispatch_reruns"] for r in records)
    imbalance = statistics.median(r["load_imbalance"] for r in records)
    return (f"| {path.removesuffix('.jsonl')} | {len(wire)} | {statistics.median(wire):.3f} | "
            f"{min(wire):.3f} | {max(wire):.3f} | {at_budget} | {reruns} | "
            f"{records[-1]['dispatch_budget']:.4f} | {len(set(wire))} | {imbalance:.2f} |")


if __name__ == "__main__":
    print("| run | steps | median | min | max | steps wire == budget | reruns | "
          "budget at the end | distinct values | imbalance (median) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for folder in sys.argv[1:] or ["."]:
        for path in sorted(glob.glob(f"{folder}/*.jsonl")):
            print(row(path))
