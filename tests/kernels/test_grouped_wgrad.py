"""The experts' weight grad added into the fp32 main grad: the Triton kernel against its torch
reference (and both against a float64 sum written here), determinism, and an offline sm_90
compile.

CPU tier (Triton interpreter, small shapes): bf16 / fp16 / fp32; several experts with empty
ones, row counts no tile divides, padding rows past the last offset (NaN, so a read of one
shows), widths no tile divides, rows in several steps of BLOCK_K, a chunk of the experts (a
slice of the main grad), fewer programs than tiles (the SM-carveout walk), two runs giving the
same bits. GPU tier (`-m gpu`): the Qwen3 proxy's expert shapes, the same comparisons, the
SM carveout, no sync and CUDA-graph capture.

Tolerances: the kernel and the reference both form the product in fp32 and differ only in
the order of its sums, so fp32 rounding (relative 1e-5, absolute 1e-4 at products of ~10; on
the GPU, with up to ~7000 rows an expert summed one after another, the absolute part grows
with the rows: 5e-7 a row, about five standard deviations of that rounding).

Shape legend: N rows, I input features, O output features, E experts.
"""

import os
import subprocess
import sys
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels import grouped_wgrad_triton, make_moe_ops
from epoverlap.kernels.grouped_wgrad import grouped_weight_grad_torch
from epoverlap.kernels.grouped_wgrad_triton import (WGRAD_FEW_ROWS, WGRAD_MANY_ROWS, WgradConfig,
                                                    grouped_weight_grad_triton, wgrad_config)

from kernel_test_utils import INTERPRETED, eager_then_graph_replay, generator

REPO = Path(__file__).resolve().parents[2]
SMALL = WgradConfig(16, 32, 16, 4, 2)  # several tiles and row steps at small shapes
GROUPED = replace(SMALL, group_i=3)  # tiles numbered 3 input blocks at a time
FP32_CLOSE = dict(rtol=1e-5, atol=1e-4)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                               reason="needs a CUDA GPU (compiled Triton)")


def _inputs(counts, width_in, width_out, dtype, device, *, padding=0, seed=0):
    """(main_grad [E, I, O] fp32, x [N, I], grad [N, O], offsets [E] int32): N = the counts'
    sum plus `padding` rows of NaN past the last offset."""
    gen = generator(seed, device)
    rows = sum(counts)
    x = torch.randn(rows + padding, width_in, generator=gen, device=device).to(dtype)
    grad = torch.randn(rows + padding, width_out, generator=gen, device=device).to(dtype)
    x[rows:], grad[rows:] = float("nan"), float("nan")
    main_grad = torch.randn(len(counts), width_in, width_out, generator=gen, device=device)
    offsets = torch.tensor(list(accumulate(counts)), dtype=torch.int32, device=device)
    return main_grad, x, grad, offsets


def _float64_sum(main_grad, x, grad, counts):
    """main_grad + per expert x_e^T @ grad_e, in float64 (written here, not the code's)."""
    out, start = main_grad.double().clone(), 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        out[e] += x[rows].double().t() @ grad[rows].double()
        start += count
    return out


def _both(counts, width_in, width_out, dtype, device, config=SMALL, padding=0, seed=0):
    main_grad, x, grad, offsets = _inputs(counts, width_in, width_out, dtype, device,
                                          padding=padding, seed=seed)
    ref, out = main_grad.clone(), main_grad.clone()
    grouped_weight_grad_torch(ref, x, grad, offsets)
    grouped_weight_grad_triton(out, x, grad, offsets, config=config)
    return main_grad, x, grad, ref, out


CASES = [  # (counts per expert, I, O, padding rows)
    ([5, 0, 37, 1, 16], 40, 72, 0),   # empty expert, counts no step divides, I/O no tile divides
    ([0, 0, 50, 0], 32, 64, 9),       # one expert holds every row; padding rows after it
    ([3, 3, 3], 16, 32, 0),           # one tile per expert
    ([0, 0], 16, 16, 4),              # no rows routed, only padding
]


