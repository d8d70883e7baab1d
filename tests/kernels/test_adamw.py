"""The flat AdamW update (`epoverlap.kernels.adamw`, `adamw_triton`): the Triton kernel against
its torch form bitwise over several steps (masters, moments, bf16 parameters), with windows that
decay, that do not, and that hold both; the torch form against torch's own single-tensor AdamW
(moments bitwise; masters within 2 fp32 epsilons of |master| + lr, torch's CPU square root
being MKL's); the decay layout; the bf16 rounding at ties, infinities and overflow. CPU tier
under the Triton interpreter; the same on a GPU where there is one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels.adamw import (DECAY, NO_DECAY, adam_scalars, adamw_flat_torch,
                                     decay_layout)

from kernel_test_utils import INTERPRETED

REPO = Path(__file__).resolve().parents[2]

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
# decayed ranges of n = 5000 values cut into windows of 512: whole windows of each kind, a
# window with two decayed runs, one ending the buffer in the middle of a window
N, BLOCK = 5000, 512
RANGES = [(0, 1100), (1200, 1210), (1300, 2048), (3000, 5000)]


def _state(device, n=N, seed=1) -> list[torch.Tensor]:
    """master, grad, exp_avg, exp_avg_sq (fp32) and the bf16 parameter."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    tensors = [master, torch.randn(n, generator=gen) * 1e-3,
               torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6,
               master.bfloat16()]
    return [t.to(device) for t in tensors]


def _scalars(step: int):
    return adam_scalars(1e-2 / step, WD, *BETAS, EPS, float(step))


def _decayed_mask(n, ranges) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    for start, end in ranges:
        mask[start:end] = True
    return mask


def test_decay_layout_marks_each_window_and_each_value_of_a_mixed_one():
    layout = decay_layout(RANGES, N, BLOCK, torch.device("cpu"))
    mask = _decayed_mask(N, RANGES)
    codes = layout.codes.tolist()
    assert len(codes) == 10 and (codes[2], codes[5]) == (0, 1)
    assert codes[4] == NO_DECAY and codes[3] == codes[9] == DECAY
    assert sorted(c for c in codes if c >= 0) == list(range(layout.flags.shape[0])) == [0, 1]
    for window, code in enumerate(codes):
        values = mask[window * BLOCK:(window + 1) * BLOCK]
        if code >= 0:
            assert values.any() and not values.all()
            assert torch.equal(layout.flags[code, :values.numel()].bool(), values)
        else:
            assert bool(values.all()) == (code == DECAY) and bool(values.any()) == (code == DECAY)


def test_an_empty_buffer_has_no_windows():
    layout = decay_layout([], 0, BLOCK, torch.device("cpu"))
    assert layout.codes.numel() == 0
    empty = torch.zeros(0)
    adamw_flat_torch(empty, empty, empty, empty, None, layout, _scalars(1))


@pytest.mark.parametrize("with_param", [True, False])
def test_triton_update_is_the_torch_form_bit_for_bit(triton_device, with_param):
    from epoverlap.kernels.adamw_triton import adamw_flat_triton

    layout = decay_layout(RANGES, N, BLOCK, torch.device(triton_device))
    want, got = _state(triton_device), _state(triton_device)
    start = want[0].clone()
    for step in range(1, 5):
        grad = torch.randn(N, generator=torch.Generator().manual_seed(10 + step)) * 1e-3
        want[1].copy_(grad)
        got[1].copy_(grad)
        adamw_flat_torch(*want[:4], want[4] if with_param else None, layout, _scalars(step))
        adamw_flat_triton(*got[:4], got[4] if with_param else None, layout, _scalars(step))
        for name, a, b in zip(("master", "grad", "exp_avg", "exp_avg_sq", "param"), want, got):
            assert torch.equal(a.view(torch.int32 if a.dtype == torch.float32 else torch.int16),
                               b.view(torch.int32 if b.dtype == torch.float32 else torch.int16)), \
                (step, name)
    assert torch.equal(got[4], got[0].bfloat16()) == with_param
    assert not torch.equal(got[0], start)


