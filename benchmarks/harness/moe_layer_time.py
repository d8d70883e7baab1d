"""One MoE layer's forward and backward wall time, from profiled runs of one training command.

    python -m benchmarks.harness.moe_layer_time NAME=DIR [NAME=DIR ...] [--out F.json]

Each DIR is a span directory (`--profile-steps A:B --profile-dir DIR`); a NAME given more than
once pools its runs (interleaved rounds of one side). A MoE layer's part of a
microbatch's forward (or backward) is its dispatch, expert and combine nodes, those in waves
(`dispatch_w1`, `mlp_w1`, `return_w1`, ...) included, on either lane: from the first of them
to start to the last to end. Per (step, microbatch, layer) the forward and backward walls
are summed, the slowest rank's sum taken, and the median over them reported, with each run's
speedup over the first NAME (give the unsplit sequential run first: the overlap in waves'
issue asks the layer's forward + backward against it, with the comm lane busy and nothing else
beside it).

Only layers with a dispatch node count (a dense layer's `mlp` is not a MoE layer). The wall
includes waits between the layer's nodes, so with the combined 1F1B (another microbatch's
nodes interleaved) it is not the layer's own cost: compare sequential runs.

Beside the walls, each part's busy time per lane (its spans' durations summed: the all-to-alls
on the comm lane, the experts on the compute lane) and its overlap bound, per phase the larger
of the two lanes, summed: the wall a perfect overlap inside the layer would leave at those lane
times. In the unsplit sequential run the lanes take turns, so the first run's bound is the
attainable wall, and each run's share is (first wall - run wall) / (first wall - first bound),
the realized share of the attainable saving. A run in waves' own busy times show how its lanes
slow beside each other. Prints a markdown table; --out writes every run's figures and samples
as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from typing import Optional, Sequence

from epoverlap.profiling.spans import RankSpans, read_span_directory

MOE_NODES = ("dispatch", "mlp", "return", "combine")  # return: a wave's experts' rows back
PHASES = ("forward", "backward")
LANES = ("comm", "compute")
# per layer part: the walls, forward + backward, each lane's busy time per phase, the bound
SAMPLES = PHASES + ("both",) + tuple(f"{lane}_{phase}" for lane in LANES for phase in PHASES) \
    + ("bound",)
_WAVE = re.compile(r"_w\d+$")  # read_span_directory gives older files' `_cK` as `_wK`


def base_node(node: str) -> str:
    """`dispatch_w2` -> `dispatch`; other names as they are."""
    return _WAVE.sub("", node)


def layer_parts(rank: RankSpans) -> dict:
    """(step, microbatch, layer) -> {phase: wall us, f"{lane}_{phase}": busy us} of every MoE
    layer part on one rank."""
    bounds: dict = defaultdict(lambda: [float("inf"), float("-inf"), False])
    busy: dict = defaultdict(float)
    for step in rank.steps:
        for span in step.spans:
            node = base_node(span.node)
            if span.layer is None or node not in MOE_NODES or span.phase not in PHASES:
                continue
            key = (step.step, span.microbatch, span.layer)
            entry = bounds[key + (span.phase,)]
            entry[0] = min(entry[0], span.start_us)
            entry[1] = max(entry[1], span.end_us)
            entry[2] = entry[2] or node == "dispatch"
            busy[key + (f"{span.lane}_{span.phase}",)] += span.end_us - span.start_us
    parts: dict = defaultdict(dict)
    for (step, microbatch, layer, phase), (start, end, moe) in bounds.items():
        if moe:
            part = parts[(step, microbatch, layer)]
            part[phase] = end - start
            for lane in LANES:
                part[f"{lane}_{phase}"] = busy.get((step, microbatch, layer,
                                                    f"{lane}_{phase}"), 0.0)
    return parts


def run_samples(ranks: Sequence[RankSpans]) -> dict:
    """Every SAMPLES figure (ms) of one run's MoE layer parts, each (step, microbatch, layer)
    at its slowest rank."""
    per_rank = [layer_parts(rank) for rank in ranks]
    samples = {name: [] for name in SAMPLES}
    for key in sorted(set().union(*per_rank)):
        parts = [found[key] for found in per_rank if key in found]
        slowest = max(parts, key=lambda p: sum(p.get(phase, 0.0) for phase in PHASES))
        for phase in PHASES:
            samples[phase].append(slowest.get(phase, 0.0) / 1e3)
            for lane in LANES:
                samples[f"{lane}_{phase}"].append(slowest.get(f"{lane}_{phase}", 0.0) / 1e3)
        samples["both"].append(sum(slowest.get(phase, 0.0) for phase in PHASES) / 1e3)
        samples["bound"].append(sum(max(slowest.get(f"{lane}_{phase}", 0.0) for lane in LANES)
                                    for phase in PHASES) / 1e3)
    return samples


def run_figures(runs: Sequence[Sequence[RankSpans]]) -> dict:
    """The medians of the layer parts of `runs` (one or more runs of one side, pooled), the
    samples kept: `{name}_ms` for each of SAMPLES (`both_ms`: forward + backward)."""
    samples = {name: [] for name in SAMPLES}
    for ranks in runs:
        for name, values in run_samples(ranks).items():
            samples[name] += values
    if not samples["both"]:
        raise ValueError("no MoE layer part (dispatch, expert, combine nodes) in the spans")
    figures = {f"{name}_ms": statistics.median(values) for name, values in samples.items()}
    return dict(figures, parts=len(samples["both"]), runs=len(runs), samples_ms=samples)


def attainable_share(first: dict, run: dict) -> Optional[float]:
    """(first wall - run wall) / (first wall - first bound); None where the first run leaves
    nothing to save (its lanes never both busy in a phase)."""
    room = first["both_ms"] - first["bound_ms"]
    return (first["both_ms"] - run["both_ms"]) / room if room > 0 else None


def table(figures: dict) -> list[str]:
    first = next(iter(figures.values()))
    lines = ["| run | forward ms | backward ms | forward + backward ms | comm busy ms | compute "
             "busy ms | overlap bound ms | layer parts | first / run | share of attainable |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, f in figures.items():
        comm = f["comm_forward_ms"] + f["comm_backward_ms"]
        compute = f["compute_forward_ms"] + f["compute_backward_ms"]
        share = attainable_share(first, f)
        lines.append(f"| {name} | {f['forward_ms']:.2f} | {f['backward_ms']:.2f} | "
                     f"{f['both_ms']:.2f} | {comm:.2f} | {compute:.2f} | {f['bound_ms']:.2f} | "
                     f"{f['parts']} | {first['both_ms'] / f['both_ms']:.3f} | "
                     f"{'-' if share is None else f'{share:.2f}'} |")
    return lines


def _named(text: str) -> tuple[str, str]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR")
    return name, directory


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=_named, metavar="NAME=DIR")
    parser.add_argument("--out", help="write the figures and samples as JSON")
    args = parser.parse_args(argv)
    directories: dict = {}  # name -> its directories, in the order given
    for name, directory in args.runs:
        directories.setdefault(name, []).append(directory)
    try:
        figures = {name: run_figures([read_span_directory(d) for d in found])
                   for name, found in directories.items()}
    except ValueError as error:  # SpanFileError included: one line, the file named
        print(f"moe_layer_time: {error}", file=sys.stderr)
        return 2
    print("\n".join(table(figures)))
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"runs": {name: dict(run, directories=directories[name])
                                for name, run in figures.items()}}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