@pytest.mark.parametrize("config", [SMALL, GROUPED], ids=["tiles", "tiles in groups"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("counts,width_in,width_out,padding", CASES)
def test_triton_equals_the_reference(triton_device, counts, width_in, width_out, padding, dtype,
                                     config):
    start, x, grad, ref, out = _both(counts, width_in, width_out, dtype, triton_device,
                                     config=config, padding=padding)
    torch.testing.assert_close(out, ref, **FP32_CLOSE)
    expected = _float64_sum(start, x, grad, counts)
    torch.testing.assert_close(out.double(), expected, **FP32_CLOSE)
    torch.testing.assert_close(ref.double(), expected, **FP32_CLOSE)
    for e, count in enumerate(counts):
        if count == 0:  # an expert with no rows keeps its values (padding NaNs never read)
            assert torch.equal(out[e], start[e]) and torch.equal(ref[e], start[e])


def test_two_runs_and_fewer_programs_give_the_same_bits(triton_device, monkeypatch):
    """Deterministic; and the SM carveout's walk (fewer programs than tiles, each taking
    several in turn) sums each tile as one program per tile does."""
    counts = [7, 0, 40, 2]
    main_grad, x, grad, offsets = _inputs(counts, 40, 72, torch.bfloat16, triton_device)
    runs = []
    for programs in (None, None, 3):
        if programs is not None:
            monkeypatch.setattr(grouped_wgrad_triton, "_programs", lambda *args: programs)
        out = main_grad.clone()
        grouped_weight_grad_triton(out, x, grad, offsets, config=SMALL)
        runs.append(out)
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0], runs[2])


def test_default_config_and_a_wave_of_the_experts(triton_device):
    """The default tiles (wider than these widths); a slice [a:b] of the main grad (a wave of
    the experts, `model.waves`) changes that slice only."""
    counts = [9, 70]
    main_grad, x, grad, offsets = _inputs(counts, 24, 40, torch.bfloat16, triton_device)
    whole = torch.randn(4, 24, 40, generator=generator(5, triton_device), device=triton_device)
    before = whole.clone()
    whole[1:3].copy_(main_grad)
    grouped_weight_grad_triton(whole[1:3], x, grad, offsets)
    torch.testing.assert_close(whole[1:3].double(), _float64_sum(main_grad, x, grad, counts),
                               **FP32_CLOSE)
    assert torch.equal(whole[0], before[0]) and torch.equal(whole[3], before[3])


@pytest.mark.parametrize("op", ["torch", "triton", "triton grouped"])
def test_a_second_source_gives_the_bits_of_a_second_call(triton_device, op):
    """`more` (the next microbatch's rows) in the same launch: the bits of two launches, each
    op against itself (the sums start from the main grad)."""
    config = GROUPED if op == "triton grouped" else SMALL
    fn = grouped_weight_grad_torch if op == "torch" else (
        lambda *a, **k: grouped_weight_grad_triton(*a, config=config, **k))
    main_grad, x, grad, offsets = _inputs([7, 0, 40, 2], 40, 72, torch.bfloat16, triton_device)
    _, x2, grad2, offsets2 = _inputs([0, 3, 21, 19], 40, 72, torch.bfloat16, triton_device,
                                     padding=5, seed=1)
    two_calls, one_call = main_grad.clone(), main_grad.clone()
    fn(two_calls, x, grad, offsets)
    fn(two_calls, x2, grad2, offsets2)
    fn(one_call, x, grad, offsets, more=(x2, grad2, offsets2))
    assert torch.equal(one_call, two_calls)
    assert not torch.equal(one_call, main_grad)


