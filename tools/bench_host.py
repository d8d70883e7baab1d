"""Host cost of a training step, eager vs partial CUDA graphs (one GPU; the step is host-bound).

    python tools/bench_host.py [--iters 20] [--out FILE.json] [--shape small|bench]

For each mode (eager, graphed: `--cuda-graph-impl local --cuda-graph-modules attn moe_router
moe_preprocess`) it builds a fresh trainer on one GPU (EP=1, sequential plan), runs the warmup
steps (the graphed mode records in the last one and captures), then times --iters forward +
backward passes of all microbatches: the CPU time of the whole process (every thread: the
Python thread and autograd's) and the wall time, each as a median per step, and per layer and
microbatch (divided by layers x microbatches). A small model keeps the GPU ahead of the host,
so the figures are what the host spends issuing the work. Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from epoverlap.config import parse_config, validate_config
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.main import setup_environment
from epoverlap.training.trainer import Trainer

SHAPES = {
    # host-bound: small GEMMs, four MoE layers
    "small": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
              "--num-query-groups", "2", "--seq-length", "512", "--num-experts", "16",
              "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512",
              "--moe-shared-expert-intermediate-size", "512", "--micro-batch-size", "2",
              "--num-microbatches", "4"],
}
COMMON = ["--bf16", "--mock-data", "--skip-optimizer-step", "--log-interval", "100000",
          "--train-iters", "1000", "--moe-aux-loss-coeff", "0.01"]
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router",
          "moe_preprocess"]


def measure(groups, argv, iters: int, warmup: int) -> dict:
    trainer = Trainer(parse_config(argv), groups, log=lambda msg: None)
    try:
        inputs = trainer.microbatches(1)
        for i in range(warmup):
            if trainer.graphs is not None:
                trainer.graphs.recording = i == warmup - 1
            trainer.run_microbatches(1, inputs)
        if trainer.graphs is not None:
            trainer.graphs.recording = False
            trainer.graphs.capture(trainer.plan)
        cpu, wall = [], []
        for _ in range(iters):
            torch.cuda.synchronize()
            c0, w0 = time.process_time(), time.perf_counter()
            trainer.run_microbatches(1, inputs)
            c1 = time.process_time()  # before the sync: the host's issuing cost
            torch.cuda.synchronize()
            cpu.append(c1 - c0)
            wall.append(time.perf_counter() - w0)
        cells = trainer.cfg.model.num_layers * trainer.cfg.train.num_microbatches
        return {"cpu_ms": statistics.median(cpu) * 1e3, "wall_ms": statistics.median(wall) * 1e3,
                "cpu_ms_per_layer_mb": statistics.median(cpu) * 1e3 / cells,
                "graphs": trainer.graphs.graph_count() if trainer.graphs else 0}
    finally:
        trainer.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host: needs a CUDA device (it measures CUDA graphs against eager)")
        return 2
    base = SHAPES[args.shape] + COMMON
    probe = parse_config(base + GRAPHS)
    validate_config(probe, 1, True)
    setup_environment(probe, print)
    groups = init_distributed(1, "cuda")
    try:
        rows = {mode: measure(groups, base + extra, args.iters, args.warmup)
                for mode, extra in (("eager", []), ("graphed", GRAPHS))}
    finally:
        destroy_distributed()
    ratio = rows["eager"]["cpu_ms"] / rows["graphed"]["cpu_ms"]
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "rows": rows,
                                              "cpu_ratio": ratio}, indent=2))
    print(f"\nbench_host: {torch.cuda.get_device_name()}, shape {args.shape}")
    print("| mode | host CPU ms/step | wall ms/step | host CPU ms per layer x microbatch | "
          "graphs |\n| --- | --- | --- | --- | --- |")
    for mode, r in rows.items():
        print(f"| {mode} | {r['cpu_ms']:.2f} | {r['wall_ms']:.2f} | "
              f"{r['cpu_ms_per_layer_mb']:.3f} | {r['graphs']} |")
    print(f"host CPU time eager / graphed: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