@pytest.mark.parametrize("form", ["torch", "triton"])
def test_a_grad_scale_gives_the_bits_of_grads_scaled_before_the_step(triton_device, form):
    """The clip's factor applied as each grad is read = the buffers scaled in place first."""
    from epoverlap.kernels.adamw_triton import adamw_flat_triton

    update = adamw_flat_torch if form == "torch" else adamw_flat_triton
    layout = decay_layout(RANGES, N, BLOCK, torch.device(triton_device))
    first, then = _state(triton_device), _state(triton_device)
    for step, scale in ((1, 0.37), (2, 1.0), (3, 1 / 3)):
        grad = (torch.randn(N, generator=torch.Generator().manual_seed(20 + step)) * 1e-3).to(
            triton_device)
        first[1].copy_(grad.mul(scale))  # the old clip: the buffer scaled in place
        then[1].copy_(grad)
        update(*first[:4], first[4], layout, _scalars(step))
        s = _scalars(step)
        update(*then[:4], then[4], layout, adam_scalars(1e-2 / step, WD, *BETAS, EPS,
                                                        float(step), grad_scale=scale))
        for name, index in (("master", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
            assert torch.equal(first[index].view(torch.int32), then[index].view(torch.int32)), \
                (step, scale, name)
        assert torch.equal(first[4].view(torch.int16), then[4].view(torch.int16))
        assert s.grad_scale == 1.0


def test_only_the_matrices_decay():
    """With gradients and moments 0 the update is the decay alone: decayed values times
    (1 - lr * wd) in fp32, the rest untouched."""
    master, grad, m, v, _ = _state("cpu")
    grad.zero_(), m.zero_(), v.zero_()
    before = master.clone()
    layout = decay_layout(RANGES, N, BLOCK, torch.device("cpu"))
    adamw_flat_torch(master, grad, m, v, None, layout, _scalars(1))
    mask = _decayed_mask(N, RANGES)
    assert torch.equal(master[mask], before[mask] * (1 - 1e-2 * WD))
    assert torch.equal(master[~mask], before[~mask])


def test_torch_form_is_torchs_single_tensor_adamw_but_for_mkls_square_root():
    """torch.optim.AdamW(foreach=False) over two tensors (decayed, not) against the torch form
    over their concatenation: moments bitwise every step; masters at most one ulp apart per
    step taken (torch's CPU sqrt is MKL's, not correctly rounded; ours is)."""
    steps, decayed = 6, 3000
    master, grad, m, v, _ = _state("cpu")
    m.zero_(), v.zero_()
    params = [master[:decayed].clone(), master[decayed:].clone()]
    torch_adamw = torch.optim.AdamW([{"params": params[:1], "weight_decay": WD},
                                     {"params": params[1:], "weight_decay": 0.0}],
                                    lr=1.0, betas=BETAS, eps=EPS, foreach=False)
    layout = decay_layout([(0, decayed)], N, BLOCK, torch.device("cpu"))
    worst = 0
    for step in range(1, steps + 1):
        grad.copy_(torch.randn(N, generator=torch.Generator().manual_seed(step)) * 1e-3)
        for param, part in zip(params, grad.split([decayed, N - decayed])):
            param.grad = part.clone()
        for group in torch_adamw.param_groups:
            group["lr"] = 1e-2 / step
        torch_adamw.step()
        adamw_flat_torch(master, grad, m, v, None, layout, _scalars(step))
        state = [torch_adamw.state[p] for p in params]
        assert torch.equal(m, torch.cat([s["exp_avg"] for s in state])), step
        assert torch.equal(v, torch.cat([s["exp_avg_sq"] for s in state])), step
        apart = (master - torch.cat(params)).abs()
        scale = torch.finfo(torch.float32).eps * (master.abs() + 1e-2)
        assert bool((apart <= 2 * scale).all()), (step, float((apart / scale).max()))
        worst = max(worst, float(apart.max()))
    assert worst > 0  # MKL's square root shows (were it 0, the docstrings would be wrong)


def test_bf16_parameters_round_to_nearest_even_at_ties_and_overflow(triton_device):
    """The kernel's bf16 rounding against torch's at the cases that tell rounding modes apart:
    halfway values (to even, both ways), just above halfway, infinities, the largest finite
    fp32 (rounds to inf), subnormals. The update is made a no-op (lr 0, moments 0)."""
    from epoverlap.kernels.adamw_triton import adamw_flat_triton

    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0xBF818000, 0x7F800000,
                         0xFF800000, 0x7F7FFFFF, 0x00018000, 0x3F80FFFF, 0x00000000],
                        dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32).to(triton_device)
    n = values.numel()
    zeros = torch.zeros(n, device=triton_device)
    param = torch.zeros(n, dtype=torch.bfloat16, device=triton_device)
    layout = decay_layout([], n, 16, torch.device(triton_device))
    master = values.clone()
    adamw_flat_triton(master, zeros, zeros.clone(), zeros.clone(), param, layout,
                      adam_scalars(0.0, WD, *BETAS, EPS, 1.0))
    assert torch.equal(master.view(torch.int32), values.view(torch.int32))
    assert torch.equal(param.view(torch.int16), values.bfloat16().view(torch.int16))


_SM90_SCRIPT = """
import json, sys
sys.path.insert(0, "tests/kernels")
import sm90_compile
records, context = [], {}
sm90_compile._install_fake_driver(records, context)
import torch
from epoverlap.kernels.adamw import adam_scalars, decay_layout
from epoverlap.kernels.adamw_triton import adamw_flat_triton
n = (1 << 16) + 3  # whole windows, and a last partial one
layout = decay_layout([(0, 1000)], n, 4096, torch.device("cpu"))
for param in (torch.zeros(n, dtype=torch.bfloat16), None):
    context["shape"] = "bf16 param" if param is not None else "fp32 only"
    adamw_flat_triton(*[torch.zeros(n) for _ in range(4)], param, layout,
                      adam_scalars(1e-3, 0.1, 0.9, 0.95, 1e-8, 1.0))
print(json.dumps(records))
"""


@pytest.mark.skipif(not INTERPRETED, reason="a GPU compiles the kernel for real")
def test_the_kernel_compiles_for_sm90_to_ieee_operations_and_16_byte_accesses():
    """sm_90 PTX of the launch configs, an n not divisible by 16: no spills, no fp32 fma (the
    contraction is off, so each operation rounds as the torch form's) and no approximate
    division or square root; the whole windows' launch has 16-byte loads of the four fp32
    streams (and the flags) and 16-byte stores of three (and of the bf16 parameter), at most
    128 registers a thread; the one program of the partial window masks (no vectors there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(r["shape"] for r in records) == ["bf16 param"] * 2 + ["fp32 only"] * 2
    for r in records:
        assert r["local_bytes"] == 0 and r["fp32_fmas"] == 0 and r["approx_ops"] == 0, r
    whole = {r["shape"]: r for r in records if r["v4_loads"]}
    assert set(whole) == {"bf16 param", "fp32 only"}, records
    for shape, r in whole.items():
        assert r["v4_loads"] >= 16 and r["v4_stores"] >= 12 and r["regs"] <= 128, r
    assert whole["bf16 param"]["v4_stores"] >= 14
