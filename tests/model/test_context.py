"""Context parallelism on one process (pure CPU): the causal load balance, the K/V order of
the all-gather, the ring's partial attentions and their merge against whole attention, and
the rules of the CP flags."""

from __future__ import annotations

import pytest
import torch

from epoverlap.config import parse_config
from epoverlap.config.resolve import validate_config
from epoverlap.errors import ConfigError
from epoverlap.model.context import in_sequence_order, local_positions, merge, partial_attention

from context_workers import reference_attention
from gloo_workers import TINY


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_ranks_hold_every_position_once_and_equal_causal_work(cp):
    seq = 24 * cp
    held = [local_positions(seq, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    # causal work of a rank: the keys each of its queries sees (position + 1)
    work = {int((positions + 1).sum()) for positions in held}
    assert len(work) == 1, work
    chunk = seq // (2 * cp)
    assert held[0][:chunk].tolist() == list(range(chunk))  # rank 0: chunk 0 and the last
    assert held[0][-1] == seq - 1


@pytest.mark.parametrize("cp", [2, 4])
def test_gathered_chunks_come_back_in_sequence_order(cp):
    seq = 8 * cp
    kv_KBGSD = torch.randn(2, 1, 2, seq, 4)
    gathered = torch.stack([kv_KBGSD[:, :, :, local_positions(seq, cp, rank)]
                            for rank in range(cp)])
    k, v = in_sequence_order(gathered)
    assert torch.equal(k, kv_KBGSD[0]) and torch.equal(v, kv_KBGSD[1])


def test_partial_attentions_over_split_keys_merge_to_the_whole():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, heads, 12, 8, generator=gen, dtype=torch.float64)
               for heads in (4, 2, 2))
    whole, whole_lse = partial_attention(q, k, v)
    first = partial_attention(q, k[:, :, :5], v[:, :, :5])
    second = partial_attention(q, k[:, :, 5:], v[:, :, 5:])
    out, lse = merge(*first, *second)
    assert torch.allclose(out, whole, atol=1e-6) and torch.allclose(lse, whole_lse, atol=1e-6)


def test_causal_partial_attention_is_the_reference():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, heads, 10, 8, generator=gen, dtype=torch.float64)
               for heads in (4, 1, 1))
    out, _ = partial_attention(q, k, v, causal=True)
    assert torch.allclose(out.double(), reference_attention(q, k, v), atol=1e-6)


def _refusal(flags: list[str], world: int = 4) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(parse_config(TINY + flags), world, cuda_available=False)
    return str(info.value)


@pytest.mark.parametrize("flags, says", [
    (["--context-parallel-size", "3"], "CP x PP = 3 x 1 must divide the world size 4"),
    (["--context-parallel-size", "2", "--seq-length", "30"], "2 x CP must divide"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], "a2a and a2a+p2p"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "p2p", "p2p"],
     "one per layer (--num-layers=2)"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], "attention dropout"),
    (["--context-parallel-size", "2", "--cuda-graph-impl", "full_iteration"],
     "none or local with --context-parallel-size > 1"),
    (["--context-parallel-size", "2", "--cuda-graph-impl", "local", "--cuda-graph-modules",
      "attn", "moe"], "moe_router and/or moe_preprocess with --context-parallel-size > 1"),
])
def test_what_context_parallelism_does_not_run_with_is_refused_naming_the_flag(flags, says):
    assert says in _refusal(flags)


@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_partial_graphs_of_the_modules_before_the_dispatch_run_at_cp_2(comm_type):
    """Per-layer graphs at a fixed CP > 1 (`graphs.capture`), given by the flags; the auto
    scope leaves them off there (`config.resolve`)."""
    from epoverlap.config.resolve import _graph_choices
    from epoverlap.parallel.link import Link
    nvlink = Link("nvlink", True, "test")
    cfg = parse_config(TINY + ["--context-parallel-size", "2", "--cp-comm-type", comm_type,
                               "--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
                               "moe_router", "moe_preprocess", "--kernel-backend", "triton"])
    validate_config(cfg, 4, cuda_available=True)
    assert _graph_choices(cfg, nvlink) == []
    assert _graph_choices(parse_config(TINY), nvlink) != []


