"""Where a profiled step's GPU time goes: the kernels of torch.profiler traces by kind and by
name, per rank.

    python -m benchmarks.harness.kernel_table TRACE|DIR [...] [--steps N] [--top N] [--out F]

TRACE files (or directories of them) are the training command's `--use-pytorch-profiler`
traces of its `--profile-steps` (`torch-trace-rank*.json`). Per rank: each kind's kernel time
(`KINDS`, first pattern that matches the kernel's name, case-insensitive; `other` for the
rest), then the `--top` kernel names by time, each with its calls and its share of the rank's
kernel time. Times are per profiled step with `--steps N` (the steps the traces hold), else
totals. A kernel's time is its own duration: kernels on two streams at once both count, so the
shares are of summed kernel time, not of the window. Prints markdown; --out writes the figures
as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from typing import Optional, Sequence

from epoverlap.profiling.summary import InputError
from epoverlap.profiling.torch_trace import Kernel, device_kernels

# kind -> name pattern; the first match names a kernel's kind
KINDS = (
    ("all-to-all and collectives", r"nccl"),
    ("grouped GEMM (experts)", r"group|grouped"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|matmul"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("loss and softmax", r"cross_entropy|softmax|log_softmax|nll"),
    ("reductions", r"reduce"),
    ("elementwise and copies", r"elementwise|vectorized|unrolled|copy|fill|cat|index"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def rank_table(kernels: Sequence[Kernel], steps: int, top: int) -> dict:
    """One rank's kernel time (ms, per step) by kind and its `top` kernel names."""
    by_kind: dict = defaultdict(float)
    by_name: dict = defaultdict(lambda: [0.0, 0])
    for kernel in kernels:
        duration = (kernel.end_us - kernel.start_us) / 1e3 / steps
        by_kind[kind_of(kernel.name)] += duration
        entry = by_name[kernel.name]
        entry[0] += duration
        entry[1] += 1
    total = sum(by_kind.values())
    names = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"kernel_ms": total,
            "kinds": [{"kind": kind, "ms": ms, "share": ms / total}
                      for kind, ms in sorted(by_kind.items(), key=lambda item: -item[1])],
            "top": [{"name": name, "ms": ms, "calls": calls / steps, "share": ms / total,
                     "kind": kind_of(name)} for name, (ms, calls) in names]}


def tables(arguments: Sequence[str], steps: int, top: int) -> list[dict]:
    """One table per (trace file, device) (`device_kernels`)."""
    return [{**where, **rank_table(own, steps, top)}
            for where, own in device_kernels(arguments)]


def markdown(found: Sequence[dict], per_step: bool) -> list[str]:
    unit = "ms per step" if per_step else "ms"
    lines = []
    for table in found:
        lines += [f"rank {table['rank']} ({table['file']}): kernel time {table['kernel_ms']:.1f} "
                  f"{unit}", "", f"| kind | {unit} | share |", "| --- | --- | --- |"]
        lines += [f"| {k['kind']} | {k['ms']:.2f} | {k['share']:.3f} |" for k in table["kinds"]]
        lines += ["", f"| kernel | kind | {unit} | calls | share |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| `{k['name'][:90]}` | {k['kind']} | {k['ms']:.2f} | {k['calls']:.0f} | "
                  f"{k['share']:.3f} |" for k in table["top"]]
        lines.append("")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", metavar="TRACE|DIR")
    parser.add_argument("--steps", type=int, default=1,
                        help="profiled steps the traces hold (times are per step)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", help="write the tables as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        parser.error("--steps and --top take a positive count")
    try:
        found = tables(args.traces, args.steps, args.top)
    except InputError as error:
        print(f"kernel_table: {error}", file=sys.stderr)
        return 2
    print("\n".join(markdown(found, args.steps > 1)))
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"steps": args.steps, "ranks": found}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
