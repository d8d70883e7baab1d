"""The padded vocabulary (--make-vocab-size-divisible-by) trains the unpadded model: the same
initial real rows, padding rows zero that stay zero, the padding out of the softmax (large
padding weights change no bit of the loss), losses equal to fp32 rounding over a few steps;
a checkpoint written unpadded resumes into the padded model, the other way round is one line.

Measured here (fp32, CPU): every step's loss bit-identical over 4 steps; the weights drift
apart by ~1e-8 (fp32 rounding), since the hidden state's grad (dlogits @ head) sums over the
padded K = 384 columns instead of 300 and the BLAS kernel blocks them differently.

Shape legend: V the vocabulary (300 here: --vocab-size 299 + 1), P its padded rows (384).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from dist_helpers import single_rank_groups
from epoverlap.config import parse_config
from epoverlap.errors import CheckpointError
from epoverlap.kernels import make_moe_ops
from epoverlap.kernels.cross_entropy import cross_entropy_torch
from epoverlap.model.flops import unaligned_gemm_dims
from epoverlap.model.transformer import MoEModel
from epoverlap.parallel.comm import ExpertComm
from epoverlap.training.checkpoints.checkpoint_files import find_resume_checkpoint
from epoverlap.training.loop.trainer import Trainer

VOCAB, PADDED = 300, 384
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "48", "--moe-ffn-hidden-size", "24",
         "--num-experts", "4", "--moe-router-topk", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--num-microbatches", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
UNPADDED = ["--make-vocab-size-divisible-by", "1"]


def _model(extra=(), dtype=torch.float32) -> MoEModel:
    cfg = parse_config(FLAGS + list(extra)).with_vocab_size(VOCAB)
    return MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                    ExpertComm(None, 1), 0, make_moe_ops("torch"), dtype=dtype,
                    device=torch.device("cpu"))


def _batch():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2)]


def _loss_and_grads(model: MoEModel):
    tokens, labels = _batch()
    loss = model(tokens, labels)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_real_rows_start_as_the_unpadded_models(dtype):
    padded, plain = _model(dtype=dtype), _model(UNPADDED, dtype)
    assert padded.head.shape[0] == padded.embedding.shape[0] == PADDED
    for name in ("embedding", "head"):
        wide, narrow = getattr(padded, name), getattr(plain, name)
        assert wide.shape == (PADDED, 32) and narrow.shape == (VOCAB, 32)
        assert torch.equal(wide[:VOCAB], narrow), name
        assert torch.count_nonzero(wide[VOCAB:]) == 0, name
    others = [name for name, _ in plain.named_parameters() if name not in ("embedding", "head")]
    assert all(torch.equal(padded.get_parameter(n), plain.get_parameter(n)) for n in others)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_step_gives_the_unpadded_loss_and_grads(dtype):
    """The loss's bits; the real rows' and other grads to the dtype's rounding (fp32: the
    dgrad GEMM's longer K); the padding rows' grads exactly zero (the embedding's padding is
    never looked up, the head's is out of the softmax)."""
    loss, grads = _loss_and_grads(_model(dtype=dtype))
    plain_loss, plain_grads = _loss_and_grads(_model(UNPADDED, dtype))
    assert torch.equal(loss, plain_loss)
    for name in ("embedding", "head"):
        assert torch.count_nonzero(grads[name][VOCAB:]) == 0, name
    eps = torch.finfo(dtype).eps
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name][:grad.shape[0]], grad, rtol=4 * eps,
                                   atol=4 * eps * float(grad.abs().max()), msg=name)


def test_the_padding_never_wins_the_softmax():
    """Padding rows of the head set to 5 (logits far above the real ones) change no bit of the
    loss or of the real rows' grads, and get no grad themselves."""
    zero_loss, zero_grads = _loss_and_grads(_model())
    loud = _model()
    with torch.no_grad():
        loud.head[VOCAB:] = 5.0
    loss, grads = _loss_and_grads(loud)
    assert torch.equal(loss, zero_loss)
    assert torch.count_nonzero(grads["head"][VOCAB:]) == 0
    assert all(torch.equal(grads[name], zero_grads[name]) for name in grads)
    # a loss that read every column (no vocab given) would be ruled by those rows
    loud.ops = dataclasses.replace(loud.ops, cross_entropy=lambda logits, labels, vocab:
                                   cross_entropy_torch(logits, labels))
    with torch.no_grad():
        assert float(loud(*_batch())) > float(zero_loss) + 1


