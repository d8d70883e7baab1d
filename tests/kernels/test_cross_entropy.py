"""Cross-entropy: the Triton kernel against the torch reference and an independent float64 one.

CPU tier (Triton interpreter, small shapes): fp32 / bf16 / fp16 logits, V below, at and past
one column step (multi-step walks forced with a small tile), several rows per program, ignored
rows, no counted row, a label past V, strided logits, a padded vocabulary (columns past the
real V out of the softmax: the unpadded loss's bits, zero grads), determinism, no host reads,
the ops table, the model's loss through it, and an offline sm_90 compile (no spills). GPU tier
(`-m gpu`): vocabularies of real tokenizers, the same comparisons, determinism, no sync,
CUDA-graph capture.

Shape legend: T rows, V vocabulary, N the logits' columns (V plus padding).
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels import cross_entropy_triton as ce_module
from epoverlap.kernels import make_moe_ops, reference
from epoverlap.kernels.cross_entropy import IGNORE_INDEX, cross_entropy_torch
from epoverlap.kernels.cross_entropy_triton import (FUSED_MIN_VOCAB, cross_entropy_triton,
                                                    fused_cross_entropy)

from kernel_test_utils import (INTERPRETED, assert_same_run, eager_then_graph_replay,
                               forbid_host_reads, generator)

REPO = Path(__file__).resolve().parents[2]
ON_GPU = torch.cuda.is_available() and not INTERPRETED
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (kernels compiled)")
HALF_EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
# the smallest step of each dtype near zero: grads of unlikely tokens are subnormal in fp16
TINY_STEP = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.float16: 2.0 ** -24}


def _inputs(rows, vocab, dtype, device, seed=0, ignored=0, scale=4.0):
    """Logits [T, V] (spread wide enough that rows differ), labels [T] with the first
    `ignored` rows IGNORE_INDEX."""
    logits = (torch.randn(rows, vocab, generator=generator(seed)) * scale).to(device, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=generator(seed + 1)).to(device)
    labels[:ignored] = IGNORE_INDEX
    return logits, labels


def _run(fn, logits, labels, grad_scale=1.0, **vocab):
    """loss and the logits' grad (backward of grad_scale * loss)."""
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf, labels, **vocab)
    (loss * grad_scale).backward()
    return loss.detach(), leaf.grad


def _float64_reference(logits, labels):
    """Written from the definition, not through torch's loss: mean over counted rows of
    log(sum exp x) - x[label], and its grad softmax - onehot over the count."""
    x = logits.detach().double().cpu()
    lab = labels.cpu()
    counted = lab != IGNORE_INDEX
    shift = x.max(dim=1, keepdim=True).values
    lse = shift.squeeze(1) + (x - shift).exp().sum(dim=1).log()
    safe = torch.where(counted, lab, 0)
    row_loss = lse - x.gather(1, safe.unsqueeze(1)).squeeze(1)
    count = counted.sum()
    loss = (row_loss * counted).sum() / count
    grad = (x - lse.unsqueeze(1)).exp()
    grad[torch.arange(len(lab)), safe] -= 1.0
    grad = grad * counted.unsqueeze(1) / count
    return loss, grad


def _check(out, ref, dtype, what):
    """loss to fp32 rounding of a T-long sum; grad to one rounding of the logits' dtype plus
    fp32 cancellation relative to the largest entry (softmax - onehot)."""
    loss, grad = out
    ref_loss, ref_grad = ref
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert grad.dtype == dtype and grad.shape == ref_grad.shape
    torch.testing.assert_close(loss.double().cpu(), ref_loss.double().cpu(), rtol=1e-5,
                               atol=1e-6, msg=lambda m: f"{what} loss: {m}")
    big = float(ref_grad.abs().max())
    ulps = 1 if dtype == torch.float32 else 1 + (1 if INTERPRETED else 0)
    rtol = ulps * HALF_EPS[dtype] if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(grad.double().cpu(), ref_grad.double().cpu(), rtol=rtol,
                               atol=max(1e-5 * big, TINY_STEP[dtype]) + 1e-30,
                               msg=lambda m: f"{what} grad: {m}")


@pytest.fixture
def small_tile(monkeypatch):
    """Tiles of at most 64 logits: V 100 walks 2 column steps, V 257 5 (the online max / sum
    across steps), small V keeps several rows per program."""
    monkeypatch.setattr(ce_module, "TILE_ELEMENTS", 64)
    ce_module.cross_entropy_tile.cache_clear()
    yield
    ce_module.cross_entropy_tile.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(37, 257), (5, 100), (64, 16), (1, 3)])
