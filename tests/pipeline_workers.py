"""Per-rank bodies of the pipeline-parallel gloo tests (importable, so spawn can pickle them).

`stage_results` trains a few steps with the given flags on this rank's pipeline stage and
returns what the comparison needs: the step losses (as float.hex), grad norms, and the raw bits
of every parameter's reduced grad of step 1 and of its value after the last step, by parameter
name (a stage holds only its layers; the test joins the stages of a pipeline).
"""

from __future__ import annotations

import torch

from epoverlap.config import parse_config
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.trainer import Trainer

TINY_PP = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64",
           "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "16",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
           "--micro-batch-size", "2", "--num-microbatches", "4", "--moe-aux-loss-coeff", "0.01",
           "--mock-data", "--deterministic-mode", "--dist-timeout-minutes", "3",
           "--lr-warmup-iters", "1", "--log-interval", "1000", "--clip-grad", "0.05"]


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().float().contiguous().view(torch.int32).numpy().tobytes()


def stage_results(rank, world_size, flags, steps):
    cfg = parse_config(TINY_PP + ["--train-iters", str(steps)] + list(flags))
    groups = init_distributed(cfg.parallel.expert_model_parallel_size, "cpu", timeout_minutes=3,
                              pp_size=cfg.parallel.pipeline_model_parallel_size)
    try:
        trainer = Trainer(cfg, groups, log=lambda msg: None)
        try:
            trainer.run_microbatches(step=1)
            trainer.grads.reduce()
            names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
            grads = {n: _bits(p.main_grad) for n, p in zip(names, trainer.grads.params)}
            first_norm = trainer.grads.global_norm()
            results = trainer.train()
            params = {n: _bits(p) for n, p in trainer.model.named_parameters()}
        finally:
            trainer.close()
        return {"stage": groups.pp_rank, "dp_rank": groups.dp_rank,
                "losses": [float.hex(r.loss) for r in results],
                "norms": [float.hex(r.grad_norm) for r in results],
                "first_norm": float.hex(first_norm), "grads": grads, "params": params,
                "plan": [str(a) for a in trainer.plan]}
    finally:
        destroy_distributed()
