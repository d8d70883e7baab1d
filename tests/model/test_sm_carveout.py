"""--moe-grouped-gemm-sm-carveout: the experts' grouped GEMMs leave SMs free for the all-to-alls.

CPU tier: the carveout is set around each grouped GEMM of the forward, input grad and (inline
or deferred) weight grad, and put back afterwards, also after a failure; the dense GEMMs never
see it. GPU tier (`gpu`): the same bits with and without it, beside a kernel that holds SMs."""

from __future__ import annotations

import pytest
import torch

import epoverlap.model.linear as linear
from epoverlap.model.linear import expert_offsets, grouped_gemm
from epoverlap.schedule.wgrad import WeightGradQueue

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(device="cpu", dtype=torch.float32, rows=(16, 0, 32, 16), hidden=16, out=32):
    generator = torch.Generator(device="cpu").manual_seed(3)
    counts = list(rows)
    x = torch.randn(sum(counts), hidden, generator=generator).to(device, dtype)
    w = torch.randn(len(counts), hidden, out, generator=generator).to(device, dtype)
    grad = torch.randn(sum(counts), out, generator=generator).to(device, dtype)
    offsets = expert_offsets(torch.tensor(counts, device=device))
    return x, w, offsets, counts, grad


def _run(x, w, offsets, counts, grad, carveout):
    x = x.clone().requires_grad_(True)
    w = torch.nn.Parameter(w.clone())
    out = grouped_gemm(x, w, offsets, counts, sm_carveout=carveout)
    out.backward(grad)
    return out.detach(), x.grad, w.grad


@pytest.fixture
def carveout_calls(monkeypatch):
    """Every value the process-wide carveout is set to, and what torch._grouped_mm saw."""
    state = {"now": None, "set": [], "seen": []}

    def set_carveout(value):
        state["now"] = value
        state["set"].append(value)

    real_grouped_mm = torch._grouped_mm

    def grouped_mm(*args, **kwargs):
        state["seen"].append(state["now"])
        return real_grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", set_carveout)
    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: state["now"])
    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
    return state


def test_every_grouped_gemm_runs_carved_and_the_carveout_is_put_back(carveout_calls):
    x, w, offsets, counts, grad = _inputs()
    _run(x, w, offsets, counts, grad, carveout=8)
    # forward, input grad, weight grad: three grouped GEMMs, each under the carveout
    assert carveout_calls["seen"] == [8, 8, 8]
    assert carveout_calls["set"] == [8, None] * 3 and carveout_calls["now"] is None


def test_a_deferred_weight_grad_keeps_the_carveout(carveout_calls):
    x, w, offsets, counts, grad = _inputs()
    queue = WeightGradQueue(enabled=True)
    with queue.collecting("W0"):
        x = x.clone().requires_grad_(True)
        weight = torch.nn.Parameter(w.clone())
        grouped_gemm(x, weight, offsets, counts, queue, sm_carveout=4).backward(grad)
    assert carveout_calls["seen"] == [4, 4]  # forward and input grad so far
    queue.run("W0")
    assert carveout_calls["seen"] == [4, 4, 4] and carveout_calls["now"] is None


def test_no_carveout_touches_nothing(carveout_calls):
    _run(*_inputs(), carveout=None)
    assert carveout_calls["set"] == [] and carveout_calls["seen"] == [None] * 3


def test_an_earlier_carveout_is_restored_even_after_a_failure(carveout_calls, monkeypatch):
    carveout_calls["now"] = 2  # someone else's setting (an async-TP matmul, say)

    def failing(*args, **kwargs):
        raise RuntimeError("no kernel")
    monkeypatch.setattr(torch, "_grouped_mm", failing)
    x, w, offsets, _, _ = _inputs()
    with pytest.raises(RuntimeError, match="no kernel"):
        linear._carved_grouped_mm(x, w, offsets, 16)
    assert carveout_calls["now"] == 2


def test_same_bits_with_and_without_on_cpu():
    inputs = _inputs()
    for got, want in zip(_run(*inputs, carveout=8), _run(*inputs, carveout=None)):
        assert torch.equal(got, want)


def test_the_experts_take_it_from_the_config():
    from dist_helpers import one_process_model

    from epoverlap.config import parse_config
    cfg = parse_config(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                        "2", "--num-experts", "4", "--moe-grouped-gemm-sm-carveout", "8"])
    model, _, _ = one_process_model(cfg, "torch", torch.float32, "cpu")
    experts = [m for m in model.modules() if hasattr(m, "sm_carveout")]
    assert len(experts) == 2 and all(e.sm_carveout == 8 for e in experts)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("carveout", [8, 32])
def test_same_bits_on_the_gpu_beside_a_kernel_holding_sms(carveout):
    """bf16 at an expert shape, the carved GEMMs launched while sleep kernels hold SMs on a
    high-priority stream (what an all-to-all does): identical outputs and grads."""
    inputs = _inputs("cuda", torch.bfloat16, rows=(512, 0, 1536, 1024, 96, 928),
                     hidden=1024, out=2048)
    want = _run(*inputs, carveout=None)
    hog = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    with torch.cuda.stream(hog):
        for _ in range(carveout):
            torch.cuda._sleep(20_000_000)
    got = _run(*inputs, carveout=carveout)
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch._C._get_sm_carveout_experimental() is None
