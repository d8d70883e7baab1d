"""Gradient-accumulation fusion: a dense weight-grad GEMM adds into the fp32 `main_grad`
itself (one addmm, fp32 training) unless --no-gradient-accumulation-fusion; either way main_grad holds the
sum of x^T-weighted grads, checked against a float64 sum written here (not the code's own
helper), and the flag reaches every parameter of a trainer's model."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_helpers import single_rank_groups
from epoverlap.config import parse_config
from epoverlap.model.linear import linear
from epoverlap.training.trainer import Trainer

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "8", "--num-experts", "4",
        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--micro-batch-size", "1",
        "--num-microbatches", "2", "--kernel-backend", "torch", "--mock-data",
        "--skip-optimizer-step", "--train-iters", "10"]


class _Ops(TorchDispatchMode):
    """The aten ops issued inside the mode, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _weight_with_main_grad(fuse: bool, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(6, 5, generator=gen).to(device, dtype))
    weight.main_grad = torch.randn(6, 5, generator=gen).to(device)  # fp32, already holding grads
    weight.fuse_grad_accumulation = fuse
    return weight


def _two_backwards(weight, dtype=torch.float32, device="cpu"):
    """Two microbatches' backward through `linear`; returns their (x, grad) pairs."""
    gen = torch.Generator().manual_seed(4)
    pairs = []
    for rows in (7, 3):
        x = torch.randn(rows, 5, generator=gen).to(device, dtype).requires_grad_(True)
        grad = torch.randn(rows, 6, generator=gen).to(device, dtype)
        linear(x, weight).backward(grad)
        pairs.append((x.detach(), grad))
    return pairs


@pytest.mark.parametrize("fuse", [True, False])
def test_main_grad_gets_the_sum_of_weight_grads(fuse):
    weight = _weight_with_main_grad(fuse)
    start = weight.main_grad.clone().double()
    with _Ops() as ops:
        pairs = _two_backwards(weight)
    expected = start + sum(g.double().t() @ x.double() for x, g in pairs)
    torch.testing.assert_close(weight.main_grad.double(), expected, rtol=1e-6, atol=1e-6)
    assert weight.grad is None  # nothing left for autograd to accumulate
    if fuse:  # one GEMM that adds in place per backward, no separate add
        assert ops.names.count("aten.addmm_") == 2 and "aten.add_" not in ops.names, ops.names
    else:
        assert "aten.addmm_" not in ops.names and ops.names.count("aten.add_") == 2, ops.names


def test_no_main_grad_falls_back_to_param_grad():
    weight = _weight_with_main_grad(True)
    del weight.main_grad
    pairs = _two_backwards(weight)
    expected = sum(g.double().t() @ x.double() for x, g in pairs)
    torch.testing.assert_close(weight.grad.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("extra, fused", [([], True), (["--no-gradient-accumulation-fusion"],
                                                       False)])
def test_the_flag_reaches_every_parameter(extra, fused):
    trainer = Trainer(parse_config(TINY + extra), single_rank_groups(), log=lambda msg: None)
    try:
        flags = {getattr(p, "fuse_grad_accumulation", None)
                 for p in trainer.model.parameters() if p.requires_grad}
        assert flags == {fused}
        inputs = trainer.microbatches(1)
        with _Ops() as ops:
            trainer.run_microbatches(1, inputs)
        assert ("aten.addmm_" in ops.names) == fused
    finally:
        trainer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fuses_fp32_only_and_repeats_its_bits(dtype):
    """On CUDA, fp32 x: one addmm_ into main_grad, the same bits twice, close to the float64
    sum; bf16 x: the GEMM and the add (the fp32-output GEMM was slower, run 6)."""
    results = []
    for _ in range(2):
        weight = _weight_with_main_grad(True, dtype, "cuda")
        start = weight.main_grad.clone().double()
        with _Ops() as ops:
            pairs = _two_backwards(weight, dtype, "cuda")
        expected = start + sum(g.double().t() @ x.double() for x, g in pairs)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(weight.main_grad.double(), expected, rtol=tol, atol=tol)
        assert ("aten.addmm_" in ops.names) == (dtype == torch.float32), ops.names
        results.append(weight.main_grad.clone())
    assert torch.equal(results[0], results[1])
