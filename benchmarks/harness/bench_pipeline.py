"""Pipeline benchmark: bubble fraction measured against the analytic one, and step time with the
overlap on and off.

    python -m benchmarks.harness.bench_pipeline [--gpus 2] [--preset small] [--num-layers 8] [--iters 12]
        [--microbatches 2,4,8] [--virtual 1,2] [--out-dir DIR] [-- extra training flags]

For every microbatch count M and virtual-stage count V it runs the training command
(`torchrun -m epoverlap.train`, bf16 on GPUs, gloo on CPUs, eager: --cuda-graph-impl none)
with --pipeline-model-parallel-size equal to the rank count, once plain 1F1B
(--no-overlap-moe-expert-parallel-comm) and once with --overlap-moe-expert-parallel-comm,
records spans of the last third of the steps and reports per run: the median step time, tokens
per second, and the bubble fraction (the timeline tool's `bubble_fraction`: the share of the
step its compute lane is idle, mean over ranks and profiled steps) beside the analytic
(P - 1) / (V x M + P - 1) of a pipeline whose forward and backward chunks take equal time on
every stage. A last run is the same world with no pipeline and EP over all ranks
(--expert-model-parallel-size = ranks, PP=1, overlap on): the comparison the issue asks for on
2 GPUs (PP=2 x EP=1 against PP=1 x EP=2; their data-parallel sizes differ, so compare their
tokens/s, not their losses). Writes bench_pipeline.json and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from epoverlap.profiling.spans import read_span_directory
from epoverlap.cli.timeline import span_summary
from epoverlap.config.resolve import SEQUENTIAL_FLAG

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def analytic_bubble(stages: int, virtual: int, microbatches: int) -> float:
    """Idle share of a stage in (interleaved) 1F1B with equal chunk times:
    (P - 1) / (V M + P - 1); 0 without a pipeline."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def measured_bubble(spans_dir: Path) -> float:
    """Mean over ranks and recorded steps of the timeline's bubble_fraction."""
    ranks = read_span_directory(spans_dir)
    steps = [step.step for step in ranks[0].steps]
    summary = span_summary(ranks, steps)
    rows = [row for step in summary["steps"] for row in step["ranks"]]
    return statistics.mean(row["bubble_fraction"] for row in rows)


def run_one(name: str, nproc: int, flags: list[str], iters: int, out_dir: Path) -> dict:
    log, spans = out_dir / f"{name}.jsonl", out_dir / "spans" / name
    first_profiled = max(2, iters - iters // 3 + 1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "epoverlap.train", *flags, "--train-iters",
           str(iters), "--log-json", str(log), "--log-interval", str(iters),
           "--profile-steps", f"{first_profiled}:{iters}", "--profile-dir", str(spans)]
    print("[bench_pipeline]", " ".join(cmd[2:]), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    (out_dir / f"{name}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        print(result.stderr[-3000:], flush=True)
        return {"name": name, "error": f"exit {result.returncode}"}
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steady = records[len(records) // 3:]
    return {"name": name, "step_ms": statistics.median(r["step_time_s"] for r in steady) * 1e3,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "bubble_measured": measured_bubble(spans), "last_loss": records[-1]["loss"]}


def scenarios(args: argparse.Namespace) -> list[dict]:
    """(name, flags, P, V, M) of every run."""
    base = ["--preset", args.preset, "--num-layers", str(args.num_layers),
            "--cuda-graph-impl", "none"] + \
        (["--bf16"] if args.device == "cuda" else ["--device", "cpu"]) + args.extra
    runs = []
    for virtual in args.virtual:
        for microbatches in args.microbatches:
            for overlap in (False, True):
                flags = base + ["--pipeline-model-parallel-size", str(args.gpus),
                                "--num-microbatches", str(microbatches)]
                flags += ["--num-virtual-stages-per-pipeline-rank", str(virtual)] \
                    if virtual > 1 else []
                flags += ["--overlap-moe-expert-parallel-comm"] if overlap else [SEQUENTIAL_FLAG]
                runs.append({"name": f"pp{args.gpus}_v{virtual}_m{microbatches}_"
                                     f"{'ovl' if overlap else 'off'}", "flags": flags,
                             "stages": args.gpus, "virtual": virtual,
                             "microbatches": microbatches, "overlap": overlap})
    microbatches = max(args.microbatches)
    runs.append({"name": f"ep{args.gpus}_m{microbatches}_ovl", "stages": 1, "virtual": 1,
                 "microbatches": microbatches, "overlap": True,
                 "flags": base + ["--expert-model-parallel-size", str(args.gpus),
                                  "--num-microbatches", str(microbatches),
                                  "--overlap-moe-expert-parallel-comm"]})
    return runs


def markdown(rows: list[dict]) -> str:
    lines = ["| run | P | V | M | overlap | step ms | tokens/s | bubble measured | "
             "bubble analytic |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} |||||||")
            continue
        lines.append(f"| {r['name']} | {r['stages']} | {r['virtual']} | {r['microbatches']} | "
                     f"{'on' if r['overlap'] else 'off'} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['bubble_measured']:.3f} | "
                     f"{r['bubble_analytic']:.3f} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="ranks (= pipeline stages)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--virtual", default="1,2")
    parser.add_argument("--out-dir", default="runs/bench_pipeline")
    parser.add_argument("extra", nargs="*", help="after --: flags for every training run")
    args = parser.parse_args(argv)
    args.microbatches = [int(x) for x in args.microbatches.split(",")]
    args.virtual = [int(x) for x in args.virtual.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in scenarios(args):
        row = run_one(run["name"], args.gpus, run["flags"], args.iters, out_dir)
        row.update({k: run[k] for k in ("stages", "virtual", "microbatches", "overlap")})
        row["bubble_analytic"] = analytic_bubble(run["stages"], run["virtual"],
                                                 run["microbatches"])
        rows.append(row)
    (out_dir / "bench_pipeline.json").write_text(json.dumps(
        {"gpus": args.gpus, "preset": args.preset, "num_layers": args.num_layers,
         "rows": rows}, indent=1) + "\n")
    print(markdown(rows))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