def test_cross_entropy_matches_both_references(triton_device, small_tile, dtype, rows, vocab):
    logits, labels = _inputs(rows, vocab, dtype, triton_device, ignored=min(2, rows - 1))
    out = _run(fused_cross_entropy, logits, labels)
    _check(out, _run(cross_entropy_torch, logits, labels), dtype, "torch reference")
    _check(out, _float64_reference(logits, labels), dtype, "float64 reference")


def test_cross_entropy_default_tiles(triton_device):
    """The tiles real runs use: V 257 in one step, 8 rows per program; V 5000 in two steps."""
    assert ce_module.cross_entropy_tile(257) == (8, 512, 8)
    assert ce_module.cross_entropy_tile(151936) == (1, 4096, 8)
    for rows, vocab in [(19, 257), (3, 5000)]:
        logits, labels = _inputs(rows, vocab, torch.bfloat16, triton_device, seed=3, ignored=1)
        _check(_run(fused_cross_entropy, logits, labels, grad_scale=0.5),
               _run(cross_entropy_torch, logits, labels, grad_scale=0.5), torch.bfloat16,
               f"V {vocab}")


def test_cross_entropy_strided_logits(triton_device):
    """Rows read in place from a slice of wider rows; a column-major view is copied first."""
    wide, labels = _inputs(9, 70, torch.float32, triton_device)
    for view in (lambda a: a[:, :50], lambda a: a.t().contiguous().t()[:, :50]):
        leaf_tr = wide.clone().requires_grad_()
        leaf_ref = wide.clone().requires_grad_()
        lab = labels.clamp(max=49)
        loss_tr = fused_cross_entropy(view(leaf_tr), lab)
        loss_ref = cross_entropy_torch(view(leaf_ref), lab)
        loss_tr.backward(), loss_ref.backward()
        torch.testing.assert_close(loss_tr, loss_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(leaf_tr.grad, leaf_ref.grad, rtol=1e-4, atol=1e-7)
        assert float(leaf_tr.grad[:, 50:].abs().sum()) == 0.0


def test_cross_entropy_edge_rows(triton_device):
    """No counted row: NaN loss (as torch's mean over nothing) and zero grads; a label past V:
    that row's loss is NaN (torch raises instead); no row at all: NaN."""
    logits, labels = _inputs(4, 10, torch.float32, triton_device)
    loss, grad = _run(fused_cross_entropy, logits, torch.full_like(labels, IGNORE_INDEX))
    assert torch.isnan(loss) and float(grad.abs().sum()) == 0.0
    bad = labels.clone()
    bad[2] = 10
    assert torch.isnan(fused_cross_entropy(logits, bad))
    bad[2] = -1
    assert torch.isnan(fused_cross_entropy(logits, bad))
    assert torch.isnan(fused_cross_entropy(logits[:0], labels[:0]))


def _padded(logits, columns, value):
    """`logits` [T, V] widened to [T, N] by columns of `value` (large: they would win the
    softmax if it read them)."""
    pad = torch.full((logits.shape[0], columns - logits.shape[1]), value, dtype=logits.dtype,
                     device=logits.device)
    return torch.cat([logits, pad], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab,columns", [(37, 257, 384), (5, 100, 128), (3, 7, 8)])
def test_padded_columns_are_out_of_the_softmax(triton_device, small_tile, dtype, rows, vocab,
                                               columns):
    """Logits with padding columns of 30 (each would take most of the probability) and the real
    V: the loss and the first V columns' grad are the unpadded logits' bits, both
    implementations (the kernel walks the same tiles, the reference softmaxes the same
    values); the padding columns' grad is exactly zero."""
    logits, labels = _inputs(rows, vocab, dtype, triton_device, ignored=min(2, rows - 1))
    wide = _padded(logits, columns, 30.0)
    for fn in (fused_cross_entropy, cross_entropy_torch, cross_entropy_triton):
        loss, grad = _run(fn, wide, labels, vocab=vocab)
        plain_loss, plain_grad = _run(fn, logits, labels)
        assert grad.shape == (rows, columns) and grad.dtype == dtype
        assert_same_run((loss, grad[:, :vocab]), (plain_loss, plain_grad), fn.__name__)
        assert torch.count_nonzero(grad[:, vocab:]) == 0
    _check(_run(fused_cross_entropy, wide, labels, vocab=vocab),
           _padded_grad(_float64_reference(logits, labels), columns), dtype, "float64 padded")
    # vocab = N (or None) reads every column: the padding then dominates the loss
    assert _run(fused_cross_entropy, wide, labels, vocab=columns)[0] > 20


def _padded_grad(reference, columns):
    loss, grad = reference
    return loss, _padded(grad, columns, 0.0)


def test_padded_vocabulary_chooses_the_kernel_by_the_real_vocabulary(triton_device,
                                                                     monkeypatch):
    """The table's op picks the fused kernels or the reference by the real V, not the padded
    columns: a padded run takes its unpadded twin's path (and bits)."""
    monkeypatch.setattr(ce_module, "FUSED_MIN_VOCAB", 64)
    fused_calls = []
    real_apply = ce_module._CrossEntropyTriton.apply
    monkeypatch.setattr(ce_module._CrossEntropyTriton, "apply",
                        lambda *a: fused_calls.append(a[-1]) or real_apply(*a))
    logits, labels = _inputs(6, 63, torch.float32, triton_device)
    _run(cross_entropy_triton, _padded(logits, 128, 0.0), labels, vocab=63)
    assert fused_calls == []
    logits, labels = _inputs(6, 65, torch.float32, triton_device)
    _run(cross_entropy_triton, _padded(logits, 128, 0.0), labels, vocab=65)
    assert fused_calls == [65]


def test_a_label_in_the_padding_is_nan(triton_device):
    """A label in [V, N) is outside the vocabulary: NaN from the kernels (as past N), an error
    from the reference."""
    logits, labels = _inputs(4, 10, torch.float32, triton_device)
    bad = labels.clone()
    bad[1] = 12
    wide = _padded(logits, 16, 0.0)
    assert torch.isnan(fused_cross_entropy(wide, bad, vocab=10))
    with pytest.raises((IndexError, RuntimeError)):
        cross_entropy_torch(wide, bad, vocab=10)


def test_cross_entropy_refuses_bad_arguments(triton_device):
    logits, labels = _inputs(4, 10, torch.float32, triton_device)
    for fn in (fused_cross_entropy, cross_entropy_torch):
        for vocab in (0, 11):
            with pytest.raises(ValueError, match=rf"vocab {vocab}: must be in \[1, 10\]"):
                fn(logits, labels, vocab=vocab)
        with pytest.raises(ValueError, match=r"logits shape \(40,\): must be \[T, V\]"):
            fn(logits.reshape(-1), labels)
        with pytest.raises(ValueError, match=r"labels shape \(3,\): must be \(4,\)"):
            fn(logits, labels[:3])
        with pytest.raises(ValueError, match="labels dtype torch.int32"):
            fn(logits, labels.int())


def test_cross_entropy_deterministic_and_no_host_reads(triton_device, small_tile):
    logits, labels = _inputs(70, 257, torch.bfloat16, triton_device, seed=5, ignored=3)
    with forbid_host_reads() as violations:
        first = _run(fused_cross_entropy, logits, labels)
    assert violations == []
    assert_same_run(first, _run(fused_cross_entropy, logits, labels), "cross_entropy")


def test_table_op_fuses_from_the_threshold_vocabulary(triton_device, monkeypatch):
    """Below FUSED_MIN_VOCAB the table's op is the reference (same bits), from it the kernels
    (a launch of the fused forward counted)."""
    assert FUSED_MIN_VOCAB == 4096
    monkeypatch.setattr(ce_module, "FUSED_MIN_VOCAB", 64)
    fused_calls = []
    real_apply = ce_module._CrossEntropyTriton.apply
    monkeypatch.setattr(ce_module._CrossEntropyTriton, "apply",
                        lambda *a: fused_calls.append(1) or real_apply(*a))
    small, small_labels = _inputs(6, 63, torch.float32, triton_device)
    assert_same_run(_run(cross_entropy_triton, small, small_labels),
                    _run(cross_entropy_torch, small, small_labels), "below the threshold")
    assert fused_calls == []
    big, big_labels = _inputs(6, 64, torch.float32, triton_device)
    assert_same_run(_run(cross_entropy_triton, big, big_labels),
                    _run(fused_cross_entropy, big, big_labels), "at the threshold")
    assert fused_calls == [1, 1]


def test_ops_table_and_the_model_loss(triton_device):
    """Both backends serve `cross_entropy`; the model's loss node calls the table's op."""
    from epoverlap.config import parse_config
    from epoverlap.model.transformer import MoEModel
    from epoverlap.parallel.comm import ExpertComm

    assert make_moe_ops("torch").cross_entropy is reference.cross_entropy
    assert make_moe_ops("triton").cross_entropy is cross_entropy_triton
    calls = []
    ops = make_moe_ops("torch")
    counting = dataclasses.replace(
        ops, cross_entropy=lambda *a, **k: calls.append(k) or cross_entropy_torch(*a, **k))
    cfg = parse_config(["--preset", "tiny"]).with_vocab_size(300)  # padded to 384
    model = MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                     ExpertComm(None, 1), 0, counting, dtype=torch.float32,
                     device=torch.device("cpu"))
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length))
    loss = model(tokens, tokens)
    assert calls == [{"vocab": 300}] and loss.dtype == torch.float32
    assert model.head.shape[0] == model.embedding.shape[0] == 384


