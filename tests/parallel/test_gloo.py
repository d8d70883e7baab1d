"""gloo multi-process tier (2 and 4 CPU ranks): dispatch round trip, EP=1 vs EP=2, routing
extremes under the overlap, and the bitwise overlap contract (grads and 20-step losses; a run
whose overlap probe switches schedules mid-run included; with the flat AdamW form and with
query/key norms too)."""

from __future__ import annotations

import json
import math

import pytest

from dist_helpers import run_ranks
from gloo_workers import (MODES, assert_modes_match_sequential, dispatch_round_trip, ep_losses,
                          extreme_routing_training, flat_adam_grads_and_losses,
                          mode_grads_and_losses)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world, ep, topk, extreme", [
    (2, 2, 2, False), (2, 2, 1, False), (4, 4, 3, False), (4, 2, 2, False),
    (2, 2, 2, True), (4, 4, 1, True),
])
def test_dispatch_then_combine_with_identity_experts_returns_the_input(world, ep, topk,
                                                                       extreme):
    results = run_ranks(dispatch_round_trip, world, ep, topk, extreme)
    assert all(exact for exact, _ in results)
    if extreme:  # experts 0..k-1 live on EP rank 0: the other EP ranks receive nothing
        received = [rows for _, rows in results]
        assert all(received[r] == 0 for r in range(world) if r % ep != 0)


def test_ep2_matches_ep1_to_float32_rounding():
    ep1 = run_ranks(ep_losses, 2, 1, 3)[0]
    ep2 = run_ranks(ep_losses, 2, 2, 3)[0]
    assert all(math.isfinite(x) for x in ep1 + ep2)
    for a, b in zip(ep1, ep2):
        assert abs(a - b) <= 1e-5 * abs(a), (ep1, ep2)


@pytest.mark.parametrize("flags", [["--no-overlap-moe-expert-parallel-comm"],
                                   ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]])
def test_routing_extremes_train_without_hanging(flags):
    results = run_ranks(extreme_routing_training, 2, 2, flags, timeout_s=180)
    for losses, counts in results:
        assert all(math.isfinite(x) for x in losses)
        assert counts[2:] == [0, 0]  # the experts of EP rank 1 got no token


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2)])
def test_overlap_is_bitwise_equal_to_sequential(world, ep, tmp_path):
    results = run_ranks(mode_grads_and_losses, world, ep, str(tmp_path), 20, timeout_s=600)
    assert_modes_match_sequential(results, tmp_path, 20)
    # the probe's run switched schedules mid-run (same losses as above), then kept one
    with open(tmp_path / "probe_wgrad.jsonl") as records:
        paths = [json.loads(line)["path"] for line in records]
    assert paths[:7] == ["combined_1f1b"] + ["combined_1f1b", "sequential"] * 3
    assert len(set(paths[7:])) == 1, paths


def test_overlap_is_bitwise_equal_to_sequential_with_query_key_norms(tmp_path):
    """--qk-layernorm (Qwen3's query/key RMSNorms, inside the attn node): the overlap with
    delayed weight grads gives the sequential grads and losses bit for bit."""
    modes = {name: MODES[name] for name in ("sequential", "overlap_wgrad")}
    results = run_ranks(mode_grads_and_losses, 2, 2, str(tmp_path), 4, ["--qk-layernorm"],
                        modes, timeout_s=600)
    assert_modes_match_sequential(results, tmp_path, 4, modes)


def test_overlap_is_bitwise_equal_to_sequential_with_the_flat_adamw(tmp_path):
    """The same with the flat AdamW form (its torch form on CPU): the updates are the same
    elementwise function of the same grads in every mode."""
    modes = {name: MODES[name] for name in ("sequential", "overlap", "overlap_wgrad")}
    results = run_ranks(flat_adam_grads_and_losses, 2, 2, str(tmp_path), 6, modes,
                        timeout_s=600)
    assert_modes_match_sequential(results, tmp_path, 6, modes)


def test_overlap_is_bitwise_equal_to_sequential_with_the_scripts_attention_and_loss(tmp_path):
    """What Megatron-LM's MoE scripts ask for: bf16 on CPU, heads wider than hidden / heads
    (--kv-channels, Qwen3's) and the per-sequence aux loss (seq_aux_loss, DeepSeek-V3's): the
    overlap with delayed weight grads gives the sequential grads and losses bit for bit."""
    modes = {name: MODES[name] for name in ("sequential", "overlap_wgrad")}
    flags = ["--bf16", "--kv-channels", "64", "--moe-router-load-balancing-type",
             "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"]
    results = run_ranks(mode_grads_and_losses, 2, 2, str(tmp_path), 4, flags, modes,
                        timeout_s=600)
    assert_modes_match_sequential(results, tmp_path, 4, modes)
