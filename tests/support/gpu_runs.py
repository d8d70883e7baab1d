"""GPU-tier helpers shared by the GPU test files: skip markers, the environment a GPU job runs
under (NVLink multicast off, the Triton interpreter off), and one CLI training run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from job_control import NO_MULTICAST, REPO

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")


def gpu_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env.pop("TRITON_INTERPRET", None)
    return env


def train_cli(tmp_path, name, nproc, flags, timeout=900, module="epoverlap.train"):
    """One CLI training run (torchrun, like users run it); returns (stdout+stderr, records).
    `module`: benchmarks.harness.train_bench for the benchmark-only flags."""
    log = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", module, *flags, "--log-json", str(log)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=gpu_env(),
                            cwd=REPO)
    out = result.stdout + result.stderr
    keep = os.environ.get("EPOVERLAP_GPU_LOGS")
    if keep:  # the device suite keeps the logs for benchmarks/
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"{name}.jsonl").write_text(log.read_text() if log.exists() else "")
        (Path(keep) / f"{name}.log").write_text(out)
    assert result.returncode == 0, out[-4000:]
    return out, [json.loads(line) for line in log.read_text().splitlines()]


def identical_losses(reference, other):
    """The two runs' logs have the same loss and grad norm bits at every step (the grad norm
    sees the order the backward accumulated in, which the loss of its step cannot)."""
    def bits(records):
        return [(r["loss_hex"], r["grad_norm_hex"]) for r in records]
    return bits(reference) == bits(other)
