"""GPU tier of pipeline parallelism (marker `multigpu`; skipped with fewer GPUs): the CLI over
NCCL, bf16, Triton kernels, --deterministic-mode. PP=2 on 2 GPUs gives the same losses, bit for
bit, as PP=1 on one GPU (the same model, data and microbatches) for the plain 1F1B, the combined
1F1B (P2P on the comm stream), delayed wgrad and virtual stages; on 4 GPUs PP=2 x EP=2 equals
PP=1 x EP=2 on 2 GPUs; and the pipeline benchmark runs and reports a bubble fraction per run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epoverlap.config.resolve import SEQUENTIAL_FLAG

REPO = Path(__file__).resolve().parents[2]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
BASE = ["--preset", "tiny", "--num-layers", "4", "--bf16", "--deterministic-mode",
        "--kernel-backend", "triton", "--seed", "3", "--train-iters",
        os.environ.get("EPOVERLAP_GPU_STEPS", "10"),
        "--cuda-graph-impl", "none"]  # eager (on CUDA the default is the partial graphs)
SEQUENTIAL = [SEQUENTIAL_FLAG]  # the plain 1F1B / PP=1 reference: no EP overlap
PP2 = ["--pipeline-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]
OVERLAP = ["--overlap-moe-expert-parallel-comm"]
WGRAD = OVERLAP + ["--delay-wgrad-compute"]
VIRTUAL = ["--num-virtual-stages-per-pipeline-rank", "2"]


def _gpus(count: int):
    return pytest.mark.skipif(torch.cuda.device_count() < count,
                              reason=f"needs {count}+ CUDA GPUs")


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env.pop("TRITON_INTERPRET", None)
    return env


def _train(tmp_path: Path, name: str, nproc: int, flags: list[str]) -> tuple[str, list]:
    log = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "epoverlap.train", *flags, "--log-json", str(log)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(),
                            cwd=REPO)
    out = result.stdout + result.stderr
    assert result.returncode == 0, (name, out[-4000:])
    return out, [json.loads(line) for line in log.read_text().splitlines()]


def _loss_bits(records: list) -> list[tuple[str, str]]:
    """Per step the loss's and the grad norm's bits."""
    return [(r["loss_hex"], r["grad_norm_hex"]) for r in records]


@pytest.mark.multigpu
@_gpus(2)
def test_pp2_over_nccl_equals_one_gpu_bitwise(tmp_path):
    _, reference = _train(tmp_path, "pp1_1gpu", 1, BASE + SEQUENTIAL)
    runs = {"pp2": PP2 + SEQUENTIAL, "pp2_ovl": PP2 + OVERLAP, "pp2_wgrad": PP2 + WGRAD,
            "pp2_virtual_wgrad": PP2 + VIRTUAL + WGRAD}
    differing = []
    for name, flags in runs.items():
        out, records = _train(tmp_path, name, 2, BASE + flags)
        assert "= PP 2" in out and all(r["deterministic"] for r in records)
        if _loss_bits(records) != _loss_bits(reference):
            differing.append(name)
    assert not differing, differing


@pytest.mark.multigpu
@_gpus(4)
def test_pp2_ep2_on_four_gpus_equals_ep2_on_two_bitwise(tmp_path):
    _, reference = _train(tmp_path, "ep2_2gpu", 2, BASE + EP2 + SEQUENTIAL)
    for name, flags in {"pp2_ep2_wgrad": WGRAD, "pp2_ep2_virtual_ovl": VIRTUAL + OVERLAP}.items():
        _, records = _train(tmp_path, name, 4, BASE + PP2 + EP2 + flags)
        assert _loss_bits(records) == _loss_bits(reference), name


@pytest.mark.multigpu
@_gpus(2)
def test_pipeline_benchmark_reports_bubbles_and_step_times(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness.bench_pipeline", "--gpus", "2", "--preset",
         "tiny", "--num-layers", "4", "--iters", "6", "--microbatches", "4", "--virtual", "1,2",
         "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=900, env=_env(),
        cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_pipeline.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["pp2_v1_m4_off", "pp2_v1_m4_ovl", "pp2_v2_m4_off",
                                         "pp2_v2_m4_ovl", "ep2_m4_ovl"]
    for row in rows:
        assert row["step_ms"] > 0 and 0 <= row["bubble_measured"] < 1
    assert rows[0]["bubble_analytic"] == pytest.approx(1 / 5)
    assert rows[2]["bubble_analytic"] == pytest.approx(1 / 9)
    assert "| bubble measured |" in result.stdout
