"""The dropless dispatch's split sizes: exchanged early on their own communicator, read late.

CPU (one process): the sizes a `SplitExchange` reads, against a hand count. gloo (2 and 3 CPU
ranks) and NCCL (2+ GPUs, `multigpu`): the exchanged counts against the formula of
`split_workers.counts_of`, and the exchange read while an all-to-all of the EP communicator is
still waiting for a late rank (before, the exchange ran on that communicator behind it)."""

from __future__ import annotations

import pytest
import torch

from dist_helpers import run_ranks
from split_workers import LOCAL_EXPERTS, exchange_beside_a_late_all_to_all

LATE_S = 3.0


def test_one_rank_reads_sent_received_and_per_expert_rows():
    from epoverlap.parallel.comm import ExpertComm
    exchange = ExpertComm(None, 1).start_split_exchange(torch.tensor([3, 0, 5]))
    assert exchange.read() == ([8], [8], [3, 0, 5])
    assert exchange.recv_RL.tolist() == [[3, 0, 5]]


class _RecordingGroup:
    """A stand-in EP group: its all-to-all echoes (what a rank sends itself) and is counted."""

    def __init__(self):
        self.calls = 0

    def all_to_all_single(self, output, input, output_splits=None, input_splits=None):
        self.calls += 1
        output.copy_(input)


def test_without_a_second_communicator_the_exchange_runs_at_the_read():
    """No counts group: nothing may run on the EP communicator outside the dispatch's lane,
    so the exchange is deferred to `read()`, on the EP group."""
    from epoverlap.parallel.comm import ExpertComm
    group = _RecordingGroup()
    exchange = ExpertComm(group, 2).start_split_exchange(torch.tensor([1, 2, 3, 4]))
    assert group.calls == 0 and exchange.recv_RL is None
    assert exchange.read() == ([3, 7], [3, 7], [4, 6])
    assert group.calls == 1 and exchange.recv_RL.tolist() == [[1, 2], [3, 4]]


def test_rows_per_rank_counted_apart_are_read_not_summed():
    """Once per rank: a token routed to both experts of a rank is one row, so the rows per
    rank (3 and 1 here, against 7 and 4 routed pairs) come from their own column."""
    from epoverlap.parallel.comm import ExpertComm
    group = _RecordingGroup()
    exchange = ExpertComm(group, 2).start_split_exchange(torch.tensor([5, 2, 1, 3]),
                                                         torch.tensor([3, 1]))
    assert exchange.read() == ([3, 1], [3, 1], [6, 5])
    assert exchange.recv_RL.tolist() == [[5, 2], [1, 3]]
    local = ExpertComm(None, 1).start_split_exchange(torch.tensor([2, 2]), torch.tensor([3]))
    assert local.read() == ([3], [3], [2, 2]) and local.recv_RL.tolist() == [[2, 2]]


def _expected(rank: int, world: int):
    """Sizes rank `rank` must read, from the counts formula (100 src + global expert)."""
    L = LOCAL_EXPERTS

    def routed(src, expert):
        return 100 * src + expert
    recv_RL = [[routed(src, rank * L + l) for l in range(L)] for src in range(world)]
    sent = [sum(routed(rank, dst * L + l) for l in range(L)) for dst in range(world)]
    received = [sum(row) for row in recv_RL]
    per_expert = [sum(recv_RL[src][l] for src in range(world)) for l in range(L)]
    return (sent, received, per_expert), recv_RL


def _check(results, world):
    for rank, result in enumerate(results):
        sizes, recv_RL = _expected(rank, world)
        assert tuple(result["sizes"]) == sizes, rank
        assert result["recv_RL"] == recv_RL, rank
    first = results[0]
    assert first["a2a_finished_before_read"] is False
    assert first["read_s"] < LATE_S / 2, first["read_s"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_exchange_is_read_while_an_all_to_all_waits_for_a_late_rank(world):
    _check(run_ranks(exchange_beside_a_late_all_to_all, world, "cpu", LATE_S, timeout_s=120),
           world)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_exchange_is_read_while_an_all_to_all_waits_for_a_late_rank():
    world = torch.cuda.device_count()
    _check(run_ranks(exchange_beside_a_late_all_to_all, world, "cuda", LATE_S, timeout_s=180),
           world)


def test_split_sizes_sum_rows_for_ranks_and_columns_for_local_experts():
    from epoverlap.parallel.comm import split_sizes
    sent = [[1, 2, 3], [4, 5, 6]]  # to rank 0's experts, to rank 1's experts
    received = [[7, 0, 1], [2, 2, 2]]  # from rank 0, from rank 1, per local expert
    assert split_sizes(sent, received) == ([6, 15], [8, 6], [9, 2, 3])


def test_trace_records_equal_chunks_as_row_counts():
    """An all-to-all with splits None (the budget's fixed blocks) is traced with its row counts,
    so bench_overlap can replay it alone (it once recorded None and the replay failed)."""
    from epoverlap.parallel.comm import ExpertComm
    comm = ExpertComm(None, 2, mode="local_copy")
    comm.trace = []
    comm.all_to_all(torch.zeros(6, 4), None, None)
    comm.all_to_all(torch.zeros(5, 4), [2, 3], [4, 1])
    assert comm.trace == [([3, 3], [3, 3], (4,), torch.float32),
                          ([2, 3], [4, 1], (4,), torch.float32)]
