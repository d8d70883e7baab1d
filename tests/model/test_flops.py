"""FLOP counts per token: Megatron-LM's formula (`megatron_flops_per_token`) against a hand
computation of `num_floating_point_operations` (megatron/training/training.py, core_v0.16.1),
and how epoverlap's own count (`training_flops_per_token`) differs from it (pure CPU)."""

from __future__ import annotations

import pytest
import torch

from epoverlap.config import parse_config
from epoverlap.model.flops import megatron_flops_per_token, training_flops_per_token
from epoverlap.training.telemetry.mfu import device_peak_tflops, mfu, peak_bf16_tflops

TOP2 = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "128",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128"]
SHARED = ["--num-layers", "3", "--hidden-size", "256", "--ffn-hidden-size", "512",
          "--num-attention-heads", "8", "--num-query-groups", "2", "--seq-length", "64",
          "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
          "--moe-shared-expert-intermediate-size", "128", "--moe-first-k-dense-replace", "1"]


def test_megatron_formula_two_moe_layers_gqa():
    # H 128, S 128, 4 query heads / 2 KV groups of 32: query 128, key = value 64 wide
    attention = 128 * (128 + 64 + 64) + 128 * 128 / 2 * 2 + 128 * 128  # qkv, core, out
    moe = 128 * 3 * (2 * 128)  # H x SwiGLU 3 x top-2 x expert FFN 128; no shared expert
    logits = 128 * 256
    expected = 3 * 2 * (2 * moe + 2 * attention + logits)
    assert expected == 2162688
    cfg = parse_config(TOP2)
    assert megatron_flops_per_token(cfg.model, cfg.moe) == expected


def test_megatron_formula_shared_expert_dense_first_layer():
    cfg = parse_config(SHARED).with_vocab_size(1000)
    # H 256, S 64, 8 query heads / 2 KV groups of 32: query 256, key = value 64 wide
    attention = 256 * (256 + 64 + 64) + 256 * 64 / 2 * 2 + 256 * 256
    dense = 256 * 3 * 512  # layer 0 (first-k-dense 1): SwiGLU FFN 512
    moe = 256 * 3 * (2 * 64 + 128)  # layers 1-2: top-2 x 64 + shared 128
    logits = 256 * 1024  # Megatron-LM's padded_vocab_size: 1000 rounded up to 8 x 128
    expected = 3 * 2 * (dense + 2 * moe + 3 * attention + logits)
    assert expected == 9535488
    assert megatron_flops_per_token(cfg.model, cfg.moe) == expected


@pytest.mark.parametrize("count", [megatron_flops_per_token, training_flops_per_token])
def test_logits_count_the_padded_vocabulary(count):
    """Both counts take the logit GEMM over the padded rows (--make-vocab-size-divisible-by),
    as Megatron-LM counts its padded_vocab_size: 6 H per padding row per token."""
    padded = parse_config(SHARED).with_vocab_size(1000)
    unpadded = parse_config(SHARED + ["--make-vocab-size-divisible-by", "1"]
                            ).with_vocab_size(1000)
    assert count(padded.model, padded.moe) - count(unpadded.model, unpadded.moe) == 3 * 2 * 256 * 24


@pytest.mark.parametrize("flags", [TOP2, SHARED])
def test_epoverlap_count_adds_the_router_only(flags):
    """`training_flops_per_token` counts the router GEMM (H x E per token, forward x 2 x 3),
    which Megatron-LM leaves out; attention (causal: half the scores) and the rest agree."""
    cfg = parse_config(flags)
    moe_layers = sum(cfg.moe_layer_pattern())
    router = 3 * 2 * cfg.model.hidden_size * cfg.moe.num_experts * moe_layers
    ours = training_flops_per_token(cfg.model, cfg.moe)
    assert ours - megatron_flops_per_token(cfg.model, cfg.moe) == router


@pytest.mark.parametrize("count", [megatron_flops_per_token, training_flops_per_token])
def test_query_key_norms_add_no_gemm_flops(count):
    """--qk-layernorm: elementwise, as Megatron-LM's formula counts it (not at all)."""
    normed = parse_config(TOP2 + ["--qk-layernorm"])
    plain = parse_config(TOP2)
    assert count(normed.model, normed.moe) == count(plain.model, plain.moe) > 0


def test_dense_model_counts_no_router():
    cfg = parse_config(TOP2 + ["--num-experts", "0"])
    ours = training_flops_per_token(cfg.model, cfg.moe)
    assert ours == megatron_flops_per_token(cfg.model, cfg.moe)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA L4", None),
    ("Tesla V100-SXM2-16GB", None)])
def test_peak_by_device_name(name, peak):
    assert peak_bf16_tflops(name) == peak


def test_no_mfu_on_cpu_fp32_or_unknown():
    assert device_peak_tflops(torch.device("cpu"), bf16=True) is None
    assert device_peak_tflops(torch.device("cuda", 0), bf16=False) is None
    assert mfu(400.0, None) is None
    assert mfu(494.5, 989.0) == pytest.approx(0.5)
