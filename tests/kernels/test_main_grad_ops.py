"""The norm's and the embedding's weight grads added into the fp32 main grad by their own
backward (`rms_norm(..., main_grad=)`, `embedding(..., main_grad=)`, both op tables).

CPU tier (Triton interpreter): each op with a main grad leaves the weight no grad and gives the
bits of the grad it returned without one added to the main grad in fp32 (what the grad
buffers' hook did): RMSNorm in every dtype; the embedding in fp32, where torch's CPU order (a
row's tokens one by one) is the kernel's while no row holds more than 10 tokens, and against
an emulation of the kernel's order (partial sums of 10 rows) where rows hold more; rows no
token holds are never touched (NaN there stays NaN), two runs repeat their bits.
GPU tier (`-m gpu`): the embedding against torch's CUDA backward plus the add, bit for bit, at
more than 3072 tokens (torch's sort path, whose order the kernel follows) in bf16 and fp32;
RMSNorm likewise against its unfused form; each repeats its bits, syncs no host and replays
from a CUDA graph with the eager bits.

Shape legend: T tokens / rows, V vocabulary rows, H hidden.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels import make_moe_ops
from epoverlap.kernels.embedding import embedding_torch
from epoverlap.kernels.embedding_triton import PARTIAL_ROWS, embedding_triton
from epoverlap.kernels.rmsnorm import rms_norm_torch
from epoverlap.kernels.rmsnorm_triton import rms_norm_triton

from kernel_test_utils import (DTYPES, INTERPRETED, assert_bits_equal, eager_then_graph_replay,
                               generator)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                               reason="needs a CUDA GPU (kernels compiled)")


def _tokens(num_tokens: int, vocab: int, most: int, seed: int, device) -> torch.Tensor:
    """[T] ids below `vocab`, some row holding `most` of them, the rest uniform, shuffled."""
    gen = generator(seed)
    rest = torch.randint(1, vocab, (num_tokens - most,), generator=gen)
    ids = torch.cat([torch.zeros(most, dtype=torch.int64), rest])
    return ids[torch.randperm(num_tokens, generator=gen)].to(device)


def _embedding_case(num_tokens, vocab, hidden, dtype, device, most=3, seed=0):
    """tokens, weight [V, H] (leaf), output grad [T, H], a main grad [V, H] fp32 already
    holding grads (drawn on `device`: the GPU sizes are large)."""
    tokens = _tokens(num_tokens, vocab, most, seed, device)
    gen = generator(seed + 1, device)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, device=device)
    weight = draw(vocab, hidden).to(dtype).requires_grad_(True)
    return tokens, weight, draw(num_tokens, hidden).to(dtype), draw(vocab, hidden)


def _fused(op, tokens, weight, grad, start):
    """The op with a main grad (a copy of `start`): -> (output, main grad); the weight gets no
    grad."""
    main_grad = start.clone()
    out = op(tokens, weight, main_grad=main_grad)
    out.backward(grad)
    assert weight.grad is None
    return out.detach(), main_grad


def _hooked(tokens, weight, grad, start):
    """What the unfused path computes: autograd's weight grad, then main grad += it in fp32."""
    leaf = weight.detach().clone().requires_grad_(True)
    out = F.embedding(tokens, leaf)
    out.backward(grad)
    return out.detach(), start.clone().add_(leaf.grad)


def _emulated(tokens, grad, start, dtype):
    """The kernel's order written out: per row, partial sums of PARTIAL_ROWS tokens in position
    order from zero, the partials summed in order from zero, rounded to `dtype`, added."""
    out = start.clone()
    for row in torch.unique(tokens).tolist():
        positions = (tokens == row).nonzero().flatten().tolist()
        total = torch.zeros(grad.shape[1], device=grad.device)
        for first in range(0, len(positions), PARTIAL_ROWS):
            part = torch.zeros_like(total)
            for position in positions[first:first + PARTIAL_ROWS]:
                part = part + grad[position].float()
            total = total + part
        out[row] += total.to(dtype).float()
    return out


# ----------------------------------------------------------------------------- embedding

@pytest.mark.parametrize("op", [embedding_torch, embedding_triton], ids=["torch", "triton"])
def test_embedding_adds_the_hooks_bits(triton_device, op):
    case = _embedding_case(300, 97, 40, torch.float32, triton_device, most=PARTIAL_ROWS)
    out, main_grad = _fused(op, *case)
    ref_out, ref_main = _hooked(*case)
    assert_bits_equal(out, ref_out, "output")
    assert_bits_equal(main_grad, ref_main, "main grad")


