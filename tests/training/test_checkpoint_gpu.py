"""GPU tier of checkpoints (markers `gpu`, `multigpu`; skipped without the GPUs): a run resumed
from its step-3 checkpoint logs the same losses bit for bit and ends in the same state as the
uninterrupted run: on 2 GPUs (NCCL, bf16, EP 2, overlap + delayed wgrad, expert bias and the
router's CUDA balancing generator on), and on one (bf16, the GPU's default AdamW form, the flat
one: its Triton update over flat buffers, the parameters views of one); eager steps both (--cuda-graph-impl none: on CUDA the default is the partial
graphs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint_workers import checkpoint_tensors
from epoverlap.cli.compare_losses import compare_loss_logs

REPO = Path(__file__).resolve().parents[2]
needs_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
RUN = ["--preset", "tiny", "--bf16", "--mock-data", "--train-iters", "6",
       "--deterministic-mode", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-force-load-balancing",
       "--cuda-graph-impl", "none"]
EP2_OVERLAP = ["--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm",
               "--delay-wgrad-compute"]


def _torchrun(nproc: int, *flags: str):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "epoverlap.train", *RUN, *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.multigpu
@needs_gpus
def test_resume_is_bitwise_on_two_gpus_with_bf16(tmp_path):
    _resume_is_bitwise(tmp_path, 2, EP2_OVERLAP)


@pytest.mark.gpu
@needs_gpu
def test_resume_is_bitwise_on_one_gpu_with_bf16_and_the_flat_adamw(tmp_path):
    _resume_is_bitwise(tmp_path, 1, [])


def _resume_is_bitwise(tmp_path, nproc: int, flags: list[str]) -> None:
    first = _torchrun(nproc, *flags, "--save", str(tmp_path / "A"), "--save-interval", "3",
                      "--log-json", str(tmp_path / "A.jsonl"))
    assert "checkpoint: saved step 3 to" in first.stdout
    shutil.copy(tmp_path / "A.jsonl", tmp_path / "R.jsonl")
    resumed = _torchrun(nproc, *flags, "--load", str(tmp_path / "A" / "iter_0000003"), "--save",
                        str(tmp_path / "R"), "--log-json", str(tmp_path / "R.jsonl"))
    assert "checkpoint: resuming from" in resumed.stdout
    comparison = compare_loss_logs(tmp_path / "A.jsonl", tmp_path / "R.jsonl")
    assert comparison.identical and comparison.steps_compared == 6, comparison.message
    assert comparison.grad_norms_compared == 6  # the resumed steps' grad norms too
    final_a = checkpoint_tensors(tmp_path / "A" / "iter_0000006")
    final_r = checkpoint_tensors(tmp_path / "R" / "iter_0000006")
    assert final_a.keys() == final_r.keys()
    assert all(torch.equal(final_a[k], final_r[k]) for k in final_a)
