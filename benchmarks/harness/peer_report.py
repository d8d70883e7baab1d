"""bench_peer's report: the figures derived from the runs (overlap gains, fastest modes, ours
over each peer's fastest mode), the markdown tables printed last, one run's log line and the
JSON file. Every step time here is the median of the run's per-step samples
(`step_ms_samples`, the slowest rank's time of each timed step), recomputed from them, so a
table's figure can be checked against the JSON's samples; tokens/s/GPU scales with it."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

PEERS = ("megatron", "torchtitan")  # the systems ours is rated against


def step_ms(run: dict) -> float:
    """The run's step time: the median of its per-step samples."""
    return statistics.median(run["step_ms_samples"])


def tokens_per_s(run: dict) -> float:
    """tokens/s/GPU at the samples' median step (the run's own figure scaled to it)."""
    return run["tokens_per_s_per_gpu"] * run["step_ms"] / step_ms(run)


def derived(runs: dict) -> dict:
    """Per system its overlap gain (T_seq / T_ovl) and fastest mode, ours also with the extra
    flags of both schedules where given (seq_flags / ovl_flags); our modes' tokens/s/GPU over
    each peer's (Megatron-core's, torchtitan's) fastest mode's."""
    out = {}
    done = {system: {mode: r for mode, r in modes.items() if "step_ms_samples" in r}
            for system, modes in runs.items()}
    for system, modes in done.items():
        if "seq" in modes and "ovl" in modes:
            out[f"overlap_gain_{system}"] = step_ms(modes["seq"]) / step_ms(modes["ovl"])
        if "seq_flags" in modes and "ovl_flags" in modes:
            out[f"overlap_gain_{system}_flags"] = (step_ms(modes["seq_flags"])
                                                   / step_ms(modes["ovl_flags"]))
        if modes:
            out[f"best_mode_{system}"] = min(modes, key=lambda mode: step_ms(modes[mode]))
    for peer in PEERS:
        if f"best_mode_{peer}" in out:
            best = tokens_per_s(done[peer][out[f"best_mode_{peer}"]])
            for mode, r in done.get("epoverlap", {}).items():
                out[f"epoverlap_{mode}_over_{peer}_best"] = tokens_per_s(r) / best
    return out


def _f(value, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.{digits}f}"


def markdown(results: list[dict]) -> str:
    """Every run, then per shape the comparison figures against Megatron-core, with ours
    flags where given, and against torchtitan where it ran."""
    tables = [_runs_table(results), _megatron_table(results), _flags_table(results),
              _torchtitan_table(results)]
    return "\n\n".join("\n".join(table) for table in tables if table)


def _runs_table(results: list[dict]) -> list[str]:
    lines = ["| shape | system | mode | step ms (median) | min - max (steps) | tok/s/GPU | "
             "TFLOP/s/GPU | peak GiB | loss first | loss last |", "| --- " * 10 + "|"]
    for r in results:
        for system, modes in r["runs"].items():
            for mode, run in modes.items():
                if "skipped" in run:
                    lines.append(f"| {r['shape']} | {system} | {mode} | not run (see above) "
                                 "| - | - | - | - | - | - |")
                    continue
                samples, scale = run["step_ms_samples"], run["step_ms"] / step_ms(run)
                lines.append(" | ".join([
                    f"| {r['shape']}", system, mode, _f(step_ms(run), 1),
                    f"{min(samples):.1f} - {max(samples):.1f} ({len(samples)})",
                    f"{tokens_per_s(run) / 1e3:.1f}k", _f(run["tflops_per_gpu"] * scale, 1),
                    _f(run["peak_gib"]), _f(run["loss_first"], 3),
                    _f(run["loss_last"], 3)]) + " |")
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table; none where there are no rows."""
    if not rows:
        return []
    return ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|"] + [
        "| " + " | ".join(row) + " |" for row in rows]


def _megatron_table(results: list[dict]) -> list[str]:
    return _table(["shape", "Megatron best mode", "ours seq / Megatron best",
                   "ours ovl / Megatron best", "overlap gain ours (seq/ovl)",
                   "overlap gain Megatron (seq/ovl)"],
                  [[r["shape"], r["derived"].get("best_mode_megatron", "-"),
                    _f(r["derived"].get("epoverlap_seq_over_megatron_best")),
                    _f(r["derived"].get("epoverlap_ovl_over_megatron_best")),
                    _f(r["derived"].get("overlap_gain_epoverlap")),
                    _f(r["derived"].get("overlap_gain_megatron"))] for r in results])


def _flags_table(results: list[dict]) -> list[str]:
    return _table(["shape", "ours ovl with --ours-ovl-flags / Megatron best",
                   "its gain over our seq", "ours seq with --ours-seq-flags / Megatron best",
                   "our overlap gain with the flags (seq_flags / ovl_flags)"],
                  [[r["shape"], _f(r["derived"]["epoverlap_ovl_flags_over_megatron_best"]),
                    _f(step_ms(r["runs"]["epoverlap"]["seq"])
                       / step_ms(r["runs"]["epoverlap"]["ovl_flags"])),
                    _f(r["derived"].get("epoverlap_seq_flags_over_megatron_best")),
                    _f(r["derived"].get("overlap_gain_epoverlap_flags"))]
                   for r in results
                   if "epoverlap_ovl_flags_over_megatron_best" in r["derived"]])


def _torchtitan_table(results: list[dict]) -> list[str]:
    return _table(["shape", "torchtitan best mode", "its step ms",
                   "ours seq / torchtitan best", "ours ovl / torchtitan best"],
                  [[r["shape"], r["derived"]["best_mode_torchtitan"],
                    _f(step_ms(r["runs"]["torchtitan"]
                               [r["derived"]["best_mode_torchtitan"]]), 1),
                    _f(r["derived"].get("epoverlap_seq_over_torchtitan_best")),
                    _f(r["derived"].get("epoverlap_ovl_over_torchtitan_best"))]
                   for r in results if "best_mode_torchtitan" in r["derived"]])


def run_line(run: dict) -> str:
    if "skipped" in run:
        return f"not run: {run['skipped']}"
    return (f"step {step_ms(run):.1f} ms (median of {len(run['step_ms_samples'])}), "
            f"{tokens_per_s(run) / 1e3:.1f}k tok/s/GPU, "
            f"loss {run['loss_first']:.3f} -> {run['loss_last']:.3f}")


def write_report(report: dict, out_dir: str) -> Path:
    path = Path(out_dir) / "bench_peer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path