@pytest.mark.parametrize("op", ["torch", "triton", "triton grouped"])
def test_overwrite_gives_the_bits_of_zeroing_then_adding(triton_device, op):
    """`accumulate=False` never reads the old main grad (NaN here) and writes zeros for an
    expert with no rows: the bits of zeroing it first and adding."""
    config = GROUPED if op == "triton grouped" else SMALL
    fn = grouped_weight_grad_torch if op == "torch" else (
        lambda *a, **k: grouped_weight_grad_triton(*a, config=config, **k))
    main_grad, x, grad, offsets = _inputs([5, 0, 37, 1], 40, 72, torch.bfloat16, triton_device)
    zeroed, written = torch.zeros_like(main_grad), torch.full_like(main_grad, float("nan"))
    fn(zeroed, x, grad, offsets)
    fn(written, x, grad, offsets, accumulate=False)
    assert torch.equal(written, zeroed)
    assert torch.equal(written[1], torch.zeros_like(written[1]))


def test_config_by_rows_an_expert():
    assert wgrad_config(torch.bfloat16, 256) == WGRAD_FEW_ROWS
    assert wgrad_config(torch.bfloat16, 1024) == WGRAD_MANY_ROWS
    assert wgrad_config(torch.float32, 1024).block_k == 32  # fp32: FMA tiles
    assert {c.block_k for c in (WGRAD_FEW_ROWS, WGRAD_MANY_ROWS)} == {64}  # one sum order


def test_refuses_a_main_grad_it_cannot_write(triton_device):
    main_grad, x, grad, offsets = _inputs([4, 4], 16, 16, torch.bfloat16, triton_device)
    with pytest.raises(ValueError, match="contiguous fp32"):
        grouped_weight_grad_triton(main_grad.transpose(1, 2), x, grad, offsets)
    with pytest.raises(ValueError, match="contiguous fp32"):
        grouped_weight_grad_triton(main_grad.bfloat16(), x, grad, offsets)
    with pytest.raises(ValueError, match="share dtype"):
        grouped_weight_grad_triton(main_grad, x, grad.float(), offsets)


def test_both_tables_hold_the_op(triton_device):
    assert make_moe_ops("torch").grouped_weight_grad is grouped_weight_grad_torch
    assert make_moe_ops("triton").grouped_weight_grad is grouped_weight_grad_triton


def test_reference_uses_host_counts_when_given():
    """With the counts given the reference never reads the offsets (no sync)."""
    counts = [3, 0, 5]
    main_grad, x, grad, offsets = _inputs(counts, 8, 8, torch.float32, "cpu")
    a, b = main_grad.clone(), main_grad.clone()
    grouped_weight_grad_torch(a, x, grad, offsets)
    grouped_weight_grad_torch(b, x, grad, torch.full_like(offsets, -1), counts=counts)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- sm_90 compile

_SM90_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, "tests/kernels")
import sm90_compile
describe = sm90_compile._describe
def with_wgmma(name, compile, kernel):
    return dict(describe(name, compile, kernel),
                wgmma=len(re.findall(r"wgmma\.mma_async", kernel.asm["ptx"])))
sm90_compile._describe = with_wgmma
records, context = [], {}
sm90_compile._install_fake_driver(records, context)
import torch
from epoverlap.kernels.grouped_wgrad_triton import grouped_weight_grad_triton
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for width_in, width_out in ((2048, 1536), (768, 2048), (7168, 4096)):
        context["shape"] = f"I{width_in}-O{width_out}-{str(dtype).split('.')[-1]}"
        x = torch.randn(64, width_in, dtype=dtype)
        grad = torch.randn(64, width_out, dtype=dtype)
        grouped_weight_grad_triton(torch.zeros(2, width_in, width_out), x, grad,
                                   torch.tensor([32, 64], dtype=torch.int32))
