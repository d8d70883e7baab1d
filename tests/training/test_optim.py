"""The optimizer's four AdamW forms (`epoverlap.training.optimizer.optim.ADAM_IMPLS`): each the same
update to rounding, each reproducible, each independent of how parameters are grouped (so a
checkpoint reshards bitwise), and the bf16 parameters written from their masters exactly as a
per-tensor copy would; the flat form's buffers and views, and the flat form with its Triton
kernel (the interpreter on CPU) against torch's single-tensor AdamW over grad buffers; the
global grad norm and clipping before them. CPU always; the same on a GPU (marker `gpu`)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from epoverlap.config import parse_config
from epoverlap.training.optimizer.grads import clip_factor
from epoverlap.training.optimizer.optim import ADAM_IMPLS, MixedPrecisionAdamW, default_adam_impl

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])]


def _model(device: str, dtype, shapes=((64, 32), (32,), (8, 16, 4))) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Module()
    for i, shape in enumerate(shapes):
        param = nn.Parameter(torch.randn(shape, generator=gen).to(device, dtype))
        param.main_grad = torch.zeros(shape, dtype=torch.float32, device=device)
        model.register_parameter(f"p{i}", param)
    return model


def _train(model: nn.Module, impl: str, steps: int = 4) -> list[torch.Tensor]:
    """`steps` AdamW steps of fixed grads; the fp32 masters after them."""
    cfg = parse_config(["--weight-decay", "0.1"]).train
    optimizer = MixedPrecisionAdamW(model, cfg, impl)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        for param in optimizer.params:
            param.main_grad.copy_(torch.randn(param.shape, generator=gen))
        optimizer.step(1e-2 / step)
    return [m.detach().clone() for m in optimizer.masters]


@pytest.mark.parametrize("device", DEVICES)
def test_each_adamw_form_is_the_same_update_and_reproducible(device):
    reference = _train(_model(device, torch.float32), "single")
    for impl in ADAM_IMPLS:
        first = _train(_model(device, torch.float32), impl)
        again = _train(_model(device, torch.float32), impl)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), impl
        for got, want in zip(first, reference):
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-7)
    moved = _train(_model(device, torch.float32), "single", steps=1)
    start = _model(device, torch.float32)
    assert not any(torch.equal(m, p) for m, p in zip(moved, start.parameters()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ADAM_IMPLS)
def test_grouping_the_parameters_otherwise_changes_no_bit(device, impl):
    """One [8, 16, 4] expert weight, or its two [4, 16, 4] halves as at EP 2 (a resharded
    checkpoint), under the same grads: the same bits either way."""
    cfg = parse_config(["--weight-decay", "0.1"]).train
    whole = _model(device, torch.float32, ((64, 32), (8, 16, 4)))
    halves = _model(device, torch.float32, ((64, 32), (4, 16, 4), (4, 16, 4)))
    with torch.no_grad():
        halves.p0.copy_(whole.p0)
        halves.p1.copy_(whole.p1[:4])
        halves.p2.copy_(whole.p1[4:])
    opt_whole = MixedPrecisionAdamW(whole, cfg, impl)
    opt_halves = MixedPrecisionAdamW(halves, cfg, impl)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        grad_0, grad_1 = (torch.randn(p.shape, generator=gen) for p in opt_whole.params)
        whole.p0.main_grad.copy_(grad_0)
        whole.p1.main_grad.copy_(grad_1)
        halves.p0.main_grad.copy_(grad_0)
        halves.p1.main_grad.copy_(grad_1[:4])
        halves.p2.main_grad.copy_(grad_1[4:])
        opt_whole.step(1e-2 / step)
        opt_halves.step(1e-2 / step)
    assert torch.equal(opt_whole.masters[0], opt_halves.masters[0])
    assert torch.equal(opt_whole.masters[1], torch.cat(opt_halves.masters[1:]))
    assert not torch.equal(opt_whole.masters[1], _model(device, torch.float32,
                                                        ((64, 32), (8, 16, 4))).p1)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_parameters_are_their_masters_rounded_as_a_copy_would(device):
    model = _model(device, torch.bfloat16)
    optimizer = MixedPrecisionAdamW(model, parse_config([]).train)
    for master in optimizer.masters:
        master.add_(torch.rand_like(master) * 1e-2)
    optimizer.copy_masters_to_params()
    for param, master in zip(optimizer.params, optimizer.masters):
        assert param.dtype == torch.bfloat16 and torch.equal(param, master.to(torch.bfloat16))


def test_the_default_form_is_flat_on_gpus_and_single_on_cpus(monkeypatch):
    from epoverlap.training.optimizer import optim

    monkeypatch.setattr(optim, "triton_installed", lambda: True)
    assert default_adam_impl(torch.device("cuda", 0)) == "flat"
    monkeypatch.setattr(optim, "triton_installed", lambda: False)
    assert default_adam_impl(torch.device("cuda", 0)) == "fused"  # torch's, without Triton
    assert default_adam_impl(torch.device("cpu")) == "single"
    with pytest.raises(ValueError, match="one of"):
        MixedPrecisionAdamW(_model("cpu", torch.float32), parse_config([]).train, "apex")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ADAM_IMPLS)
def test_created_state_is_the_state_a_first_step_makes(device, impl):
    """`create_state` (before a checkpoint loads into it) matches what a step creates, the
    step count's device included (the fused form keeps it beside the parameter)."""
    stepped = MixedPrecisionAdamW(_model(device, torch.float32), parse_config([]).train, impl)
    stepped.step(0.0)
    created = MixedPrecisionAdamW(_model(device, torch.float32), parse_config([]).train, impl)
    created.create_state()
    for a, b in zip(stepped.masters, created.masters):
        for key, value in stepped.state_of(a).items():
            other = created.state_of(b)[key]
            assert (value.device, value.dtype, value.shape) == (other.device, other.dtype,
                                                                other.shape), key


