"""benchmarks/harness/peer_torchtitan.py (needs torchtitan, the peer extra; skipped without it):
torchtitan's model as the tool builds it from our config has our parameter count, tensor for
tensor kind; one forward on the CPU; its refusals; its training step with its all-to-all
dispatch on two CPU ranks (slow)."""

from __future__ import annotations

import math

import pytest
import torch

from epoverlap.config import parse_config
from epoverlap.model.transformer import count_parameters
from benchmarks.harness import peer_torchtitan
from benchmarks.harness.bench_overlap import SHAPES

from dist_helpers import one_process_model, run_ranks
from peer_workers import torchtitan_cpu_steps

pytestmark = pytest.mark.skipif(
    not peer_torchtitan.torchtitan_installed(),
    reason="torchtitan is not installed (pip install -e '.[peer]', Python >= 3.11)")
# torch 2.11 (the GPU machines) lacks the FSDP API torchtitan 0.3.0 imports: its model package
# does not import there and every mode is refused by name, which is all that is checked there
TORCH_PROBLEM = peer_torchtitan.torch_problem()
needs_its_torch = pytest.mark.skipif(TORCH_PROBLEM is not None, reason=str(TORCH_PROBLEM))

# grouped-query attention, a dense layer, a shared expert: every part the translation maps
VARIED = SHAPES["quick"] + ["--num-query-groups", "2", "--moe-layer-freq", "[0,1]",
                            "--moe-shared-expert-intermediate-size", "128",
                            "--ffn-hidden-size", "384", "--moe-router-force-load-balancing"]


def _theirs_and_ours(flags):
    cfg = parse_config(flags).with_vocab_size(300)
    theirs = peer_torchtitan.build_local(cfg)
    ours = one_process_model(cfg, "torch", torch.float32, "cpu")[0]
    return cfg, theirs, ours


@needs_its_torch
@pytest.mark.parametrize("flags", [SHAPES["quick"], VARIED], ids=["quick", "varied"])
def test_same_parameter_count_as_ours(flags):
    """Untied embeddings on both sides, no QK norm: the same elements in all but our
    vocabulary's padding rows (torchtitan does not pad; the embedding's and head's 300 -> 384),
    and in the routed experts."""
    cfg, theirs, ours = _theirs_and_ours(flags)
    counts = count_parameters(ours, 1)
    padding = 2 * (cfg.model.padded_vocab_size - cfg.model.vocab_size) * cfg.model.hidden_size
    assert padding == 2 * 84 * cfg.model.hidden_size
    assert peer_torchtitan.count_parameters(theirs) == \
        counts["dense"] + counts["expert_local"] - padding
    routed = sum(p.numel() for name, p in theirs.named_parameters() if "inner_experts" in name)
    assert routed == counts["expert_local"]
    moe = cfg.moe
    assert routed == moe.num_experts * 3 * cfg.model.hidden_size * moe.moe_ffn_hidden_size \
        * sum(cfg.moe_layer_pattern())


@needs_its_torch
def test_one_forward_on_cpu():
    """The causal SDPA decoder with forced balanced routing: logits of every position, about
    uniform at init (cross-entropy near ln V)."""
    cfg, theirs, _ = _theirs_and_ours(VARIED)
    tokens = torch.randint(0, 300, (2, cfg.model.seq_length), generator=torch.Generator()
                           .manual_seed(0))
    with torch.no_grad():
        logits = theirs(tokens)
    assert logits.shape == (2, cfg.model.seq_length, 300) and torch.isfinite(logits).all()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    assert abs(float(loss) - math.log(300)) < 0.5
    router = theirs.layers["1"].moe.router
    assert router._debug_force_load_balance and router.top_k == cfg.moe.moe_router_topk


@needs_its_torch
def test_refusals_are_torchtitans_own():
    cfg = parse_config(SHAPES["quick"]).with_vocab_size(256)
    assert "requires expert parallelism" in peer_torchtitan.refusal(cfg, 1, "masync", True)
    assert peer_torchtitan.refusal(cfg, 1, "a2a", True) is None
    assert peer_torchtitan.refusal(cfg, 2, "masync_compile", True) is None
    assert "CUDA only" in peer_torchtitan.refusal(cfg, 2, "a2a", False)
    assert "do not split" in peer_torchtitan.refusal(cfg, 3, "a2a", True)


def test_a_torch_without_its_fsdp_api_is_refused_by_name(monkeypatch):
    """torchtitan 0.3.0 imports FSDP names newer than some torch releases (2.11 on the GPU
    machines lacks both): every mode is refused, naming them, and its model is not built."""
    import torch.distributed.fsdp as fsdp
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    cfg = parse_config(SHAPES["quick"]).with_vocab_size(256)
    why = peer_torchtitan.refusal(cfg, 2, "a2a", True)
    assert "lacks DataParallelMeshDims" in why and torch.__version__ in why
    with pytest.raises(RuntimeError, match="lacks DataParallelMeshDims"):
        peer_torchtitan.build_local(cfg)


@needs_its_torch
@pytest.mark.slow
def test_all_to_all_training_on_two_cpu_ranks():
    """EP 2 over gloo, FSDP over both ranks: 3 steps of its step, the same mean loss on both
    ranks, near ln 256 on random tokens."""
    flags = SHAPES["quick"] + ["--moe-router-force-load-balancing", "--train-iters", "3"]
    first, second = run_ranks(torchtitan_cpu_steps, 2, flags, 3, timeout_s=300)
    assert first == second and len(first) == 3
    assert all(abs(loss - math.log(256)) < 0.5 for loss in first)