@pytest.mark.parametrize("most", [PARTIAL_ROWS + 2, 37])
def test_embedding_sums_partials_of_ten_rows(triton_device, most):
    tokens, weight, grad, start = _embedding_case(120, 31, 24, torch.float32, triton_device,
                                                  most=most, seed=4)
    grad = grad * torch.logspace(-6, 6, grad.shape[0], device=triton_device)[:, None]
    _, main_grad = _fused(embedding_triton, tokens, weight, grad, start)
    expected = _emulated(tokens, grad, start, torch.float32)
    assert_bits_equal(main_grad, expected, "main grad")
    assert not torch.equal(expected, _hooked(tokens, weight, grad, start)[1])  # the order shows


def test_embedding_touches_only_its_rows_and_repeats(triton_device):
    tokens, weight, grad, start = _embedding_case(200, 64, 33, torch.bfloat16, triton_device,
                                                  most=25, seed=2)
    start[(torch.arange(64, device=triton_device)[:, None] != tokens[None, :]).all(1)] = \
        float("nan")
    unheld = torch.isnan(start[:, 0])
    assert int(unheld.sum()) > 0
    _, first = _fused(embedding_triton, tokens, weight, grad, start)
    _, second = _fused(embedding_triton, tokens, weight, grad, start)
    assert torch.isnan(first[unheld]).all() and torch.isfinite(first[~unheld]).all()
    assert torch.equal(first.nan_to_num(), second.nan_to_num())
    zero = torch.zeros_like(start)  # the sums alone, one bf16 rounding (truncated when interpreted)
    _, sums = _fused(embedding_triton, tokens, weight, grad, zero)
    torch.testing.assert_close(sums, _emulated(tokens, grad, zero, torch.bfloat16),
                               rtol=2 ** -7, atol=0)


def test_embedding_refuses_a_main_grad_it_cannot_write(triton_device):
    tokens, weight, _, _ = _embedding_case(8, 5, 4, torch.float32, triton_device)
    for bad in (torch.zeros(5, 4, dtype=torch.bfloat16), torch.zeros(4, 5).t(),
                torch.zeros(5, 3)):
        with pytest.raises(ValueError, match="main grad"):
            embedding_triton(tokens, weight, main_grad=bad.to(triton_device))


def test_no_token_adds_nothing(triton_device):
    weight = torch.randn(5, 4, device=triton_device, requires_grad=True)
    start = torch.randn(5, 4, device=triton_device)
    tokens = torch.zeros(0, dtype=torch.int64, device=triton_device)
    _, main_grad = _fused(embedding_triton, tokens, weight,
                          torch.zeros(0, 4, device=triton_device), start)
    assert torch.equal(main_grad, start)


def test_both_tables_hold_the_ops(triton_device):
    assert make_moe_ops("torch").embedding is embedding_torch
    assert make_moe_ops("triton").embedding is embedding_triton
    assert make_moe_ops("triton").rms_norm is rms_norm_triton


# ----------------------------------------------------------------------------- rms_norm

def _norm_case(rows, hidden, dtype, device, seed=0):
    gen = generator(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 2).to(device, dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype)
    dy = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    start = torch.randn(hidden, generator=gen).to(device)
    return x, weight, dy, start


def _norm_both(op, x, weight, dy, start):
    """(fused: y, dx, main grad; unfused: y, dx, main grad + the returned weight grad)."""
    results = []
    for fused in (True, False):
        leaf_x = x.detach().clone().requires_grad_(True)
        leaf_w = weight.detach().clone().requires_grad_(True)
        main_grad = start.clone()
        y = op(leaf_x, leaf_w, 1e-6, main_grad=main_grad if fused else None)
        y.backward(dy)
        assert (leaf_w.grad is None) == fused
        if not fused:
            main_grad.add_(leaf_w.grad)
        results.append((y.detach(), leaf_x.grad, main_grad))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [rms_norm_torch, rms_norm_triton], ids=["torch", "triton"])
def test_rms_norm_adds_the_hooks_bits(triton_device, op, dtype):
    fused, unfused = _norm_both(op, *_norm_case(37, 72, dtype, triton_device))
    for name, a, b in zip(("y", "dx", "main grad"), fused, unfused):
        assert_bits_equal(a, b, name)


