"""The benchmarks' JSON keeps every timed step, not the medians alone: bench_peer's runs
(`step_ms_samples`) and bench_overlap's modes and comm replay (`fb_ms_samples`,
`step_ms_samples`), on CPU (gloo)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from benchmarks.harness import bench_peer
from benchmarks.harness.bench_overlap import SHAPES, max_over_ranks_each
from epoverlap.config import parse_config
from job_control import job_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_bench_peer_keeps_every_timed_step(one_rank):
    cfg = parse_config(SHAPES["quick"]).with_vocab_size(256)
    samples = [bench_peer.StepSample(seconds, 5.0, None) for seconds in (0.9, 0.1, 0.3, 0.2)]
    run = bench_peer.summarize(samples, 1, cfg)
    assert run["step_ms_samples"] == pytest.approx([100, 300, 200])
    assert run["step_ms"] == pytest.approx(statistics.median(run["step_ms_samples"]))
    assert run["steps"] == 4


def test_max_over_ranks_each_keeps_the_order(one_rank):
    assert max_over_ranks_each([3.0, 1.0, 2.0]) == [3.0, 1.0, 2.0]


@pytest.mark.slow
def test_bench_overlap_keeps_every_timed_step_of_every_round(tmp_path):
    """2 CPU ranks, 2 rounds of 2 steps per mode: 4 samples per mode and for the replay."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "benchmarks.harness.bench_overlap", "--shapes", "quick", "--out-dir",
           str(tmp_path), "--iters", "2", "--warmup", "0", "--rounds", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                            env=job_env())
    assert result.returncode == 0, result.stderr[-3000:]
    shape = json.loads((tmp_path / "bench_overlap.json").read_text())["results"][0]
    for mode in ("seq", "ovl", "ovl_wgrad", "comp"):
        assert len(shape[mode]["fb_ms_samples"]) == len(shape[mode]["step_ms_samples"]) == 4
        assert all(ms > 0 for ms in shape[mode]["fb_ms_samples"])
        fb, full = shape[mode]["fb_ms_samples"], shape[mode]["step_ms_samples"]
        assert all(a <= b for a, b in zip(fb, full))  # each step's fb is part of its step
    assert len(shape["comm"]["fb_ms_samples"]) == 4
    assert len(shape["comm"]["fb_ms_rounds"]) == 2
