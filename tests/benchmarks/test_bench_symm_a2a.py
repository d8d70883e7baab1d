"""bench_symm_a2a on CPU: the rows it routes, and its refusal where there is no GPU (its
timings are GPU runs: recipe `symm_a2a`)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.bench_symm_a2a import main, parse_args, route_rows


@pytest.mark.parametrize("rows, skew, ranks", [(8192, 1.0, 2), (8192, 1.25, 4), (1001, 1.5, 3)])
def test_every_row_is_routed_and_the_next_rank_gets_the_skew(rows, skew, ranks):
    for rank in range(ranks):
        splits = route_rows(rows, skew, rank, ranks)
        assert sum(splits) == rows and min(splits) >= 0
        nxt, other = (rank + 1) % ranks, (rank + 2) % ranks
        if ranks > 2 and other != 0 and nxt != 0:  # the remainder lands on rank 0
            assert splits[nxt] / splits[other] == pytest.approx(skew, rel=0.01)


def test_balanced_routing_sends_every_rank_the_same_rows():
    assert route_rows(8192, 1.0, 1, 4) == [2048] * 4


def test_the_options_are_checked():
    assert parse_args(["--rows", "64,128", "--skew", "1.5"]).rows == [64, 128]
    with pytest.raises(SystemExit):
        parse_args(["--rows", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's answer")
def test_without_a_gpu_it_is_refused_in_one_line(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_symm_a2a: needs CUDA") and "\n" not in err
