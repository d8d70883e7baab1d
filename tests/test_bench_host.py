"""tools/bench_host.py's call-site attribution, on a one-process CPU trainer (torch kernels):
every call of a named op is counted once, at the project line that issued it, forward and
backward; and tools/bench_launch.py refuses cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from dist_helpers import single_rank_groups
from epoverlap.config import parse_config
from epoverlap.training.trainer import Trainer
from epoverlap_tools import bench_host, bench_launch

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "8", "--num-experts", "4",
        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--micro-batch-size", "1",
        "--num-microbatches", "2", "--kernel-backend", "torch", "--mock-data",
        "--skip-optimizer-step", "--train-iters", "10", "--moe-aux-loss-coeff", "0.01"]


def test_call_sites_count_each_call_at_its_project_line():
    trainer = Trainer(parse_config(TINY), single_rank_groups(), log=lambda msg: None)
    try:
        inputs = trainer.microbatches(1)
        trainer.run_microbatches(1, inputs)
        found = bench_host.call_sites(trainer, inputs, ["aten::mm", "aten::full_like"])
    finally:
        trainer.close()
    mm_sites = dict((site, calls) for site, calls, _ in found["aten::mm"])
    # 2 layers x 2 microbatches x (qkv, proj, router) forward linears + the head, each with an
    # input-grad and a weight-grad mm in the backward
    forward = [calls for site, calls in mm_sites.items() if site.endswith(" forward")]
    assert sum(forward) == 2 * 2 * 3 + 2, mm_sites
    assert any(site.startswith("model/linear.py:") and site.endswith(" backward")
               for site in mm_sites), mm_sites
    full_like = dict((site, calls) for site, calls, _ in found["aten::full_like"])
    # the loss seed of each microbatch's backward, issued by the executor
    assert sum(calls for site, calls in full_like.items()
               if site.startswith("schedule/executor.py:")) == 2, full_like
    assert all(mean_us > 0 for rows in found.values() for _, _, mean_us in rows)


def test_call_sites_refuses_names_that_are_not_aten_ops(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_host.main(["--call-sites", "aten::fill_", "cudaMemcpyAsync"])
    assert exit_info.value.code == 2
    assert "--call-sites: ['cudaMemcpyAsync'] are not aten ops" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_bench_launch_needs_a_gpu(capsys):
    assert bench_launch.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out
