"""Context parallelism on gloo ranks: the attention of CP 2 and 4 against a float64
single-rank reference (output and the grads of q, k, v), both K/V exchanges; CP 2 and 4
train to CP 1's losses (fp32 rounding) with either exchange; the overlap and delayed weight
grads stay bit-identical to the sequential schedule under CP; dynamic CP switches sizes
between microbatches and trains to the losses of each fixed size; per-layer graphs (emulated)
replay the eager bits at CP 2 with either exchange and under dynamic CP at every size, and
with per-document attention at CP 1 and 2."""

from __future__ import annotations

import pytest
import torch

from context_workers import (attention_against_reference, cp_checkpoint_run, cp_losses,
                             cp_pipeline_losses)
from dist_helpers import run_ranks
from gloo_workers import MODES, assert_modes_match_sequential, mode_grads_and_losses


def _assert_attention_matches(world: int, comm_type: str) -> None:
    for rank, values in enumerate(run_ranks(attention_against_reference, world, comm_type)):
        for name, (ours, reference) in values.items():
            assert ours.abs().max() > 0, (rank, name)
            assert (ours - reference).abs().max() < 1e-5, (rank, name)


@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_cp2_attention_and_its_grads_equal_a_single_rank_reference(comm_type):
    _assert_attention_matches(2, comm_type)


@pytest.mark.slow
@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_cp4_attention_and_its_grads_equal_a_single_rank_reference(comm_type):
    _assert_attention_matches(4, comm_type)


STEPS = ["--train-iters", "4"]


