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
    (["--context-parallel-size", "2", "--cuda-graph-impl", "local"], "CUDA graphs"),
])
def test_what_context_parallelism_does_not_run_with_is_refused_naming_the_flag(flags, says):
    assert says in _refusal(flags)


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