def test_a_cp_group_reads_one_data_shard():
    at = TINY.index("--num-microbatches")
    argv = TINY[:at] + TINY[at + 2:]
    cfg = parse_config(argv + ["--context-parallel-size", "2", "--global-batch-size", "16"])
    validate_config(cfg, 4, cuda_available=False)
    assert cfg.data_parallel_size(4) == 2 and cfg.stage_size(4) == 4
    assert cfg.for_world(4).train.num_microbatches == 4  # 16 / (2 sequences x DP 2)
    assert cfg.microbatch_tokens == 2 * 32 // 2
    layered = parse_config(TINY + ["--cp-comm-type", "allgather", "p2p"])
    assert layered.cp_comm_types() == ["allgather", "p2p"]
    assert parse_config(TINY).cp_comm_types() == ["p2p", "p2p"]


def test_eod_mask_loss_leaves_out_the_label_after_each_end_of_document():
    from epoverlap.kernels.cross_entropy import IGNORE_INDEX
    from epoverlap.training.setup.data import _inputs_and_labels
    windows = torch.tensor([[3, 9, 4, 5, 9, 6]])
    tokens, labels = _inputs_and_labels(windows, masked_eod=9)
    assert tokens.tolist() == [[3, 9, 4, 5, 9]]
    assert labels.tolist() == [[9, IGNORE_INDEX, 5, 9, IGNORE_INDEX]]
    assert _inputs_and_labels(windows)[1].tolist() == [[9, 4, 5, 9, 6]]


def _dynamic_views(cp: int, rank: int, seq: int, eod: int):
    """Rank `rank`'s `DynamicContext` of a CP group of `cp`, its communicators stand-ins (the
    views read only their size and rank when made)."""
    from types import SimpleNamespace

    from epoverlap.model.context import DynamicContext, dynamic_sizes
    from epoverlap.model.documents import Documents
    sizes = {n: SimpleNamespace(size=n, rank=rank % n, lane=None)
             for n in dynamic_sizes(cp, 1)}
    comm = SimpleNamespace(size=cp, rank=rank, sizes=sizes)
    return DynamicContext(comm, "p2p", seq, torch.device("cpu"),
                          Documents(eod, False, True, capacity=64))


def test_dynamic_sizes_are_the_powers_of_2_from_the_least():
    from epoverlap.model.context import dynamic_sizes
    assert dynamic_sizes(8, 1) == (1, 2, 4, 8)
    assert dynamic_sizes(8, 4) == (4, 8)
    assert dynamic_sizes(2, 2) == (2,)


def test_dynamic_cp_picks_the_smallest_size_whose_segments_hold_whole_documents():
    """CP 4, S 16 (s 4): ends before positions 4, 8, 12 -> 1; before 8 only -> 2; none -> 4;
    both sequences of a microbatch must allow the size."""
    eod = 9
    context = _dynamic_views(4, 0, 16, eod)
    every_4 = torch.tensor([[1, 2, 3, eod] * 4])
    only_8 = torch.tensor([[1, 2, 3, 4, 5, 6, 7, eod] * 2])
    none = torch.tensor([[1] * 15 + [eod]])
    assert [context.size_of(t) for t in (every_4, only_8, none)] == [1, 2, 4]
    assert context.size_of(torch.cat([every_4, only_8])) == 2