@pytest.fixture(scope="module")
def cp1_losses():
    """One rank, CP 1, EP 1: the same sequences a CP group of any size reads (DP 1)."""
    return run_ranks(cp_losses, 1, 1, 1, STEPS)[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("cp, ep", [(2, 2), (4, 2)])
@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_cp_trains_to_the_losses_of_cp1(cp1_losses, cp, ep, comm_type):
    """Aux loss on (TINY's): its tokens per expert are the whole sequence's under CP. The
    all-gather is a comm node of its own between `qkv` and `attn`; the ring runs in `attn`."""
    results = run_ranks(cp_losses, cp, cp, ep, STEPS + ["--cp-comm-type", comm_type],
                        timeout_s=400)
    names = [name for name, _ in results[0][1]]
    if comm_type == "allgather":
        assert names[:3] == ["qkv", "kv_gather", "attn"]
        assert results[0][1][1] == ("kv_gather", "comm")
    else:
        assert names[0] == "attn" and "kv_gather" not in names
    for losses, _, _ in results:
        assert losses == results[0][0]  # every rank reports the agreed loss
    assert f"CP {cp} ({comm_type}) x DP 1 (experts: EP {ep} x EDP {cp // ep})" in results[0][2]
    for ours, reference in zip(results[0][0], cp1_losses):
        assert abs(ours - reference) <= 2e-6 * reference, (results[0][0], cp1_losses)


@pytest.mark.slow
@pytest.mark.parametrize("world, cp, ep, comm_type", [(2, 2, 2, "p2p"), (4, 2, 2, "allgather")])
def test_overlap_and_delayed_wgrad_are_bitwise_equal_to_sequential_under_cp(
        world, cp, ep, comm_type, tmp_path):
    """CP 2 (x DP 2 on 4 ranks): the combined 1F1B, with and without delayed weight grads,
    gives the sequential schedule's grads and losses bit for bit (with the all-gather on the
    comm lane beside the other microbatch's compute)."""
    modes = {name: MODES[name] for name in ("sequential", "overlap", "overlap_wgrad")}
    results = run_ranks(mode_grads_and_losses, world, ep, str(tmp_path), 4,
                        ["--cp-comm-type", comm_type], modes, cp, timeout_s=600)
    assert_modes_match_sequential(results, tmp_path, 4, modes)


@pytest.mark.slow
def test_a_cp_run_resumes_bitwise_at_its_cp_size_and_at_cp1_within_rounding(tmp_path):
    """A: CP 2 (world 2, overlap + delayed wgrad), 4 steps, saved at 2. Resumed from step 2
    at CP 2, steps 3-4 are A's bit for bit; resumed on one rank at CP 1 (the same sequences,
    DP 1), within fp32 rounding: nothing in a checkpoint is per CP rank."""
    from epoverlap.training.checkpoints.checkpoint_files import iter_name
    flags = STEPS + ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    saved = str(tmp_path / "A")
    whole = run_ranks(cp_checkpoint_run, 2, 2, 2, flags, saved, timeout_s=400)[0]
    at_2 = str(tmp_path / "A" / iter_name(2))
    resumed = run_ranks(cp_checkpoint_run, 2, 2, 2, flags, None, at_2, timeout_s=400)[0]
    assert resumed == whole[2:]
    on_one = run_ranks(cp_checkpoint_run, 1, 1, 1, flags, None, at_2, timeout_s=400)[0]
    for ours, reference in zip(on_one, whole[2:]):
        assert abs(ours - reference) <= 2e-6 * reference, (on_one, whole)


@pytest.mark.slow
@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_cp_over_pipeline_stages_trains_to_the_losses_of_cp1(cp1_losses, comm_type):
    """PP 2 x CP 2 (the activations between stages are each rank's S / CP tokens), with the
    overlap and delayed weight grads: CP 1's losses on the last stage."""
    flags = STEPS + ["--cp-comm-type", comm_type, "--overlap-moe-expert-parallel-comm",
                     "--delay-wgrad-compute"]
    losses = run_ranks(cp_pipeline_losses, 4, 2, 2, flags, timeout_s=400)[-1]
    for ours, reference in zip(losses, cp1_losses):
        assert abs(ours - reference) <= 2e-6 * reference, (losses, cp1_losses)


@pytest.mark.slow
def test_eod_mask_loss_under_cp_counts_labels_over_the_cp_group(tmp_path):
    """--eod-mask-loss on short documents (the CP ranks' chunks count different numbers of
    labels): CP 2 trains to CP 1's losses, which differ from the unmasked run's."""
    from context_workers import cp_indexed_losses, write_short_documents
    prefix = write_short_documents(str(tmp_path / "docs"))
    masked = STEPS + ["--eod-mask-loss"]
    cp1 = run_ranks(cp_indexed_losses, 1, 1, prefix, masked)[0]
    cp2 = run_ranks(cp_indexed_losses, 2, 2, prefix, masked + ["--cp-comm-type", "allgather"],
                    timeout_s=400)[0]
    unmasked = run_ranks(cp_indexed_losses, 1, 1, prefix, STEPS)[0]
    for ours, reference in zip(cp2, cp1):
        assert abs(ours - reference) <= 2e-6 * reference, (cp2, cp1)
    assert all(abs(a - b) > 2e-5 * b for a, b in zip(cp1, unmasked)), (cp1, unmasked)


@pytest.mark.slow
@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_per_document_attention_under_cp_trains_to_the_losses_of_cp1(tmp_path, comm_type):
    """--reset-position-ids --reset-attention-mask --eod-mask-loss on short documents: CP 2
    (the documents' masks per ring step, or over the gathered keys) gives CP 1's losses,
    which differ from those of attention over the whole sample."""
    from context_workers import cp_indexed_losses, write_short_documents
    prefix = write_short_documents(str(tmp_path / "docs"))
    packed = STEPS + ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]
    cp1 = run_ranks(cp_indexed_losses, 1, 1, prefix, packed)[0]
    cp2 = run_ranks(cp_indexed_losses, 2, 2, prefix, packed + ["--cp-comm-type", comm_type],
                    timeout_s=400)[0]
    whole = run_ranks(cp_indexed_losses, 1, 1, prefix, STEPS + ["--eod-mask-loss"])[0]
    for ours, reference in zip(cp2, cp1):
        assert abs(ours - reference) <= 2e-6 * reference, (cp2, cp1)
    assert all(abs(a - b) > 2e-5 * b for a, b in zip(cp1, whole)), (cp1, whole)