def test_bench_optim_times_every_form_on_cpu():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness.bench_optim", "--preset", "tiny",
         "--device", "cpu", "--rounds", "2", "--iters", "1"],
        capture_output=True, text=True, timeout=300,
        cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines()
            if line.split("|")[1:2] and line.split("|")[1].strip() in ADAM_IMPLS]
    assert [row.split("|")[1].strip() for row in rows] == list(ADAM_IMPLS), result.stdout
    assert rows[-1].rstrip().endswith("| 0 |")  # single against itself


def test_bench_optim_times_each_flat_config_with_the_same_bits_on_cpu():
    """--flat-configs: a row per config, a repeated one numbered, every one's masters equal to
    the first's after 3 steps (the block changes no bit)."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness.bench_optim", "--preset", "tiny",
         "--device", "cpu", "--rounds", "1", "--iters", "1", "--flat-configs",
         "256x4,1024x4,256x4"],
        capture_output=True, text=True, timeout=300,
        cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| flat ")]
    assert [row.split("|")[1].strip() for row in rows] == [
        "flat 256x4", "flat 1024x4", "flat 256x4 (2)"], result.stdout
    assert all(row.rstrip().endswith("| 0 |") for row in rows), result.stdout


def _clip_in_place(grads, max_norm: float) -> float:
    """The clip as the step applied it before the optimizer took its factor: the grad buffers
    scaled in place. -> the norm before."""
    norm = grads.global_norm()
    factor = clip_factor(norm, max_norm)
    if factor != 1.0:
        grads.dense_flat.mul_(factor)
        grads.expert_flat.mul_(factor)
    return norm


def test_global_grad_norm_is_the_norm_of_every_grad_and_clipping_reaches_the_limit():
    from dist_helpers import single_rank_groups
    from epoverlap.training.optimizer.grads import GradBuffers

    model = _model("cpu", torch.float32)
    model.p2.is_expert = True  # an expert shard: counted in the expert slots
    grads = GradBuffers(model, single_rank_groups())
    gen = torch.Generator().manual_seed(2)
    for param in grads.params:
        param.main_grad.copy_(torch.randn(param.shape, generator=gen))
    want = math.sqrt(sum(float(p.main_grad.double().pow(2).sum()) for p in grads.params))
    assert grads.global_norm() == pytest.approx(want, rel=1e-6)
    # the norm before clipping
    assert _clip_in_place(grads, want / 4) == pytest.approx(want, rel=1e-6)
    assert grads.global_norm() == pytest.approx(want / 4, rel=1e-5)
    assert _clip_in_place(grads, 0.0) == pytest.approx(want / 4, rel=1e-5)  # 0: no clipping
    assert grads.global_norm() == pytest.approx(want / 4, rel=1e-5)


@pytest.mark.parametrize("impl", ["flat", "single", "foreach"])
def test_the_clip_factor_given_to_the_optimizer_is_the_old_in_place_clip_bit_for_bit(impl):
    """`clip_factor` + `step(lr, factor)` (the training step's order) against the grads
    scaled in place before `step(lr)`, over steps that clip and one that does not."""
    from dist_helpers import single_rank_groups
    from epoverlap.training.optimizer.grads import GradBuffers

    runs = []
    for deferred in (False, True):
        model, params = _buffered_model(torch.bfloat16)
        grads = GradBuffers(model, single_rank_groups())
        optimizer = MixedPrecisionAdamW(model, parse_config([]).train, impl)
        gen = torch.Generator().manual_seed(5)
        for step, limit in ((1, 0.5), (2, 1e6), (3, 0.25)):
            for param in params:
                param.main_grad.copy_(torch.randn(param.shape, generator=gen))
            if deferred:
                norm = grads.global_norm()
                factor = clip_factor(norm, limit)
                assert (factor == 1.0) == (step == 2)
                optimizer.step(1e-2, factor)
            else:
                _clip_in_place(grads, limit)
                optimizer.step(1e-2)
        runs.append([m.detach().clone() for m in optimizer.masters]
                    + [p.detach().clone() for p in params])
    for before, after in zip(*runs):
        assert torch.equal(before, after)


def _buffered_model(dtype) -> tuple[nn.Module, list]:
    """A model whose grads are `GradBuffers` views (a dense and an expert buffer), matrices and
    1-D parameters interleaved, one matrix fp32 whatever `dtype` (as a router kept in fp32);
    and its trainable parameters."""
    from dist_helpers import single_rank_groups
    from epoverlap.training.optimizer.grads import GradBuffers

    model = _model("cpu", dtype, ((64, 32), (600,), (8, 16, 4), (5,), (7, 3), (40,), (2, 9, 5)))
    model.p4.data = model.p4.data.float()
    model.p2.is_expert = model.p6.is_expert = True
    GradBuffers(model, single_rank_groups())
    return model, [p for p in model.parameters()]


def test_the_flat_form_makes_each_parameter_a_view_of_its_flat_buffers():
    model, params = _buffered_model(torch.bfloat16)
    before = [p.detach().clone() for p in params]
    optimizer = MixedPrecisionAdamW(model, parse_config([]).train, "flat")
    flat = optimizer.form
    assert len(flat.segments) == 2 and [s.start % 64 for s in flat.segments] == [0, 0]
    for param, value, master in zip(params, before, optimizer.masters):
        assert torch.equal(param, value) and torch.equal(master, value.float())
        own = flat.masters_flat if param.dtype == torch.float32 else flat.params_flat
        assert param.untyped_storage().data_ptr() == own.untyped_storage().data_ptr()
        assert (master is param) == (param.dtype == torch.float32)
        assert master.untyped_storage().data_ptr() == \
            flat.masters_flat.untyped_storage().data_ptr()
    assert optimizer.state_of(optimizer.masters[2]) == {}
    for param in params:
        param.main_grad.normal_()
    optimizer.step(1e-2)
    state = optimizer.state_of(optimizer.masters[2])
    assert state["exp_avg"].untyped_storage().data_ptr() == \
        flat.exp_avg_flat.untyped_storage().data_ptr()
    assert state["step"].shape == () and float(state["step"]) == 1.0
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(params, optimizer.masters))
    assert not torch.equal(params[0], before[0]) and not torch.equal(params[4], before[4])

    fp32, fp32_params = _buffered_model(torch.float32)
    optimizer = MixedPrecisionAdamW(fp32, parse_config([]).train, "flat")
    assert optimizer.form.params_flat is None
    assert all(m is p for m, p in zip(optimizer.masters, fp32_params))  # its own master
    assert fp32_params[0].untyped_storage().data_ptr() == \
        optimizer.form.masters_flat.untyped_storage().data_ptr()


def test_flat_form_with_its_kernel_against_torchs_single_tensor_adamw(monkeypatch):
    """The flat form as a GPU runs it (the Triton kernel, interpreted), windows of 256 values
    so that windows decay, do not and mix, against `single` (torch's single-tensor AdamW), from
    the same bf16 start and grads, 5 steps: Adam's moments bitwise, the masters within 2 fp32
    epsilons of |master| + lr (torch's CPU square root is MKL's: `kernels.adamw`), the step
    counts equal, and each bf16 parameter its master rounded to nearest even (the fp32 one its
    own master)."""
    from epoverlap.kernels import triton_unavailable_reason
    from epoverlap.training.optimizer import flat_adam

    if triton_unavailable_reason() is not None:
        pytest.skip(triton_unavailable_reason())
    from epoverlap.kernels.adamw_triton import adamw_flat_triton
    monkeypatch.setattr(flat_adam, "flat_update", lambda device: adamw_flat_triton)
    monkeypatch.setattr(flat_adam, "BLOCK", 256)
    cfg = parse_config(["--weight-decay", "0.1"]).train
    forms = {}
    for impl in ("flat", "single"):
        model, params = _buffered_model(torch.bfloat16)
        forms[impl] = (MixedPrecisionAdamW(model, cfg, impl), params)
    codes = torch.cat([s.decay.codes for s in forms["flat"][0].form.segments]).tolist()
    assert {-1, -2} <= set(codes) and max(codes) >= 0  # whole windows of each kind, and mixed
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 6):
        grads = [torch.randn(p.shape, generator=gen) for p in forms["flat"][1]]
        for optimizer, params in forms.values():
            for param, grad in zip(params, grads):
                param.main_grad.copy_(grad)
            optimizer.step(1e-2 / step)
    flat, single = forms["flat"][0], forms["single"][0]
    for a, b, param in zip(flat.masters, single.masters, forms["flat"][1]):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(flat.state_of(a)[key], single.state_of(b)[key]), key
        scale = torch.finfo(torch.float32).eps * (b.abs() + 1e-2)
        assert bool(((a - b).abs() <= 2 * scale).all())
        assert torch.equal(param, a.to(param.dtype))