print(json.dumps(records))
"""


@pytest.mark.skipif(not INTERPRETED, reason="a GPU compiles the kernels for real")
def test_kernel_compiles_for_sm90():
    """At the proxy's and a large model's widths the kernel compiles for sm_90 without spills,
    and half precision takes Hopper's tensor cores (wgmma)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in records} == {"_grouped_wgrad_kernel"}
    assert all(r["local_bytes"] == 0 and r["stack_bytes"] == 0 for r in records), records
    half = [r for r in records if not r["shape"].endswith("float32")]
    assert half and all(r["wgmma"] > 0 for r in half), half


# ----------------------------------------------------------------------------- GPU tier

def _proxy_counts(experts=128, rows=4096 * 8, skew=False):
    """The Qwen3 proxy's rows per expert (4096 tokens x top-8 over 128 experts): even, or
    skewed (a few experts with many rows, some with none)."""
    if not skew:
        return [rows // experts] * experts
    counts = [0] * experts
    for e in range(experts):
        counts[e] = (e % 7) * 2 * rows // (experts * 6) if e % 5 else 0
    counts[0] += rows - sum(counts)
    return counts


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width_in,width_out,skew,padding", [
    (2048, 1536, False, 0), (768, 2048, False, 0), (2048, 1536, True, 1000),
])
def test_gpu_proxy_shapes(width_in, width_out, skew, padding, dtype):
    counts = _proxy_counts(skew=skew)
    start, x, grad, ref, out = _both(counts, width_in, width_out, dtype, "cuda", config=None,
                                     padding=padding)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 + 5e-7 * max(counts))
    again = start.clone()
    offsets = torch.tensor(list(accumulate(counts)), dtype=torch.int32, device="cuda")
    grouped_weight_grad_triton(again, x, grad, offsets)
    assert torch.equal(again, out)
    carved = start.clone()
    grouped_weight_grad_triton(carved, x, grad, offsets, sm_carveout=8)
    assert torch.equal(carved, out)


@pytest.mark.gpu
@needs_gpu
def test_gpu_every_tile_config_gives_the_same_bits():
    """The configs differ in tiles, warps, stages and rows a step: on the tensor cores each
    output element's sums run 16 rows at a time in row order whatever the step, so the bits
    agree (the kernel's config may follow the rows an expert has)."""
    counts = _proxy_counts(experts=16, rows=16384, skew=True)
    main_grad, x, grad, offsets = _inputs(counts, 2048, 1536, torch.bfloat16, "cuda")
    outs = []
    configs = (WGRAD_FEW_ROWS, WGRAD_MANY_ROWS, WgradConfig(128, 64, 64, 4, 3),
               WgradConfig(64, 128, 64, 4, 4), WgradConfig(128, 256, 64, 8, 4, group_i=4),
               # 128 and 32 rows a step: the tensor cores still add 16 rows at a time in order
               WgradConfig(128, 256, 128, 8, 2, group_i=8), WgradConfig(128, 256, 32, 8, 6))
    _, x2, grad2, offsets2 = _inputs(counts, 2048, 1536, torch.bfloat16, "cuda", seed=1)
    paired = []  # two microbatches' sources in one launch, overwriting (the step's form)
    for config in configs:
        out = main_grad.clone()
        grouped_weight_grad_triton(out, x, grad, offsets, config=config)
        outs.append(out)
        out = torch.full_like(main_grad, float("nan"))
        grouped_weight_grad_triton(out, x, grad, offsets, config=config,
                                   more=(x2, grad2, offsets2), accumulate=False)
        paired.append(out)
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    assert all(torch.equal(paired[0], out) for out in paired[1:])


@pytest.mark.gpu
@needs_gpu
def test_gpu_no_sync_and_graph_replay():
    counts = _proxy_counts(experts=16, rows=4096)
    main_grad, x, grad, offsets = _inputs(counts, 2048, 1536, torch.bfloat16, "cuda",
                                          padding=64)

    def step():
        out = main_grad.clone()
        grouped_weight_grad_triton(out, x, grad, offsets)
        return [out]

    eager, replayed = eager_then_graph_replay(step)
    assert torch.equal(eager[0], replayed[0])
