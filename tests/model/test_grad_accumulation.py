"""Gradient-accumulation fusion: a weight-grad GEMM adds into the fp32 `main_grad` itself unless
--no-gradient-accumulation-fusion. Dense: one addmm (fp32 training; bf16/fp16 on CUDA with an
fp32 out_dtype; half precision on the CPU keeps the GEMM and the add). Experts: the op table's
grouped weight grad (torch reference and Triton kernel), also for a chunk of the experts and
for padding rows past the last offset. Either way main_grad holds the sum of x^T-weighted
grads, checked against a float64 sum written here (not the code's own helper); the flag
reaches every parameter of a trainer's model; with the fusion, deferred weight grads under the
overlapped plan give the sequential inline run's bits, on both kernel backends."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_helpers import one_process_model, single_rank_groups
from kernel_test_utils import INTERPRETED
from epoverlap.config import parse_config
from epoverlap.kernels import triton_ops, triton_unavailable_reason
from epoverlap.kernels.grouped_wgrad import grouped_weight_grad_torch
from epoverlap.model.linear import expert_offsets, grouped_gemm, linear
from epoverlap.schedule.executor import Executor, SerialLanes, ThreadLanes
from epoverlap.schedule.pipeline import build_plan
from epoverlap.training.loop.trainer import Trainer

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


def test_half_precision_on_the_cpu_keeps_the_gemm_and_the_add():
    """No CPU kernel adds a bf16 GEMM into an fp32 tensor: the product, then one add."""
    weight = _weight_with_main_grad(True, torch.bfloat16)
    start = weight.main_grad.clone().double()
    with _Ops() as ops:
        pairs = _two_backwards(weight, torch.bfloat16)
    expected = start + sum(g.double().t() @ x.double() for x, g in pairs)
    torch.testing.assert_close(weight.main_grad.double(), expected, rtol=5e-2, atol=5e-2)
    assert "aten.addmm" not in ops.names and ops.names.count("aten.add_") == 2, ops.names


# ----------------------------------------------------------------------------- experts

def _expert_weight(fuse: bool, device="cpu", experts=4, width_in=6, width_out=10):
    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(experts, width_in, width_out, generator=gen)
                                .to(device))
    weight.main_grad = torch.randn(experts, width_in, width_out, generator=gen).to(device)
    weight.fuse_grad_accumulation = fuse
    return weight


def _expert_backward(weight, counts, *, padding=0, host_counts=True, experts=None,
                     op=grouped_weight_grad_torch):
    """One backward through `grouped_gemm` (fp32, on the weight's device); -> (x, grad) of
    the routed rows."""
    gen = torch.Generator().manual_seed(6)
    rows, device = sum(counts), weight.device
    x = torch.randn(rows + padding, weight.shape[1], generator=gen).to(device)
    grad = torch.randn(rows + padding, weight.shape[2], generator=gen).to(device)
    offsets = expert_offsets(torch.tensor(counts, device=device))
    out = grouped_gemm(x.requires_grad_(), weight, offsets, counts if host_counts else None,
                       experts=experts, grouped_weight_grad=op)
    out.backward(grad)
    return x.detach()[:rows], grad[:rows]


def _expected(start, x, grad, counts, first=0):
    out, row = start.double().clone(), 0
    for e, count in enumerate(counts):
        out[first + e] += x[row:row + count].double().t() @ grad[row:row + count].double()
        row += count
    return out


class _Calls:
    """A grouped weight-grad op that counts its calls and runs `op`."""

    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.op(*args, **kwargs)


def _triton_device() -> str:
    """Where the Triton op runs here: the CPU under the interpreter, else CUDA."""
    return "cpu" if INTERPRETED else "cuda"


def _op_cases():
    """(op, device): the torch reference on the CPU, the Triton kernel where it runs."""
    cases = [(grouped_weight_grad_torch, "cpu")]
    if triton_unavailable_reason() is None:
        cases.append((triton_ops.grouped_weight_grad, _triton_device()))
    return cases


def _case_id(case):
    return case.__module__.split(".")[-1] if callable(case) else case


@pytest.mark.parametrize("op,device", _op_cases(), ids=_case_id)
@pytest.mark.parametrize("fuse", [True, False])
def test_expert_main_grad_gets_the_sum_fused_or_not(fuse, op, device):
    """Fused: the table's op adds into main_grad (no product in between); unfused: the grouped
    GEMM and an add. Either way main_grad is the float64 sum; no autograd grad is left."""
    counts = [3, 0, 5, 2]
    weight = _expert_weight(fuse, device)
    start = weight.main_grad.clone()
    spy = _Calls(op)
    x, grad = _expert_backward(weight, counts, op=spy)
    torch.testing.assert_close(weight.main_grad.double(), _expected(start, x, grad, counts),
                               rtol=1e-5, atol=1e-5)
    assert spy.calls == (1 if fuse else 0)
    assert weight.grad is None


@pytest.mark.parametrize("op,device", _op_cases(), ids=_case_id)
def test_expert_chunk_and_device_only_counts(op, device):
    """A chunk of the experts (`experts=(1, 3)`) lands in main_grad[1:3] only; with the counts
    known only on the device (the budget dispatch) the padding rows past the last offset are
    left out."""
    counts = [4, 3]
    weight = _expert_weight(True, device)
    start = weight.main_grad.clone()
    x, grad = _expert_backward(weight, counts, padding=5, host_counts=False, experts=(1, 3),
                               op=op)
    expected = _expected(start, x, grad, counts, first=1)
    torch.testing.assert_close(weight.main_grad.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(weight.main_grad[0], start[0]) and torch.equal(weight.main_grad[3],
                                                                      start[3])


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "16",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
         "--micro-batch-size", "2", "--moe-first-k-dense-replace", "1"]


def _main_grads(backend, plan_name, lanes_cls, delay):
    model, queue, grads = one_process_model(parse_config(MODEL), backend, torch.float32, "cpu",
                                            delay)  # (the executor's CPU lanes)
    gen = torch.Generator().manual_seed(7)
    data = [{"tokens": torch.randint(0, 256, (2, 16), generator=gen),
             "labels": torch.randint(0, 256, (2, 16), generator=gen)} for _ in range(3)]
    lanes = lanes_cls()
    try:
        Executor(model.node_specs(), lanes, queue).run(
            build_plan(plan_name, model.layout(), 3, delay), data, 1 / 3)
    finally:
        lanes.close()
    return grads.dense_flat.clone(), grads.expert_flat.clone()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_grads_keep_their_bits_overlapped_and_deferred(backend, monkeypatch):
    """The fused weight grads (dense addmm_, the experts through the table's op) of the
    sequential inline run equal those of the overlapped plan with deferred weight grads."""
    if backend == "triton" and not INTERPRETED:
        pytest.skip("the Triton kernels run on CPU tensors under TRITON_INTERPRET only")
    spy = _Calls(triton_ops.grouped_weight_grad)
    monkeypatch.setattr(triton_ops, "grouped_weight_grad", spy)
    sequential = _main_grads(backend, "sequential", SerialLanes, False)
    overlapped = _main_grads(backend, "combined_1f1b", ThreadLanes, True)
    assert torch.equal(sequential[0], overlapped[0])
    assert torch.equal(sequential[1], overlapped[1])
    assert (spy.calls > 0) == (backend == "triton")  # the table's op took the experts' grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_fuses_every_dtype_and_repeats_its_bits(dtype):
    """On CUDA every dtype adds into main_grad inside the GEMM (fp32 by addmm_, half precision
    by addmm with an fp32 out_dtype: no add), the same bits twice, close to the float64 sum."""
    results = []
    for _ in range(2):
        weight = _weight_with_main_grad(True, dtype, "cuda")
        start = weight.main_grad.clone().double()
        with _Ops() as ops:
            pairs = _two_backwards(weight, dtype, "cuda")
        expected = start + sum(g.double().t() @ x.double() for x, g in pairs)
        torch.testing.assert_close(weight.main_grad.double(), expected, rtol=1e-4, atol=1e-4)
        assert "aten.add_" not in ops.names and any(n.startswith("aten.addmm") for n in
                                                    ops.names), ops.names
        results.append(weight.main_grad.clone())
    assert torch.equal(results[0], results[1])