def test_rms_norm_refuses_a_main_grad_it_cannot_write(triton_device):
    x, weight, _, _ = _norm_case(4, 8, torch.float32, triton_device)
    for bad in (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(16)[::2], torch.zeros(7)):
        with pytest.raises(ValueError, match="main grad"):
            rms_norm_triton(x, weight, 1e-6, main_grad=bad.to(triton_device))


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens,most", [(4096, 300), (16384, 40), (8192, 4000)])
def test_gpu_embedding_is_torchs_sort_path_bit_for_bit(num_tokens, most, dtype):
    """Above 3072 tokens torch's CUDA embedding backward sorts and sums partials of 10 rows:
    the kernel's order, so the fused main grad has the unfused path's bits (vocabulary and
    width of the Qwen3 proxy)."""
    case = _embedding_case(num_tokens, 151936, 2048, dtype, "cuda", most=most)
    out, main_grad = _fused(embedding_triton, *case)
    ref_out, ref_main = _hooked(*case)
    assert_bits_equal(out, ref_out, "output")
    assert_bits_equal(main_grad, ref_main, "main grad")


@pytest.mark.gpu
@needs_gpu
def test_gpu_embedding_repeats_and_replays_from_a_graph():
    tokens, weight, grad, start = _embedding_case(4096, 151936, 2048, torch.bfloat16, "cuda",
                                                  most=500, seed=3)

    def step():
        main_grad = start.clone()
        out = embedding_triton(tokens, weight, main_grad=main_grad)
        out.backward(grad)
        return [out.detach(), main_grad]

    eager, replayed = eager_then_graph_replay(step)
    for a, b in zip(eager, replayed):
        assert_bits_equal(a, b, "graph replay")
    assert_bits_equal(step()[1], eager[1], "rerun")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows,hidden,dtype", [(8192, 2048, torch.bfloat16),
                                               (16384, 7168, torch.bfloat16),
                                               (4096, 128, torch.bfloat16),
                                               (4096, 2048, torch.float32)])
def test_gpu_rms_norm_fused_is_unfused_plus_the_add(rows, hidden, dtype):
    case = _norm_case(rows, hidden, dtype, "cuda", seed=5)
    fused, unfused = _norm_both(rms_norm_triton, *case)
    for name, a, b in zip(("y", "dx", "main grad"), fused, unfused):
        assert_bits_equal(a, b, name)
    x, weight, dy, start = case

    def step():
        main_grad = start.clone()
        leaf = x.detach().clone().requires_grad_(True)
        rms_norm_triton(leaf, weight, 1e-6, main_grad=main_grad).backward(dy)
        return [leaf.grad, main_grad]

    eager, replayed = eager_then_graph_replay(step)
    for a, b in zip(eager + eager, replayed + step()):
        assert_bits_equal(a, b, "graph replay / rerun")


# ----------------------------------------------------------------------------- sm_90 compile

_SM90_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests/kernels")
import sm90_compile
records, context = [], {}
sm90_compile._install_fake_driver(records, context)
import torch
from epoverlap.kernels.embedding_triton import add_embedding_grad
from epoverlap.kernels.rmsnorm_triton import rms_norm_triton
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for hidden in (2048, 7168, 100):
        context["shape"] = f"H{hidden}-{str(dtype).split('.')[-1]}"
        add_embedding_grad(torch.zeros(64, hidden), torch.arange(16) % 5,
                           torch.randn(16, hidden, dtype=dtype))
        x = torch.randn(16, hidden, dtype=dtype, requires_grad=True)
        weight = torch.ones(hidden, dtype=dtype, requires_grad=True)
        rms_norm_triton(x, weight, 1e-6, main_grad=torch.zeros(hidden)).float().sum().backward()
print(json.dumps(records))
"""


@pytest.mark.skipif(not INTERPRETED, reason="a GPU compiles the kernels for real")
def test_kernels_compile_for_sm90():
    """The embedding's grad kernel and the norm's weight-grad kernel (the script runs only its
    form into the main grad) compile for sm_90 without spills (the interpreter runs code a GPU
    compiler could refuse)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    kernels = {r["kernel"] for r in records}
    assert {"_embedding_grad_kernel", "_rms_norm_dw_kernel"} <= kernels, kernels
    assert all(r["local_bytes"] == 0 and r["stack_bytes"] == 0 for r in records), records