_SM90_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests/kernels")
import sm90_compile
records, context = [], {}
sm90_compile._install_fake_driver(records, context)
import torch
from epoverlap.kernels.cross_entropy_triton import fused_cross_entropy
for dtype in (torch.bfloat16, torch.float32):
    for vocab, columns in ((257, 257), (32000, 32000), (151936, 151936), (151937, 152064)):
        context["shape"] = f"V{vocab}-N{columns}-{str(dtype).split('.')[-1]}"
        logits = torch.randn(16, columns, dtype=dtype, requires_grad=True)
        fused_cross_entropy(logits, torch.randint(0, vocab, (16,)), vocab=vocab).backward()
print(json.dumps(records))
"""


@pytest.mark.skipif(not INTERPRETED, reason="a GPU compiles the kernels for real")
def test_cross_entropy_kernels_compile_for_sm90():
    """The three kernels at real vocabularies compile for sm_90 without spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in records} == {"_ce_fwd_kernel", "_ce_mean_kernel",
                                              "_ce_bwd_kernel"}
    assert all(r["local_bytes"] == 0 for r in records), [r for r in records if r["local_bytes"]]


# ----------------------------------------------------------------------------- GPU tier

CE_GRID = [(16384, 257, torch.bfloat16), (8192, 32000, torch.bfloat16),
           (4096, 151936, torch.bfloat16), (4096, 50257, torch.float16),
           (2048, 32000, torch.float32), (1000, 1000, torch.bfloat16)]


