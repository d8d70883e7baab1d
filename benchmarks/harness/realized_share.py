"""The overlap's realized share of the attainable saving, from three profiled runs of one
training command: sequential, overlapped, and compute alone (`train_bench --comm-mode local_copy`).

    python -m benchmarks.harness.realized_share --seq DIR --ovl DIR --comp DIR [--out F.json]

Each DIR is a span directory (`--profile-steps A:B --profile-dir DIR`). Per run and recorded
step the slowest rank's time is taken, then the mean over the steps. Two windows:

  forward-backward  the executor's plan (`step_time_us`): T_seq, T_ovl from the two runs;
                    T_comm = the sequential run's comm lane (`comm_us`: the all-to-alls one
                    after the other, nothing beside them); T_comp = the compute run's step.
  whole step        through the optimizer (span format 3, `whole_step_us`): the same with the
                    gradients' all-reduce over data-parallel replicas counted as comm
                    (`whole_comm_us`), and T_comp = the compute run's whole step less its own
                    gradient all-reduce (the step with no communication at all).

share = (T_seq - T_ovl) / (T_seq - max(T_comp, T_comm)). Prints a markdown table; --out writes
the figures and every step's samples as JSON.

--comp must be an unheld local-copy run: a held one (`--local-copy-hold-us`, the simulator's
compute input; its span files say `local_copy_hold_us`) lasts its holds too, so its step is
not the compute alone; it is refused, one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Optional, Sequence

from epoverlap.profiling.spans import read_span_directory
from epoverlap.profiling.summary import span_summary


def _rows(directory: str, compute_alone: bool = False) -> list[list[dict]]:
    """Per recorded step, every rank's summary row (timeline figures); `compute_alone`: the
    run's step is taken for T_comp, so it must hold no comm lane (module docstring)."""
    ranks = read_span_directory(directory)
    hold = ranks[0].local_copy_hold_us
    if compute_alone and hold:
        raise ValueError(f"--comp {directory}: a held local-copy run (--local-copy-hold-us "
                         f"{hold:g}): its step holds the comm lane, not the compute alone; "
                         "give a local-copy run without the hold")
    steps = [step.step for step in ranks[0].steps]
    return [step["ranks"] for step in span_summary(ranks, steps)["steps"]]


def _slowest(rows: list[list[dict]], key: str, less: Optional[str] = None) -> list[float]:
    """Per step, the largest `key` (minus `less`) over ranks, in ms."""
    return [max(r[key] - (r.get(less, 0.0) if less else 0.0) for r in ranks) / 1e3
            for ranks in rows]


def share(t_seq: float, t_ovl: float, t_comp: float, t_comm: float) -> Optional[float]:
    """The realized share of the attainable saving (None when nothing is attainable)."""
    attainable = t_seq - max(t_comp, t_comm)
    return (t_seq - t_ovl) / attainable if attainable > 0 else None


def window(seq, ovl, comp, whole: bool) -> dict:
    """T_seq, T_ovl, T_comp, T_comm and the share in one window, with their samples."""
    step, comm = ("whole_step_us", "whole_comm_us") if whole else ("step_time_us", "comm_us")
    samples = {"T_seq": _slowest(seq, step), "T_ovl": _slowest(ovl, step),
               "T_comp": _slowest(comp, step, "grad_reduce_us" if whole else None),
               "T_comm": _slowest(seq, comm)}
    figures = {name: statistics.fmean(values) for name, values in samples.items()}
    return {**figures, "share": share(figures["T_seq"], figures["T_ovl"], figures["T_comp"],
                                      figures["T_comm"]), "samples_ms": samples}


def report(dirs: dict) -> dict:
    runs = {name: _rows(directory, name == "comp") for name, directory in dirs.items()}
    out = {"dirs": dirs, "forward_backward": window(runs["seq"], runs["ovl"], runs["comp"], False)}
    if all("whole_step_us" in runs[name][0][0] for name in runs):
        out["whole_step"] = window(runs["seq"], runs["ovl"], runs["comp"], True)
    return out


def markdown(result: dict) -> str:
    lines = ["| window | T_seq ms | T_ovl | T_comp | T_comm | realized share |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in ("forward_backward", "whole_step"):
        if name in result:
            w = result[name]
            share_text = "-" if w["share"] is None else f"{w['share']:.2f}"
            lines.append(f"| {name.replace('_', ' ')} | {w['T_seq']:.1f} | {w['T_ovl']:.1f} | "
                         f"{w['T_comp']:.1f} | {w['T_comm']:.1f} | {share_text} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="realized_share", description=__doc__.split("\n")[0])
    for name in ("seq", "ovl", "comp"):
        parser.add_argument(f"--{name}", required=True, metavar="DIR")
    parser.add_argument("--out", metavar="FILE")
    args = parser.parse_args(argv)
    try:
        result = report({"seq": args.seq, "ovl": args.ovl, "comp": args.comp})
    except ValueError as error:  # SpanFileError names the file
        print(f"realized_share: {error}", file=sys.stderr)
        return 2
    print(markdown(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
