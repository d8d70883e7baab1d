"""Optimizer and learning-rate schedule.

Owns `MixedPrecisionAdamW` (AdamW over fp32 master weights fed from the fp32 `main_grad`
buffers; for an fp32 model the masters are the parameters themselves, for a bf16 model they
are fp32 copies written back after each step) and `lr_at`, the learning-rate schedule (a
linear warmup, then Megatron-LM's constant, linear, cosine or WSD decay to the minimum). A
checkpoint holds the masters and `state_of` each one (Adam's step and moments);
`create_state` makes that state before any step, so a checkpoint can be loaded into it.

Implementations (`ADAM_IMPLS`, four forms of the same update): `flat` (`flat_adam.FlatAdamW`:
the masters and moments in flat buffers laid out as the grad buffers, one Triton launch per grad
buffer that reads and writes each value once and writes the bf16 parameter in the same pass;
the default on CUDA), and torch's three over one master per parameter (`TorchAdamW`): `fused`
(one kernel over every tensor, then a second pass copying the masters to the bf16
parameters), `foreach` (the single-tensor ops, each one launch over all tensors) and `single`
(the ops per tensor: about ten launches and as many passes over memory per parameter; the
default on CPU, which keeps the bits CPU runs always had). Each is elementwise, so results do
not depend on how tensors are grouped (a checkpoint resumes bitwise across EP sizes); the forms
may differ from one another in the last bits, so a run keeps one (benchmarks/optimizer.md; how
`flat` differs from `single`: `kernels.adamw`). Every form keeps its state per parameter
(`state_of`), so a checkpoint saved with one resumes with another.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from epoverlap.config import TrainConfig
from epoverlap.kernels import triton_installed
from epoverlap.training.optimizer.flat_adam import FlatAdamW


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (1-based): a linear warmup over
    `cfg.warmup_steps` steps to --lr, then --lr-decay-style down to --min-lr, ending at
    `cfg.decay_steps` (--lr-decay-iters, else --train-iters); --min-lr after that (constant:
    --lr throughout).

    Megatron-LM's `OptimizerParamScheduler.get_lr` (megatron/core/optimizer_param_scheduler.py)
    with its `num_steps` = `step`: our step s applies the rate Megatron's scheduler holds after
    its s-th `step(1)` call, the rate Megatron's iteration s + 1 applies (its first iteration
    updates at `num_steps` 0, with a warmup at lr 0; ours at 1/warmup of the peak). The formulas
    are its own (`init_lr` --lr-warmup-init, 0 by default; with --lr-decay-samples /
    --lr-warmup-samples its schedule on sequences trained, here in steps of the global batch,
    fractions of a step where it does not divide them); the cosine keeps the form epoverlap
    always had, min + 0.5 * (lr - min) * (1 + cos), the same number to rounding, so runs keep
    their bits."""
    warmup, end = cfg.warmup_steps, cfg.decay_steps
    if warmup and step <= warmup:
        return cfg.lr_warmup_init + (cfg.lr - cfg.lr_warmup_init) * step / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    progress = min(max(step - warmup, 0) / max(end - warmup, 1), 1.0)
    if cfg.lr_decay_style == "cosine":
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    if step > end:
        return cfg.min_lr
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - progress
    elif cfg.lr_decay_style == "WSD":
        coeff = _wsd_coeff(step, cfg)
    else:
        raise ValueError(f"--lr-decay-style {cfg.lr_decay_style!r}: not a decay style")
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def _wsd_coeff(step: int, cfg: TrainConfig) -> float:
    """WSD: 1 (the stable phase, at the peak) until `decay_steps - wsd_decay_iters`, then the
    --lr-wsd-decay-style shape from 1 to 0 over --lr-wsd-decay-iters steps (none: every step
    after the warmup)."""
    end = cfg.decay_steps
    length = cfg.lr_wsd_decay_iters
    if length is None:
        length = end - cfg.warmup_steps
    anneal_start = end - length
    if step <= anneal_start:
        return 1.0
    ratio = (step - anneal_start) / max(length, 1)
    style = cfg.lr_wsd_decay_style
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"--lr-wsd-decay-style {style!r}: not a WSD decay style")


ADAM_IMPLS = ("flat", "fused", "foreach", "single")


def default_adam_impl(device: torch.device) -> str:
    """`flat` on GPUs (`fused` where Triton is not installed), `single` on CPUs."""
    if device.type != "cuda":
        return "single"
    return "flat" if triton_installed() else "fused"


class MixedPrecisionAdamW:
    """AdamW on fp32 masters; weight decay on matrices only (not norms or 1-D tensors).
    `impl`: one of `ADAM_IMPLS` (module docstring); None: `default_adam_impl`. Every
    trainable parameter of `model` needs its `main_grad` (`grads.GradBuffers`)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, impl: Optional[str] = None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.impl = impl or default_adam_impl(self.params[0].device)
        if self.impl not in ADAM_IMPLS:
            raise ValueError(f"AdamW implementation {self.impl!r}: one of {ADAM_IMPLS}")
        self.form = (FlatAdamW(self.params, cfg) if self.impl == "flat"
                     else TorchAdamW(self.params, cfg, self.impl))
        self.masters = self.form.masters  # the fp32 tensors Adam updates, one per parameter

    def state_of(self, master: torch.Tensor) -> dict:
        """Adam's state of one master: {"step": 0-d, "exp_avg", "exp_avg_sq"}; {} before step 1."""
        return self.form.state_of(master)

    def create_state(self) -> None:
        """The state the first step creates (zeros), for a checkpoint to fill."""
        self.form.create_state()

    def copy_masters_to_params(self) -> None:
        """bf16 parameters from their fp32 masters, rounded to nearest even."""
        self.form.copy_masters_to_params()

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One step on the main grads times `grad_scale`, the clip's factor
        (`grads.clip_factor`): the flat form multiplies each grad as it reads it, the
        torch forms scale the buffers first; the same fp32 products either way."""
        self.form.step(lr, grad_scale)


class TorchAdamW:
    """torch's AdamW (`fused`, `foreach` or `single`) over one fp32 master per parameter: for
    an fp32 parameter the parameter itself, else an fp32 copy written back after each step."""

    def __init__(self, params: list, cfg: TrainConfig, impl: str):
        self.params = params
        self.impl = impl
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone()
                        for p in self.params]
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
        return self.optimizer.state.get(master, {})

    def create_state(self) -> None:
        """The state torch's AdamW creates at its first step (zeros): the step count fp32 on
        the CPU, or beside the master for the fused form."""
        for master in self.masters:
            if not self.optimizer.state.get(master):
                self.optimizer.state[master] = {
                    "step": torch.zeros((), dtype=torch.float32, device=master.device
                                        if self.impl == "fused" else "cpu"),
                    "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format)}

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        """One launch over all the bf16 parameters where the tensors live on a GPU."""
        if self._copies:
            params, masters = zip(*self._copies)
            torch._foreach_copy_(list(params), list(masters))

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if grad_scale != 1.0:
            torch._foreach_mul_([param.main_grad for param in self.params], grad_scale)
        for param, master in zip(self.params, self.masters):
            master.grad = param.main_grad
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        self.copy_masters_to_params()
