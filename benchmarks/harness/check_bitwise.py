"""Bitwise overlap contract check, on any number of ranks (GPUs with NCCL, or CPU with gloo).

    torchrun --standalone --nproc-per-node N -m benchmarks.harness.check_bitwise [--steps 20] [--out F.json]
        [--ep N] [train flags...]

For each mode (sequential, overlap, overlap + delayed wgrad, early-release + delayed wgrad)
it builds a fresh model from the same seed, runs one step and keeps the raw bits of every
reduced gradient, then trains `--steps` steps writing a --log-json. Every mode must match the
sequential reference bit for bit: grads (compared as int views) and the losses of every step.
A repeat of the sequential mode shows whether the platform itself is deterministic. Prints a
table on rank 0 and exits 1 if any mode differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from epoverlap.config import parse_config, validate_config
from epoverlap.errors import ConfigError
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.setup.environment import setup_environment
from epoverlap.training.loop.trainer import Trainer
from epoverlap.cli.compare_losses import compare_loss_logs
from epoverlap.config.resolve import SEQUENTIAL_FLAG as SEQUENTIAL

MODES = {
    "sequential": [SEQUENTIAL],
    "sequential_repeat": [SEQUENTIAL],
    "overlap": ["--overlap-moe-expert-parallel-comm"],
    "overlap_wgrad": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"],
    "early_release_wgrad": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
                            "--overlap-plan", "combined_1f1b_early_release"],
}
DEFAULT_MODEL = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "512",
                 "--num-attention-heads", "8", "--num-query-groups", "4", "--seq-length", "256",
                 "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
                 "--moe-shared-expert-intermediate-size", "256", "--moe-aux-loss-coeff", "0.01",
                 "--moe-first-k-dense-replace", "1", "--micro-batch-size", "2",
                 "--num-microbatches", "4", "--mock-data", "--log-interval", "1000",
                 "--tune", "off", "--cuda-graph-impl", "none"]  # eager (CUDA's default: graphs)


def _grad_digest(trainer: Trainer) -> str:
    digest = hashlib.sha256()
    for flat in (trainer.grads.dense_flat, trainer.grads.expert_flat):
        digest.update(flat.detach().cpu().view(torch.int32).numpy().tobytes())
    return digest.hexdigest()


def run_mode(groups, argv: list[str], steps: int, log_path: Path) -> str:
    cfg = parse_config(argv + ["--train-iters", str(steps), "--log-json", str(log_path)])
    trainer = Trainer(cfg, groups, log=lambda msg: None)
    try:
        trainer.run_microbatches(step=1)
        trainer.grads.reduce()
        digest = _grad_digest(trainer)
        trainer.train()
        return digest
    finally:
        trainer.close()


def _all_digests(digest: str) -> list[str]:
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, digest)
    return gathered


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ep", type=int, default=None, help="EP size (default: world size)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args, train_flags = parser.parse_known_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep = args.ep or world
    base = DEFAULT_MODEL + ["--deterministic-mode", "--expert-model-parallel-size", str(ep)]
    if torch.cuda.is_available():
        base.append("--bf16")
    base += train_flags
    try:
        validate_config(parse_config(base + MODES["overlap_wgrad"]), world,
                        torch.cuda.is_available())
    except ConfigError as error:
        if os.environ.get("RANK", "0") == "0":
            hint = " (run it under torchrun with 2+ ranks)" if world < 2 else ""
            print(f"check_bitwise: error: {error}{hint}", file=sys.stderr)
        return 2
    setup_environment(parse_config(base + MODES["overlap"]), print)
    groups = init_distributed(ep, "cuda" if torch.cuda.is_available() else "cpu")
    log_dir = Path(tempfile.mkdtemp(prefix="epoverlap-bitwise-"))
    try:
        digests = {mode: _all_digests(run_mode(groups, base + flags, args.steps,
                                               log_dir / f"{mode}.jsonl"))
                   for mode, flags in MODES.items()}
    finally:
        destroy_distributed(groups)
    if groups.rank != 0:
        return 0
    return _report(digests, log_dir, args, world, ep)


def _report(digests, log_dir: Path, args, world: int, ep: int) -> int:
    rows, ok = [], True
    for mode in MODES:
        grads_same = digests[mode] == digests["sequential"]
        losses = compare_loss_logs(log_dir / "sequential.jsonl", log_dir / f"{mode}.jsonl")
        ok &= grads_same and losses.identical
        rows.append({"mode": mode, "grads_bitwise_equal": grads_same,
                     "losses_identical": losses.identical, "steps": losses.steps_compared,
                     "loss_message": losses.message})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\nbitwise check: world {world}, EP {ep}, {device}, {args.steps} steps")
    print("| mode | grads (all ranks) bitwise equal | losses identical |")
    print("| --- | --- | --- |")
    for row in rows:
        print(f"| {row['mode']} | {row['grads_bitwise_equal']} | {row['losses_identical']} "
              f"({row['steps']} steps) |")
    if args.out:
        Path(args.out).write_text(json.dumps({"world": world, "ep": ep, "device": device,
                                              "rows": rows}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