@pytest.mark.parametrize("rows,vocab,dtype", CE_GRID)
@pytest.mark.gpu
@needs_gpu
def test_gpu_cross_entropy(rows, vocab, dtype):
    logits, labels = _inputs(rows, vocab, dtype, "cuda", seed=rows, ignored=7)
    out = _run(fused_cross_entropy, logits, labels)
    _check(out, _run(cross_entropy_torch, logits, labels), dtype, "torch reference")
    _check(out, _float64_reference(logits, labels), dtype, "float64 reference")
    assert_same_run(out, _run(fused_cross_entropy, logits, labels), "rerun")


@pytest.mark.gpu
@needs_gpu
def test_gpu_padded_vocabulary():
    """NullTokenizer's 151937 padded to 152064 columns: the unpadded loss's bits, the real
    columns' grads within an fp32 rounding (the kernel is compiled for another row stride:
    152064 is a multiple of 16, 151937 is not, and on an H200 6868 of 622M grads differed by
    at most 4e-9), zero grads on the padding."""
    logits, labels = _inputs(4096, 151937, torch.bfloat16, "cuda", seed=9, ignored=7)
    wide = _padded(logits, 152064, 30.0)
    loss, grad = _run(fused_cross_entropy, wide, labels, vocab=151937)
    ref_loss, ref_grad = _run(fused_cross_entropy, logits, labels)
    assert_same_run((loss,), (ref_loss,), "padded loss")
    torch.testing.assert_close(grad[:, :151937].float(), ref_grad.float(), rtol=1e-5, atol=1e-8)
    assert torch.count_nonzero(grad[:, 151937:]) == 0


@pytest.mark.gpu
@needs_gpu
def test_gpu_cross_entropy_no_sync_and_graph_capture():
    logits, labels = _inputs(2048, 32000, torch.bfloat16, "cuda", seed=4, ignored=5)
    leaf = logits.clone().requires_grad_()

    def step():  # (the loss detached: a live graph would keep the leaf's grad node on its stream)
        loss = fused_cross_entropy(leaf, labels)
        return (loss.detach(),) + torch.autograd.grad(loss, [leaf])

    eager, captured = eager_then_graph_replay(step)
    assert_same_run(captured, eager, "graph replay")
