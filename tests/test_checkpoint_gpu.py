"""GPU tier of checkpoints (marker `multigpu`, skipped without 2 GPUs): a run resumed from its
step-3 checkpoint on 2 GPUs (NCCL, bf16, EP 2, overlap + delayed wgrad, expert bias and the
router's CUDA balancing generator on) logs the same losses bit for bit and ends in the same
state as the uninterrupted run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint_workers import checkpoint_tensors
from epoverlap_tools.compare_losses import compare_loss_logs

REPO = Path(__file__).resolve().parents[1]
needs_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
RUN = ["--preset", "tiny", "--bf16", "--data", "synthetic", "--train-iters", "6",
       "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm",
       "--delay-wgrad-compute", "--deterministic", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-force-load-balancing"]


def _torchrun(*flags: str):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "epoverlap.train", *RUN, *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.multigpu
@needs_gpus
def test_resume_is_bitwise_on_two_gpus_with_bf16(tmp_path):
    first = _torchrun("--save", str(tmp_path / "A"), "--save-interval", "3", "--log-json",
                      str(tmp_path / "A.jsonl"))
    assert "checkpoint: saved step 3 to" in first.stdout
    shutil.copy(tmp_path / "A.jsonl", tmp_path / "R.jsonl")
    resumed = _torchrun("--load", str(tmp_path / "A" / "iter_0000003"), "--save",
                        str(tmp_path / "R"), "--log-json", str(tmp_path / "R.jsonl"))
    assert "checkpoint: resuming from" in resumed.stdout
    comparison = compare_loss_logs(tmp_path / "A.jsonl", tmp_path / "R.jsonl")
    assert comparison.identical and comparison.steps_compared == 6, comparison.message
    final_a = checkpoint_tensors(tmp_path / "A" / "iter_0000006")
    final_r = checkpoint_tensors(tmp_path / "R" / "iter_0000006")
    assert final_a.keys() == final_r.keys()
    assert all(torch.equal(final_a[k], final_r[k]) for k in final_a)
