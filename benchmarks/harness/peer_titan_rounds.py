"""epoverlap beside torchtitan (commit d84e83dc4, eager and compiled) on one GPU at one peer
shape, in interleaved rounds, every step kept.

    python -m benchmarks.harness.peer_titan_rounds --shape qwen3|mixtral|dsv3 [--rounds 3] \
        [--steps 30] [--warmup 10] [--out DIR] [--once titan_eager] [--skip titan_eager]

Each round runs three commands, one after the other, in an order rotated by one each round (no
side always first on a machine whose speed drifts), each a fresh process of `--steps` steps:
  epoverlap          torchrun --standalone --nproc-per-node 1 -m epoverlap.train --preset PRESET
                     --micro-batch-size 1 --num-microbatches 2 --moe-router-force-load-balancing
                     --train-iters N --log-json ...: its default path, 8192 tokens a step
  titan_eager        torchtitan's own training command (peer_titan_1gpu), the same model read
  titan_compiled     from the same preset, local batch 2 (8192 tokens a step); compiled: its
                     --compile.enable
`--once SIDE,...` runs those sides in the first round only (a mode already shown slower, to
spend the device time on the sides compared); `--skip SIDE,...` runs them not at all (their
best-mode status cited from an earlier run of the same build). A system's figure is the median tokens/s over every step after `--warmup` of all its rounds
(min and max beside it); its MFU is Megatron-LM's FLOPs per token (`megatron_flops_per_token`,
each system at its own vocabulary: epoverlap's NullTokenizer adds a row) x tokens/s over the
H200's dense bf16 peak, 989 TFLOP/s; its memory the largest peak the allocator reserved.
Ratios: epoverlap's tokens/s over each torchtitan mode's and over its best.

Writes DIR/peer_titan.json (every run: command, exit status, seconds, every step's sample;
the figures), rewritten after each run so a time limit keeps what finished, and DIR/summary.md
(the table, also printed last); each run's log under DIR/logs/. Exit status: 0, or 1 when a run
failed or logged no step.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness.bench_train_rounds import round_order
from benchmarks.harness.peer_titan_1gpu import (PEER_FLAGS, SHAPES, epoverlap_config,
                                                run_logged, run_titan)

PEAK_TFLOPS = 989.0  # H200 (and H100 SXM) dense bf16, the MFU denominator
SIDES = ("epoverlap", "titan_eager", "titan_compiled")


def epoverlap_command(preset: str, steps: int, log_json: Path) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "1", "-m", "epoverlap.train", "--preset", preset, *PEER_FLAGS, "--train-iters",
            str(steps), "--log-json", str(log_json)]


def run_epoverlap(shape: str, steps: int, logs: Path, name: str, timeout_s: float) -> dict:
    log_json = logs / f"{name}.jsonl"
    log_json.unlink(missing_ok=True)
    command = epoverlap_command(SHAPES[shape].preset, steps, log_json)
    start = time.time()
    rc = run_logged(command, {}, logs / f"{name}.log", timeout_s)
    records = [json.loads(line) for line in log_json.read_text().splitlines()] \
        if log_json.exists() else []
    samples = [{"step": r["step"], "loss": r["loss"], "tokens_per_s": r["tokens_per_s"],
                "step_ms": 1e3 * r["step_time_s"], "peak_reserved_gib": r.get("peak_reserved_gib"),
                "peak_allocated_gib": r.get("peak_mem_gib"), "own_mfu": r.get("mfu")}
               for r in records]
    return {"system": "epoverlap", "rc": rc, "seconds": round(time.time() - start, 1),
            "command": shlex.join(command), "log": f"logs/{name}.log", "steps": samples}


def run_side(side: str, shape: str, steps: int, logs: Path, round_index: int,
             timeout_s: float) -> dict:
    name = f"{side}_{round_index}"
    if side == "epoverlap":
        run = run_epoverlap(shape, steps, logs, name, timeout_s)
    else:
        run = run_titan(shape, side.removeprefix("titan_"), steps, logs / f"{name}.json",
                        timeout_s=timeout_s)
    return {**run, "round": round_index}


def flops_per_token(shape: str) -> dict:
    """Megatron-LM's FLOPs per token of each system's model of `shape`."""
    from epoverlap.model.flops import megatron_flops_per_token
    cfg = epoverlap_config(SHAPES[shape].preset)
    vocab = cfg.data.vocab_size
    titan = megatron_flops_per_token(cfg.with_vocab_size(vocab).model, cfg.moe)
    return {"epoverlap": megatron_flops_per_token(cfg.with_vocab_size(vocab + 1).model, cfg.moe),
            "titan_eager": titan, "titan_compiled": titan}


def side_figures(runs: list, warmup: int, flops: float) -> dict:
    """Median (min, max) tokens/s and step ms over the steps after `warmup`, MFU, peak."""
    timed = [s for run in runs for s in run["steps"] if s["step"] > warmup]
    if not timed:
        return {"steps_timed": 0}
    tps = statistics.median(s["tokens_per_s"] for s in timed)
    reserved = [s["peak_reserved_gib"] for run in runs for s in run["steps"]
                if s.get("peak_reserved_gib") is not None]
    return {"steps_timed": len(timed), "tokens_per_s": tps,
            "tokens_per_s_min": min(s["tokens_per_s"] for s in timed),
            "tokens_per_s_max": max(s["tokens_per_s"] for s in timed),
            "step_ms": statistics.median(s["step_ms"] for s in timed),
            "megatron_tflops": flops * tps / 1e12, "mfu": flops * tps / 1e12 / PEAK_TFLOPS,
            "peak_reserved_gib": max(reserved) if reserved else None}


def figures(runs: dict, warmup: int, flops: dict) -> dict:
    sides = {side: side_figures(runs[side], warmup, flops[side]) for side in runs}
    ours = sides["epoverlap"].get("tokens_per_s")
    titan = {side: sides[side].get("tokens_per_s") for side in SIDES[1:]}
    best = max((tps for tps in titan.values() if tps), default=None)
    ratios = {f"epoverlap_over_{side}": ours / tps for side, tps in titan.items()
              if ours and tps}
    if ours and best:
        ratios["epoverlap_over_titan_best"] = ours / best
    return {"sides": sides, "ratios": ratios}


def markdown(report: dict) -> str:
    lines = [f"{report['shape']} (`--preset {report['preset']}`), {report['rounds']} rounds, "
             f"steps after {report['warmup']}:", "",
             "| system | tokens/s (median) | min - max | step ms | MFU (Megatron, 989) | "
             "peak reserved GiB | steps |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for side, f in report["figures"]["sides"].items():
        if not f.get("steps_timed"):
            lines.append(f"| {side} | - | - | - | - | - | 0 |")
            continue
        peak = f"{f['peak_reserved_gib']:.1f}" if f["peak_reserved_gib"] is not None else "-"
        lines.append(f"| {side} | {f['tokens_per_s']:,.0f} | {f['tokens_per_s_min']:,.0f} - "
                     f"{f['tokens_per_s_max']:,.0f} | {f['step_ms']:.1f} | {f['mfu']:.1%} | "
                     f"{peak} | {f['steps_timed']} |")
    ratios = report["figures"]["ratios"]
    lines += ["", "ratios: " + (", ".join(f"{name} {value:.2f}x" for name, value in
                                          ratios.items()) or "-")]
    return "\n".join(lines)


def write_report(out: Path, shape: str, args, runs: dict, flops: dict) -> dict:
    report = {"shape": shape, "preset": SHAPES[shape].preset, "rounds": args.rounds,
              "steps": args.steps, "warmup": args.warmup, "peak_tflops": PEAK_TFLOPS,
              "megatron_flops_per_token": flops, "figures": figures(runs, args.warmup, flops),
              "runs": runs}
    (out / "peer_titan.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(report) + "\n")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the figures")
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("runs/peer_titan"))
    parser.add_argument("--once", default="", help="sides run in the first round only, "
                        f"comma-separated, of {','.join(SIDES)} (a mode shown slower there)")
    parser.add_argument("--skip", default="", help="sides not run, comma-separated")
    args = parser.parse_args(argv)
    once = {side for side in args.once.split(",") if side}
    skip = {side for side in args.skip.split(",") if side}
    if once - set(SIDES) or skip - set(SIDES[1:]):
        parser.error(f"--once {args.once} / --skip {args.skip}: each of {','.join(SIDES)} "
                     "(epoverlap never skipped)")
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    flops = flops_per_token(args.shape)
    runs = {side: [] for side in SIDES}
    for round_index in range(1, args.rounds + 1):
        for side in round_order(list(SIDES), round_index):
            if side in skip or (side in once and round_index > 1):
                continue
            run = run_side(side, args.shape, args.steps, out / "logs", round_index,
                           args.run_timeout)
            runs[side].append(run)
            print(f"[peer_titan_rounds] round {round_index} {side}: rc {run['rc']}, "
                  f"{len(run['steps'])} steps, {run['seconds']} s", flush=True)
            report = write_report(out, args.shape, args, runs, flops)
    print("\n" + markdown(report))
    failed = [run for side_runs in runs.values() for run in side_runs
              if run["rc"] != 0 or not run["steps"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
