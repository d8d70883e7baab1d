"""Baseline training throughput: the real training job (no overlap) on 1 GPU and on N GPUs.

    python -m benchmarks.harness.bench_train [--gpus 1,2] [--preset small] [--iters 20]
        [--routing learned,balanced] [--out FILE.md]

For each routing and GPU count it runs `torchrun -m epoverlap.train --preset PRESET --bf16`
with EP equal to the GPU count, the sequential schedule and eager steps
(`--no-overlap-moe-expert-parallel-comm --cuda-graph-impl none`: the auto defaults on GPUs
would turn on the overlap and the partial CUDA graphs) on real text (the Python standard
library), reads the --log-json records and reports the median over the steps after the first
quarter: step time, tokens/s (global and per GPU), model TFLOP/s per GPU (matmul + attention
FLOPs, 3x forward), expert load imbalance (max/mean tokens per expert, worst layer) and peak
memory. Routing `learned` is the model's own router; `balanced` adds
--moe-router-force-load-balancing (random logits, the benchmark mode of Megatron-core), since
early in training a learned router sends most tokens to a few experts, so one EP rank does most
of the expert work. Extra arguments after `--` go to every training run. Prints a markdown
table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from epoverlap.config.resolve import SEQUENTIAL_FLAG

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


ROUTING_FLAGS = {"learned": [], "balanced": ["--moe-router-force-load-balancing"]}


def run(gpus: int, preset: str, iters: int, routing: str, extra: list[str],
        log_dir: Path) -> dict:
    log = log_dir / f"train_{preset}_{routing}_{gpus}gpu.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={gpus}", "-m", "epoverlap.train", "--preset", preset, "--bf16",
           "--expert-model-parallel-size", str(gpus), "--train-iters", str(iters),
           "--log-json", str(log), "--log-interval", "5", SEQUENTIAL_FLAG,
           "--cuda-graph-impl", "none"] + ROUTING_FLAGS[routing] + extra
    print("[bench_train]", " ".join(cmd[2:]), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    print(result.stdout[-1500:], flush=True)
    if result.returncode != 0:
        print(result.stderr[-3000:], flush=True)
        return {"gpus": gpus, "routing": routing, "error": f"exit {result.returncode}"}
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steady = records[len(records) // 4:]
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    return {"gpus": gpus, "preset": preset, "routing": routing,
            "imbalance": med("load_imbalance"), "step_ms": med("step_time_s") * 1e3,
            "tokens_per_s": med("tokens_per_s"), "tokens_per_s_per_gpu":
            med("tokens_per_s") / gpus, "tflops_per_gpu": med("tflops_per_gpu"),
            "peak_mem_gib": max(r["peak_mem_gib"] for r in steady),
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", default="1,2")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--routing", default="learned,balanced",
                        help=f"comma list of {', '.join(ROUTING_FLAGS)}")
    parser.add_argument("--out", default=None)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    import torch
    if torch.cuda.device_count() < max(int(g) for g in args.gpus.split(",")):
        print(f"bench_train: needs {args.gpus.split(',')[-1]} CUDA GPU(s) (--gpus {args.gpus}); "
              f"{torch.cuda.device_count()} visible here, so nothing is run", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="bench-train-"))
    routings = [r for r in args.routing.split(",") if r]
    unknown = [r for r in routings if r not in ROUTING_FLAGS]
    if unknown:
        parser.error(f"--routing {','.join(unknown)}: allowed {', '.join(ROUTING_FLAGS)}")
    rows = [run(int(g), args.preset, args.iters, routing, extra, log_dir)
            for routing in routings for g in args.gpus.split(",")]
    table = ["| GPUs | preset | routing | imbalance | step ms | tokens/s | tokens/s/GPU | "
             "TFLOP/s/GPU | peak GiB | loss first -> last |", "| --- " * 10 + "|"]
    for r in rows:
        if "error" in r:
            table.append(f"| {r['gpus']} | {args.preset} | {r['routing']} | {r['error']} |")
            continue
        table.append(f"| {r['gpus']} | {r['preset']} | {r['routing']} | {r['imbalance']:.2f} | "
                     f"{r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{r['tflops_per_gpu']:.1f} | {r['peak_mem_gib']:.2f} | "
                     f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    text = "\n".join(table)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
