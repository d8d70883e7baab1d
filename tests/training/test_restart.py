"""Launch tier for checkpoints and the NaN check, through the real command: a torchrun job with
--max-restarts whose rank dies resumes from its newest checkpoint by itself; a checkpoint of
another model and a NaN gradient each stop the command with one line and their exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
QUICK = ["--preset", "tiny", "--hidden-size", "64", "--seq-length", "64", "--mock-data",
         "--num-microbatches", "2", "--lr-warmup-iters", "2", "--distributed-timeout-minutes", "3"]


def _run(cmd, fault=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env.pop("EPOVERLAP_TEST_FAULT", None)
    if fault:
        env["EPOVERLAP_TEST_FAULT"] = fault
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("epoverlap-train: error")]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """2 ranks, EP 2, overlap; rank 1 dies as step 4 starts (first run only); torchrun restarts
    both, and they resume from step 2, the newest checkpoint (saved every 2 steps)."""
    out = tmp_path_factory.mktemp("restart")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", "-m", "epoverlap.train", *QUICK, "--train-iters", "5",
           "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm",
           "--save", str(out / "ckpt"), "--save-interval", "2", "--load", str(out / "ckpt"),
           "--log-json", str(out / "log.jsonl")]
    return out, _run(cmd, fault="exit@4:1")


def test_a_restarted_job_resumes_from_its_newest_checkpoint(restarted):
    out, result = restarted
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint: none in {out / 'ckpt'} yet; starting at step 1" in result.stdout
    assert "rank 1 exits at step 4" in result.stdout
    assert f"checkpoint: resuming from {out / 'ckpt' / 'iter_0000002'} at step 2" \
        in result.stdout
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]  # the interrupted run's step 3 was replaced
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [  # config.json: the run's
        "config.json", "iter_0000002", "iter_0000004", "iter_0000005",  # resolved config
        "latest_checkpointed_iteration.txt"]
    saved = [line for line in result.stdout.splitlines() if line.startswith("checkpoint: saved")]
    assert len(saved) == 3 and all(" s (" in line and " MB)" in line for line in saved)


def test_a_checkpoint_of_another_model_exits_2_with_one_line(restarted):
    out, _ = restarted
    result = _run([sys.executable, "-m", "epoverlap.train", *QUICK, "--hidden-size", "32",
                   "--load", str(out / "ckpt")])
    assert result.returncode == 2, result.stderr[-3000:]
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"--load={out / 'ckpt'}: {out / 'ckpt' / 'iter_0000005'}: written for another " \
           "model: model/embedding is [256, 64] there, [256, 32] here (flags that differ: " \
           "--hidden-size 64 -> 32)" in lines[0]


def test_a_nan_gradient_exits_1_naming_step_rank_and_parameter():
    result = _run([sys.executable, "-m", "epoverlap.train", *QUICK, "--train-iters", "3",
                   "--check-for-nan-in-loss-and-grad"], fault="nan-grad@2:0:layers.1.experts.fc1")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "step    1/3" in result.stdout and "step    2/3" not in result.stdout
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0] == ("epoverlap-train: error: step 2: rank 0: NaN/Inf in the gradient of "
                        "layers.1.experts.fc1 (first of 1 parameter(s)); stopped before the "
                        "optimizer step (optimizer state unchanged)")