def _train(flags, steps, save=None, load=None, logs=None):
    extra = ["--train-iters", str(steps)] + (["--save", str(save)] if save else []) + \
        (["--load", str(load)] if load else [])
    trainer = Trainer(parse_config(flags + extra), single_rank_groups(),
                      log=(logs.append if logs is not None else lambda msg: None),
                      resume=find_resume_checkpoint(str(load), None) if load else None)
    try:
        results = trainer.train()
        params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    return results, params


def test_padded_and_unpadded_train_alike():
    padded, padded_params = _train(FLAGS, 4)
    plain, plain_params = _train(FLAGS + UNPADDED, 4)
    assert padded[0].loss == plain[0].loss  # the same weights, the same forward
    for a, b in zip(padded, plain, strict=True):
        assert math.isclose(a.loss, b.loss, rel_tol=1e-6), (a.step, a.loss, b.loss)
        assert math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-5), (a.step, a.grad_norm)
    for name, value in plain_params.items():
        wide = padded_params[name]
        torch.testing.assert_close(wide[:value.shape[0]], value, rtol=1e-5, atol=1e-6)
        assert torch.count_nonzero(wide[value.shape[0]:]) == 0, name  # zero grad, zero decay


def test_an_unpadded_checkpoint_resumes_into_the_padded_model(tmp_path):
    """A checkpoint of the unpadded shapes, its meta.json without the flag (as one written
    before padding existed), loads into the first V rows (weights and Adam's moments): the
    next step's loss is the unpadded run's own next step's."""
    plain, _ = _train(FLAGS + UNPADDED, 3)
    _train(FLAGS + UNPADDED, 2, save=tmp_path)
    meta_file = tmp_path / "iter_0000002" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["config"]["model"]["make_vocab_size_divisible_by"]
    meta_file.write_text(json.dumps(meta))
    logs: list[str] = []
    resumed, params = _train(FLAGS, 3, load=tmp_path, logs=logs)
    assert [r.step for r in resumed] == [3]
    assert math.isclose(resumed[0].loss, plain[2].loss, rel_tol=1e-6)
    assert torch.count_nonzero(params["head"][VOCAB:]) == 0
    assert any(f"its unpadded vocabulary of {VOCAB} rows loaded into the first of {PADDED} "
               "(--make-vocab-size-divisible-by 128), the padding rows zero" in line
               for line in logs), logs


def test_a_padded_checkpoint_into_an_unpadded_model_is_one_line(tmp_path):
    _train(FLAGS, 1, save=tmp_path)
    with pytest.raises(CheckpointError) as error:
        _train(FLAGS + UNPADDED, 2, load=tmp_path)
    text = str(error.value)
    assert "\n" not in text
    assert (f"written for another model: model/embedding is [{PADDED}, 32] there, "
            f"[{VOCAB}, 32] here (flags that differ: --make-vocab-size-divisible-by 128 -> 1)"
            in text)


def test_only_the_unpadded_vocabulary_is_unaligned_at_the_qwen3_proxy():
    """The Qwen3 proxy's every dimension is a multiple of 8 but its vocabulary 151937; padded
    (the default) it is 152064 and nothing is named."""
    cfg = parse_config(["--preset", "qwen3-30b-a3b-proxy"]).with_vocab_size(151937)
    assert unaligned_gemm_dims(cfg.model, cfg.moe) == []
    unpadded = parse_config(["--preset", "qwen3-30b-a3b-proxy"] + UNPADDED
                            ).with_vocab_size(151937)
    assert unaligned_gemm_dims(unpadded.model, unpadded.moe) == [
        ("vocabulary", 151937, "the data's tokenizer, padded to a multiple of "
                               "--make-vocab-size-divisible-by 1")]
    odd = parse_config(["--num-experts", "6", "--moe-ffn-hidden-size", "36",
                        "--moe-shared-expert-intermediate-size", "20", "--ffn-hidden-size",
                        "100", "--moe-first-k-dense-replace", "1"]).with_vocab_size(256)
    assert [what for what, _, _ in unaligned_gemm_dims(odd.model, odd.moe)] == [
        "FFN", "expert FFN", "router experts", "shared expert FFN"]
