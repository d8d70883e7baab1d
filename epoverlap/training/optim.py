"""Optimizer and learning-rate schedule.

Owns `MixedPrecisionAdamW` (AdamW over fp32 master weights fed from the fp32 `main_grad`
buffers; for an fp32 model the masters are the parameters themselves, for a bf16 model they
are fp32 copies written back after each step) and `lr_at` (linear warmup, then cosine decay
to the minimum). A checkpoint holds the masters and `state_of` each one (Adam's step and
moments); `create_state` makes that state before any step, so a checkpoint can be loaded into it.

Implementations (`ADAM_IMPLS`, torch's three forms of the same update): `fused` (one kernel
over every tensor: each element read and written once; the default on CUDA), `foreach` (the
single-tensor ops, each one launch over all tensors) and `single` (the ops per tensor: about
ten launches and as many passes over memory per parameter; the default on CPU, which keeps the
bits CPU runs always had). Each is elementwise, so results do not depend on how
tensors are grouped (a checkpoint resumes bitwise across EP sizes); the forms may differ from
one another in the last bits, so a run keeps one (benchmarks/optimizer.md).
"""

from __future__ import annotations

import math
from typing import Optional

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


ADAM_IMPLS = ("fused", "foreach", "single")


def default_adam_impl(device: torch.device) -> str:
    return "fused" if device.type == "cuda" else "single"


class MixedPrecisionAdamW:
    """AdamW on fp32 masters; weight decay on matrices only (not norms or 1-D tensors).
    `impl`: one of `ADAM_IMPLS` (module docstring); None: `default_adam_impl`."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, impl: Optional[str] = None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone()
                        for p in self.params]
        self.impl = impl or default_adam_impl(self.masters[0].device)
        if self.impl not in ADAM_IMPLS:
            raise ValueError(f"AdamW implementation {self.impl!r}: one of {ADAM_IMPLS}")
        # the bf16 parameters written from their masters after each step (fp32 ones are them)
        self._copies = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        decay = [m for p, m in zip(self.params, self.masters) if p.ndim >= 2]
        no_decay = [m for p, m in zip(self.params, self.masters) if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
            foreach=self.impl == "foreach", fused=self.impl == "fused")

    def state_of(self, master: torch.Tensor) -> dict:
        """Adam's state of one master: {"step": 0-d, "exp_avg", "exp_avg_sq"}; {} before step 1."""
        return self.optimizer.state.get(master, {})

    def create_state(self) -> None:
        """The state torch's AdamW creates at its first step (zeros), for a checkpoint to fill:
        the step count fp32 on the CPU, or beside the master for the fused form."""
        for master in self.masters:
            if not self.optimizer.state.get(master):
                self.optimizer.state[master] = {
                    "step": torch.zeros((), dtype=torch.float32, device=master.device
                                        if self.impl == "fused" else "cpu"),
                    "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format)}

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        """bf16 parameters from their fp32 masters, rounded to nearest even (one launch over
        all of them where the tensors live on a GPU)."""
        if self._copies:
            params, masters = zip(*self._copies)
            torch._foreach_copy_(list(params), list(masters))

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
