"""Per-rank bodies of the pipeline-parallel gloo tests (importable, so spawn can pickle them).

`mode_results` runs, in one process group, one Trainer per mode (flags on top of `TINY_PP`):
step 1's reduced grads, then `steps` optimizer steps with --log-json, and returns per mode what
the comparison needs: losses and grad norms as float.hex, and the raw bits of every parameter's
step-1 grad and final value by parameter name (a stage holds only its layers; the test joins
the stages of each pipeline).
"""

from __future__ import annotations

from pathlib import Path

import torch

from epoverlap.config import parse_config, resolve_config
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.loop.trainer import Trainer

# 4 layers: 2 stages x 2 virtual stages of one layer each. --clip-grad is below the grad norm,
# so every step's update goes through the clipping (and the grad norm must agree bitwise).
TINY_PP = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64",
           "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "16",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
           "--micro-batch-size", "2", "--num-microbatches", "4", "--moe-aux-loss-coeff", "0.01",
           "--mock-data", "--deterministic-mode", "--distributed-timeout-minutes", "3",
           "--lr-warmup-iters", "1", "--log-interval", "1000", "--clip-grad", "0.05"]
OVERLAP = ["--overlap-moe-expert-parallel-comm"]
WGRAD = OVERLAP + ["--delay-wgrad-compute"]
VIRTUAL = ["--num-virtual-stages-per-pipeline-rank", "2"]


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().float().contiguous().view(torch.int32).numpy().tobytes()


def _one_mode(cfg, groups, log_json: str) -> dict:
    trainer = Trainer(cfg, groups, log=lambda msg: None)
    try:
        trainer.run_microbatches(step=1)
        trainer.grads.reduce()
        names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        grads = {n: _bits(p.main_grad) for n, p in zip(names, trainer.grads.params)}
        results = trainer.train()
        params = {n: _bits(p) for n, p in trainer.model.named_parameters()}
        return {"stage": groups.pp_rank, "dp_rank": groups.dp_rank,
                "losses": [float.hex(r.loss) for r in results],
                "norms": [float.hex(r.grad_norm) for r in results],
                "grads": grads, "params": params, "log": log_json,
                "describe": trainer.describe()}
    finally:
        trainer.close()


def mode_results(rank, world_size, parallel_flags, modes, out_dir, steps):
    """{mode: this rank's results} for each (mode, flags) of `modes`."""
    first = resolve_config(parse_config(TINY_PP + list(parallel_flags)), world_size, False)
    groups = init_distributed(first.parallel.expert_model_parallel_size, "cpu",
                              timeout_minutes=3,
                              pp_size=first.parallel.pipeline_model_parallel_size)
    try:
        results = {}
        for mode, flags in modes:
            log_json = str(Path(out_dir) / f"{mode}.jsonl")
            cfg = parse_config(TINY_PP + list(parallel_flags) + list(flags) +
                               ["--train-iters", str(steps), "--log-json", log_json])
            results[mode] = _one_mode(cfg, groups, log_json)
        return results
    finally:
        destroy_distributed()
