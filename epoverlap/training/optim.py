"""Optimizer and learning-rate schedule.

Owns `MixedPrecisionAdamW` (AdamW over fp32 master weights fed from the fp32 `main_grad`
buffers; for an fp32 model the masters are the parameters themselves, for a bf16 model they
are fp32 copies written back after each step) and `lr_at` (linear warmup, then cosine decay
to the minimum).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from epoverlap.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (1-based)."""
    if cfg.lr_warmup_iters and step <= cfg.lr_warmup_iters:
        return cfg.lr * step / cfg.lr_warmup_iters
    decay_steps = max(cfg.train_iters - cfg.lr_warmup_iters, 1)
    progress = min(max(step - cfg.lr_warmup_iters, 0) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


class MixedPrecisionAdamW:
    """AdamW on fp32 masters; weight decay on matrices only (not norms or 1-D tensors)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone()
                        for p in self.params]
        decay = [m for p, m in zip(self.params, self.masters) if p.ndim >= 2]
        no_decay = [m for p, m in zip(self.params, self.masters) if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=False)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for param, master in zip(self.params, self.masters):
            master.grad = param.main_grad
        self.optimizer.step()
        for param, master in zip(self.params, self.masters):
            master.grad = None
            if master is not param:
                param.copy_(master)
