"""bench_peer's report: the figures derived from the runs (overlap gains, fastest modes, ours
over each peer's fastest mode), the markdown tables printed last, one run's log line and the
JSON file."""

from __future__ import annotations

import json
import math
from pathlib import Path

PEERS = ("megatron", "torchtitan")  # the systems ours is rated against


def derived(runs: dict) -> dict:
    """Per system its overlap gain (T_seq / T_ovl) and fastest mode, ours also with the extra
    flags of both schedules where given (seq_flags / ovl_flags); our modes' tokens/s/GPU over
    each peer's (Megatron-core's, torchtitan's) fastest mode's."""
    out = {}
    done = {system: {mode: r for mode, r in modes.items() if "step_ms" in r}
            for system, modes in runs.items()}
    for system, modes in done.items():
        if "seq" in modes and "ovl" in modes:
            out[f"overlap_gain_{system}"] = modes["seq"]["step_ms"] / modes["ovl"]["step_ms"]
        if "seq_flags" in modes and "ovl_flags" in modes:
            out[f"overlap_gain_{system}_flags"] = (modes["seq_flags"]["step_ms"]
                                                   / modes["ovl_flags"]["step_ms"])
        if modes:
            out[f"best_mode_{system}"] = min(modes, key=lambda mode: modes[mode]["step_ms"])
    for peer in PEERS:
        if f"best_mode_{peer}" in out:
            best = done[peer][out[f"best_mode_{peer}"]]["tokens_per_s_per_gpu"]
            for mode, r in done.get("epoverlap", {}).items():
                out[f"epoverlap_{mode}_over_{peer}_best"] = r["tokens_per_s_per_gpu"] / best
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
    lines = ["| shape | system | mode | step ms | tok/s/GPU | TFLOP/s/GPU | peak GiB | "
             "loss first | loss last |", "| --- " * 9 + "|"]
    for r in results:
        for system, modes in r["runs"].items():
            for mode, run in modes.items():
                if "skipped" in run:
                    lines.append(f"| {r['shape']} | {system} | {mode} | not run (see above) "
                                 "| - | - | - | - | - |")
                    continue
                lines.append(" | ".join([
                    f"| {r['shape']}", system, mode, _f(run["step_ms"], 1),
                    f"{run['tokens_per_s_per_gpu'] / 1e3:.1f}k", _f(run["tflops_per_gpu"], 1),
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
                    _f(r["runs"]["epoverlap"]["seq"]["step_ms"]
                       / r["runs"]["epoverlap"]["ovl_flags"]["step_ms"]),
                    _f(r["derived"].get("epoverlap_seq_flags_over_megatron_best")),
                    _f(r["derived"].get("overlap_gain_epoverlap_flags"))]
                   for r in results
                   if "epoverlap_ovl_flags_over_megatron_best" in r["derived"]])


def _torchtitan_table(results: list[dict]) -> list[str]:
    return _table(["shape", "torchtitan best mode", "its step ms",
                   "ours seq / torchtitan best", "ours ovl / torchtitan best"],
                  [[r["shape"], r["derived"]["best_mode_torchtitan"],
                    _f(r["runs"]["torchtitan"][r["derived"]["best_mode_torchtitan"]]
                       ["step_ms"], 1),
                    _f(r["derived"].get("epoverlap_seq_over_torchtitan_best")),
                    _f(r["derived"].get("epoverlap_ovl_over_torchtitan_best"))]
                   for r in results if "best_mode_torchtitan" in r["derived"]])


def run_line(run: dict) -> str:
    if "skipped" in run:
        return f"not run: {run['skipped']}"
    return (f"step {run['step_ms']:.1f} ms, {run['tokens_per_s_per_gpu'] / 1e3:.1f}k tok/s/GPU, "
            f"loss {run['loss_first']:.3f} -> {run['loss_last']:.3f}")


def write_report(report: dict, out_dir: str) -> Path:
    path = Path(out_dir) / "bench_peer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path