def _dynamic_cp_against_fixed(tmp_path, cp: int, ep: int, flags: list[str]):
    """Fixed CP `cp`, dynamic CP (sizes 1 .. cp) and dynamic CP at its top size only, in one
    process group of `cp` ranks, and CP 1 on one rank, on documents that end at multiples of
    S / cp (so some microbatches fit smaller sizes and others do not)."""
    from context_workers import cp_indexed_losses, dynamic_cp_runs, write_aligned_documents
    prefix = write_aligned_documents(str(tmp_path / "docs"), unit=32 // cp)
    dynamic = ["--dynamic-context-parallel"]
    runs = [flags, flags + dynamic, flags + dynamic + ["--min-dynamic-context-parallel-size",
                                                        str(cp)]]
    fixed, chosen, top_only = run_ranks(dynamic_cp_runs, cp, ep, prefix, runs,
                                        timeout_s=600)[0]
    cp1 = run_ranks(cp_indexed_losses, 1, 1, prefix, flags)[0]
    return fixed, chosen, top_only, cp1


def _assert_close(ours, reference):
    for a, b in zip(ours, reference, strict=True):
        assert abs(a - b) <= 2e-6 * b, (ours, reference)


def test_dynamic_cp_switches_size_per_microbatch_and_trains_to_each_fixed_sizes_losses(
        tmp_path):
    """CP 2 (p2p), EP 2, the combined 1F1B (a microbatch at size 1 beside one at size 2), per-
    document attention, absolute positions, --eod-mask-loss: dynamic CP runs some microbatches
    at size 1 and the others at 2, and gives fixed CP 2's and CP 1's losses within fp32
    rounding (a segment's attention sums in another order than the ring's); held at size 2
    it is fixed CP 2 bit for bit (the same reductions in the same order)."""
    flags = STEPS + ["--reset-attention-mask", "--eod-mask-loss", "--cp-comm-type", "p2p",
                     "--overlap-moe-expert-parallel-comm"]
    (fixed, none), (dynamic, chosen), (top, at_top), cp1 = _dynamic_cp_against_fixed(
        tmp_path, 2, 2, flags)
    assert none == {} and at_top == {2: 16}
    assert chosen.get(1, 0) > 0 and chosen.get(2, 0) > 0, chosen
    assert top == fixed
    _assert_close(dynamic, fixed)
    _assert_close(dynamic, cp1)


@pytest.mark.slow
def test_dynamic_cp4_uses_sizes_1_2_and_4_and_trains_to_each_fixed_sizes_losses(tmp_path):
    """CP 4 (EP 2), the all-gather, the combined 1F1B, positions restarting per document:
    every size of the set is used, within fp32 rounding of fixed CP 4 and CP 1; held at 4,
    fixed CP 4's bits."""
    flags = STEPS + ["--reset-attention-mask", "--reset-position-ids", "--cp-comm-type",
                     "allgather", "--overlap-moe-expert-parallel-comm"]
    (fixed, _), (dynamic, chosen), (top, _), cp1 = _dynamic_cp_against_fixed(
        tmp_path, 4, 2, flags)
    assert set(chosen) == {1, 2, 4}, chosen
    assert top == fixed
    _assert_close(dynamic, fixed)
    _assert_close(dynamic, cp1)


def _assert_graphed_is_eager(eager, graphed) -> None:
    """Losses, grad norms and the parameters after the last step, bit for bit."""
    assert graphed[0] == eager[0]
    assert graphed[1] == eager[1]
    assert torch.equal(graphed[2], eager[2])


@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_cp2_graphs_replay_the_eager_bits_with_either_exchange(comm_type):
    """CP 2 x EP 2, the overlap, graphs of attention and the router (emulated backend, input
    checks on): the ring's attention graphs hold it; the all-gather is the comm lane's
    `kv_gather` node, so its attention graphs hold compute only; the router's hold the aux
    loss's counts over the CP group. The losses, grad norms and parameters are the eager
    run's bit for bit, and the graphs replayed."""
    from context_workers import cp_graph_runs
    flags = ["--train-iters", "3", "--cp-comm-type", comm_type,
             "--overlap-moe-expert-parallel-comm"]
    eager, graphed = run_ranks(cp_graph_runs, 2, 2, flags, timeout_s=600)[0]
    _assert_graphed_is_eager(eager, graphed)
    captured, _, replays = graphed[4][2]
    assert captured and replays > 0
    assert ("kv_gather" in graphed[5]) == (comm_type == "allgather"), graphed[5]


@pytest.mark.parametrize("cp", [1, 2])
def test_per_document_graphs_read_each_microbatchs_tokens_bitwise(tmp_path, cp):
    """--reset-attention-mask --reset-position-ids --eod-mask-loss on short documents (their
    ends differ from microbatch to microbatch), graphs of attention and the router (emulated
    backend, input checks on), at CP 1 and at CP 2 (the ring's per-document masks): the tokens
    are an input of the attention's graphs, so the losses, grad norms and parameters are the
    eager run's bit for bit. At CP 1 a third run's graphs keep the tokens of their first
    replay, and its bits differ: the check sees stale documents."""
    from context_workers import document_graph_runs, write_short_documents
    prefix = write_short_documents(str(tmp_path / "docs"))
    flags = ["--train-iters", "4", "--reset-attention-mask", "--reset-position-ids",
             "--eod-mask-loss", "--cp-comm-type", "p2p"]
    runs = run_ranks(document_graph_runs, cp, prefix, flags, cp == 1, timeout_s=600)[0]
    eager, graphed = runs[:2]
    _assert_graphed_is_eager(eager, graphed)
    captured, tokens, replays = graphed[4][cp]
    assert captured and replays > 0 and tokens == [(2, 32)], graphed[4]
    if cp == 1:
        stale = runs[2]
        assert stale[4][1][2] > 0
        assert stale[0][-1] != eager[0][-1], (stale[0], eager[0])


@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_dynamic_cp_graphs_replay_every_sizes_runner_bitwise_and_keep_sizes_apart(tmp_path,
                                                                                   comm_type):
    """CP 2, EP 2, the overlap, graphs of attention (emulated backend, input checks on): each
    size's runner records in the first step after the warmup that has a microbatch at its
    size, is captured and replays in later steps; size 2's graphs hold the ring, or the
    all-gather (inside the attention under dynamic CP: no `kv_gather` node). The
    losses, grad norms and parameters are the eager run's bit for bit, and each runner's
    slots hold [B, size x S / CP] tokens only: a slot that served both sizes would fail the
    input check or change the bits."""
    from context_workers import dynamic_cp_graph_runs, write_aligned_documents
    prefix = write_aligned_documents(str(tmp_path / "docs"), unit=16)
    flags = ["--train-iters", "6", "--reset-attention-mask", "--eod-mask-loss",
             "--overlap-moe-expert-parallel-comm", "--cp-comm-type", comm_type]
    eager, graphed = run_ranks(dynamic_cp_graph_runs, 2, 2, prefix, flags, timeout_s=600)[0]
    _assert_graphed_is_eager(eager, graphed)
    assert graphed[3] == eager[3] and set(eager[3]) == {1, 2}, eager[3]
    runners = graphed[4]
    assert {size: state[:2] for size, state in runners.items()} == {
        1: (True, [(2, 16)]), 2: (True, [(2, 32)])}
    assert all(replays > 0 for _, _, replays in runners.values()), runners
    assert "kv_gather" not in graphed[5], graphed[5]


@pytest.mark.slow
def test_dynamic_cp_over_pipeline_stages_trains_to_fixed_cp_losses(tmp_path):
    """PP 2 x CP 2: every stage cuts the same segments (the same data, the same CP rank), the
    activations between stages stay S / CP tokens: fixed CP 2's losses within fp32 rounding."""
    from context_workers import cp_pipeline_indexed_losses, write_aligned_documents
    prefix = write_aligned_documents(str(tmp_path / "docs"), unit=16)
    flags = STEPS + ["--reset-attention-mask", "--eod-mask-loss"]
    fixed = run_ranks(cp_pipeline_indexed_losses, 4, 2, 2, prefix, flags, timeout_s=400)[-1]
    dynamic = run_ranks(cp_pipeline_indexed_losses, 4, 2, 2, prefix,
                        flags + ["--dynamic-context-parallel"], timeout_s=400)[-1]
    _assert_close(dynamic, fixed)
