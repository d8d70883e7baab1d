"""Optimizer and learning-rate schedule.

Owns `MixedPrecisionAdamW` (AdamW over fp32 master weights fed from the fp32 `main_grad`
buffers; for an fp32 model the masters are the parameters themselves, for a bf16 model they
are fp32 copies written back after each step) and `lr_at` (linear warmup, then cosine decay
to the minimum). A checkpoint holds the masters and `state_of` each one (Adam's step and
moments); `create_state` makes that state before any step, so a checkpoint can be loaded into it.
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

    def state_of(self, master: torch.Tensor) -> dict:
        """Adam's state of one master: {"step": 0-d, "exp_avg", "exp_avg_sq"}; {} before step 1."""
        return self.optimizer.state.get(master, {})

    def create_state(self) -> None:
        """The state torch's AdamW creates at its first step (zeros), for a checkpoint to fill."""
        for master in self.masters:
            if not self.optimizer.state.get(master):
                self.optimizer.state[master] = {
                    "step": torch.tensor(0.0),  # on the CPU, as AdamW keeps it
                    "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format)}

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        for param, master in zip(self.params, self.masters):
            if master is not param:
                param.copy_(master)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for param, master in zip(self.params, self.masters):
            master.grad = param.main_grad
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        self.copy_masters_to_params()
