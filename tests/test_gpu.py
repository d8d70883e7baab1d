"""GPU tier (markers `gpu`, `multigpu`; skipped without CUDA): streams and events keep the
overlap bit-exact on one GPU; bf16 training runs; the 2+ GPU bitwise contract over NCCL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env.pop("TRITON_INTERPRET", None)
    return env


def _single_gpu_grads(lanes_kind: str, delay: bool):
    from epoverlap.parallel.comm import ExpertComm
    from epoverlap.config import parse_config
    from epoverlap.model.transformer import MoEModel
    from epoverlap.schedule.executor import CudaStreamLanes, Executor, SerialLanes
    from epoverlap.schedule.plan import build_plan
    from epoverlap.schedule.wgrad import WeightGradQueue
    from epoverlap_kernels import make_moe_ops

    torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = parse_config(["--num-layers", "3", "--hidden-size", "256", "--num-attention-heads",
                        "4", "--seq-length", "128", "--num-experts", "8", "--moe-router-topk",
                        "2", "--moe-ffn-hidden-size", "256", "--moe-first-k-dense-replace", "1",
                        "--moe-shared-expert-intermediate-size", "128", "--bf16",
                        "--num-microbatches", "4"])
    device = torch.device("cuda")
    queue = WeightGradQueue(enabled=delay)
    model = MoEModel(cfg, ExpertComm(None, 1), 0, make_moe_ops("triton"), dtype=torch.bfloat16,
                     device=device, wgrad_queue=queue)
    lanes = CudaStreamLanes(device) if lanes_kind == "streams" else SerialLanes()
    plan = build_plan("combined_1f1b" if lanes_kind == "streams" else "sequential",
                      model.layout(), 4, delay)
    gen = torch.Generator().manual_seed(0)
    data = [{"tokens": torch.randint(0, 256, (2, 128), generator=gen).to(device),
             "labels": torch.randint(0, 256, (2, 128), generator=gen).to(device)}
            for _ in range(4)]
    Executor(model.node_specs(), lanes, queue).run(plan, data, 0.25)
    torch.cuda.synchronize()
    return {n: p.grad.float().cpu() for n, p in model.named_parameters()}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("delay", [False, True])
def test_streams_and_events_keep_one_gpu_bitwise(delay):
    reference = _single_gpu_grads("serial", False)
    got = _single_gpu_grads("streams", delay)
    for name in reference:
        assert torch.equal(got[name], reference[name]), name


@pytest.mark.gpu
@needs_gpu
def test_bf16_training_on_one_gpu_reduces_the_loss(tmp_path):
    log = tmp_path / "log.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "-m", "epoverlap.train", "--preset", "tiny", "--bf16", "--train-iters", "15",
         "--log-json", str(log)], capture_output=True, text=True, timeout=600, env=_env(),
        cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


@pytest.mark.multigpu
@needs_gpus
def test_overlap_bitwise_over_nccl(tmp_path):
    """All modes (overlap, delayed wgrad, early release) equal sequential bit for bit."""
    out = tmp_path / "bitwise.json"
    nproc = torch.cuda.device_count()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", str(REPO / "tools" / "check_bitwise.py"), "--steps", "20",
         "--out", str(out)], capture_output=True, text=True, timeout=900, env=_env(), cwd=REPO)
    print(result.stdout[-3000:])
    assert out.exists(), result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    bad = [r for r in rows if not (r["grads_bitwise_equal"] and r["losses_identical"])]
    assert not bad, bad
    assert result.returncode == 0


@pytest.mark.multigpu
@needs_gpus
def test_simulator_replays_a_recorded_overlapped_run(tmp_path):
    """2 GPUs, the f128 ratio shape, overlapped: record 3 steps' spans, replay them with the
    simulator (recorded compute and comm, host launch costs read from the same recording's
    gaps). benchmarks/simulation.md measured -1% on a run of this shape; 15% is the bound."""
    from epoverlap_tools import simulate as sim
    from epoverlap_tools.bench_overlap import COMMON, SHAPES
    spans = tmp_path / "spans"
    flags = SHAPES["ratio_h2048_k8_f128"] + COMMON + [
        "--bf16", "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm",
        "--train-iters", "6", "--profile-steps", "4:6", "--profile-dir", str(spans)]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "epoverlap.train", *flags], capture_output=True, text=True, timeout=600,
        env=_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    scenario = sim.build_scenario(sim.parse_args(
        ["--spans", str(spans), "--shape", "ratio_h2048_k8_f128", "--link", "measured",
         "--host-from", str(spans)]))
    rows = sim.replay_steps(scenario)
    assert [row["mode"] for row in rows] == ["ovl"] * 3
    measured = sum(row["measured_ms"] for row in rows)
    simulated = sum(row["simulated_ms"] for row in rows)
    assert abs(simulated / measured - 1) < 0.15, rows
