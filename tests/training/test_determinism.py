"""--deterministic-mode without torch's fill of new memory: the setting, and the proof on CPU
ranks that the fill changes no bit of a run (the GPU proof is in tests/training/test_gpu.py).

torch's deterministic mode fills every new tensor (NaN for floats, the largest value for
integers) so that a result read from memory nothing wrote is still reproducible. Were any
result of the training path to read such memory, the run with the fill would see NaN or the
largest integer there and the run without it whatever the allocator handed back: their losses
would differ (or be NaN), which these tests check they do not.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.deterministic

from epoverlap.config import parse_config
from epoverlap.training.setup.environment import setup_environment

REPO = Path(__file__).resolve().parents[2]
TINY = ["--preset", "tiny", "--hidden-size", "64", "--seq-length", "64", "--num-microbatches",
        "4", "--train-iters", "6", "--lr-warmup-iters", "2", "--distributed-timeout-minutes", "3",
        "--expert-model-parallel-size", "2", "--deterministic-mode", "--device", "cpu"]


@pytest.fixture
def restore_determinism():
    algorithms = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(algorithms)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


@pytest.mark.parametrize("extra, fill", [([], False),
                                         (["--deterministic-fill-uninitialized-memory"], True)])
def test_deterministic_mode_fills_new_memory_only_when_asked(restore_determinism, extra, fill):
    torch.utils.deterministic.fill_uninitialized_memory = not fill
    setup_environment(parse_config(["--preset", "tiny", "--device", "cpu",
                                    "--deterministic-mode", *extra]), print)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory is fill
    if fill:
        assert torch.empty(64).isnan().all()


def _losses(tmp_path: Path, name: str, flags: list[str]) -> list[tuple[str, str]]:
    """Per step the bits of the loss and of the grad norm (float.hex)."""
    log = tmp_path / f"{name}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "epoverlap.train", *TINY, *flags, "--log-json", str(log)],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(r["deterministic"] for r in records)
    assert all(math.isfinite(r["loss"]) for r in records), records
    return [(r["loss_hex"], r["grad_norm_hex"]) for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("name, flags", [
    # the overlap and delayed wgrad: two microbatches' tensors live, the wgrad queue's buffers
    ("overlap_wgrad", ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]),
    # fixed-size dispatch blocks with padding rows, and reruns (a quarter of the balanced
    # share overflows every step)
    ("budget_reruns", ["--overlap-moe-expert-parallel-comm", "--moe-dispatch-budget",
                       "0.25"]),
])
def test_runs_with_and_without_the_fill_of_new_memory_give_the_same_bits(tmp_path, name,
                                                                           flags):
    unfilled = _losses(tmp_path, f"{name}_unfilled", flags)
    filled = _losses(tmp_path, f"{name}_filled",
                     flags + ["--deterministic-fill-uninitialized-memory"])
    assert len(unfilled) == 6
    assert filled == unfilled


@pytest.mark.slow
def test_bench_determinism_times_each_setting_and_checks_their_bits():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness.bench_determinism", "--cpu", "--preset", "tiny", "--steps",
         "12", "--cli-rounds", "1", "--ab-rounds", "1", "--ops", "5"], capture_output=True,
        text=True, timeout=300, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "eager: det vs det_fill losses identical; det over 1 rounds identical" in out, out
    table = out[out.index("| mode | free ms/step"):].splitlines()
    assert table[2].startswith("| eager | ") and len(table) == 3, table
    # the in-process A/B: one row per setting, the same loss in each (the fill changes nothing)
    rows = [line for line in out.splitlines() if line.startswith("| eager free |")
            or line.startswith("| eager det |") or line.startswith("| eager det_fill |")]
    assert len(rows) == 3 and len({row.rsplit("|", 2)[1] for row in rows}) == 1, rows
    growth = out[out.index("| op | calls free / det / det_fill"):].split("\n\n")[0]
    assert len(growth.splitlines()) == 2 + 5, growth