@pytest.mark.parametrize("size", [1, 2, 4])
def test_at_every_size_the_ranks_hold_every_position_once(size):
    """Each rank's segment and its chunks in it: the positions of the CP group's ranks
    (segment offset + the load balance inside the segment) are the sequence's, once each,
    and a rank's tokens are the whole sequence's at those positions."""
    seq, eod = 32, 99
    tokens = torch.arange(seq).view(1, -1)
    tokens[:, seq // 4 * size - 1::seq // 4 * size] = eod  # every size-`size` segment ends
    held = []
    for rank in range(4):
        context = _dynamic_views(4, rank, seq, eod)
        mine, labels = context.segments(tokens, tokens + 1)
        assert context.chosen == {size: 1} and mine.shape[1] == size * seq // 4
        assert torch.equal(labels, mine + 1)
        positions = context.rotary_positions(mine, context.documents)[0]
        assert torch.equal(context.local(mine)[0], tokens[0, positions])
        held.append(positions)
    assert sorted(torch.cat(held).tolist()) == list(range(seq))


@pytest.mark.parametrize("flags, says", [
    (["--dynamic-context-parallel"], "needs --context-parallel-size a power of 2 above 1"),
    (["--context-parallel-size", "4", "--dynamic-context-parallel"],
     "needs --reset-attention-mask"),
    (["--context-parallel-size", "4", "--dynamic-context-parallel", "--reset-attention-mask",
      "--min-dynamic-context-parallel-size", "3"], "a power of 2 from 1 to"),
    (["--context-parallel-size", "4", "--dynamic-context-parallel", "--reset-attention-mask",
      "--max-seqlen-per-dp-cp-rank", "16"], "--seq-length / --context-parallel-size = 8"),
    (["--context-parallel-size", "4", "--dynamic-context-parallel", "--reset-attention-mask",
      "--cuda-graph-impl", "full_iteration"], "none or local with --dynamic-context-parallel"),
    (["--context-parallel-size", "4", "--dynamic-context-parallel", "--reset-attention-mask",
      "--cuda-graph-impl", "local"], "attn and/or mlp with --dynamic-context-parallel"),
    (["--context-parallel-size", "4", "--dynamic-context-parallel", "--reset-attention-mask",
      "--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router"],
     "attn and/or mlp with --dynamic-context-parallel"),
    (["--context-parallel-size", "4", "--dynamic-context-parallel", "--reset-attention-mask",
      "--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "--tune", "on",
      "--overlap-moe-expert-parallel-comm"], "a runner per CP size, not per path"),
    (["--min-dynamic-context-parallel-size", "2"], "read only with it"),
])
def test_what_dynamic_cp_needs_is_refused_naming_the_flag(flags, says):
    assert says in _refusal(flags)


@pytest.mark.parametrize("cp", [1, 2])
def test_per_document_attention_runs_with_per_layer_graphs_not_one_of_the_iteration(cp):
    """Per-layer graphs take the tokens as an input of the attention's ranges; the graph of the
    whole iteration is refused, naming the flag."""
    from epoverlap.config.context_rules import validate_documents
    argv = TINY + ["--context-parallel-size", str(cp), "--reset-attention-mask",
                   "--reset-position-ids"]
    validate_documents(parse_config(argv + ["--cuda-graph-impl", "local",
                                            "--cuda-graph-modules", "attn", "moe_router"]))
    with pytest.raises(ConfigError, match="none or local with --reset-attention-mask"):
        validate_documents(parse_config(argv + ["--cuda-graph-impl", "full_iteration"]))
    with pytest.raises(ConfigError, match="none or local with --reset-position-ids"):
        validate_documents(parse_config(TINY + ["--reset-position-ids", "--cuda-graph-impl",
                                                "full_iteration"]))


def test_dynamic_cp_accepts_megatrons_per_rank_length_when_it_is_s_over_cp():
    from epoverlap.config.context_rules import validate_dynamic_context_parallel
    argv = TINY + ["--context-parallel-size", "4", "--dynamic-context-parallel",
                   "--reset-attention-mask"]
    graphs = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "mlp"]
    for given in ([], ["--max-seqlen-per-dp-cp-rank", "8"], graphs,
                  graphs + ["--min-dynamic-context-parallel-size", "2"]):
        cfg = parse_config(argv + given)
        validate_dynamic_context_parallel(cfg)  # the data rules need a --data-path
        assert cfg.parallel.min_dynamic_context_parallel_size in (1, 2)


def test_the_auto_graph_scope_never_picks_graphs_under_dynamic_cp():
    """Its capture-failure agreement is an all-reduce over every rank at the step a capture
    comes; under dynamic CP each CP group's runners capture at steps of their own."""
    import dataclasses

    from epoverlap.config.context_rules import validate_dynamic_context_parallel
    cfg = parse_config(TINY + ["--context-parallel-size", "4", "--dynamic-context-parallel",
                               "--reset-attention-mask", "--cuda-graph-impl", "local",
                               "--cuda-graph-modules", "attn"])
    validate_dynamic_context_parallel(cfg)
    auto = dataclasses.replace(cfg, defaulted=cfg.defaulted + ("--cuda-graph-impl",))
    with pytest.raises(ConfigError, match="not the auto scope's"):
        validate_dynamic_context_parallel(auto)
