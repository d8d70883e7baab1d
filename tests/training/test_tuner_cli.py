"""The path tuner through the real command (torchrun, 2 gloo ranks, EP 2, the overlap on):
`--tune on --tune-steps 1` times the six paths (the combined 1F1B and its paired-ends form,
each with delayed weight grads off and on, the combined 1F1B with delayed weight grads and the
all-to-alls in 4 waves of experts, and the sequential schedule) one step each after the first,
prints the decision's table, records it in the --log-json record of the deciding step, and trains with every loss's bits those of a `--tune off` run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--preset", "tiny", "--mock-data", "--hidden-size", "64", "--seq-length", "64",
         "--micro-batch-size", "2", "--num-microbatches", "2", "--distributed-timeout-minutes",
         "3", "--train-iters", "8", "--log-interval", "1", "--kernel-backend", "torch"]
PATHS = ["combined_1f1b", "combined_1f1b+wgrad", "combined_1f1b_paired_ends",
         "combined_1f1b_paired_ends+wgrad", "combined_1f1b+wgrad+w4", "sequential"]


def _train(out: Path, name: str, flags: list[str]) -> tuple[str, list[dict]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    log = out / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "epoverlap.train", *FLAGS, *flags, "--log-json", str(log)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune_cli")
    return _train(out, "off", ["--tune", "off"]), _train(out, "on", ["--tune", "on",
                                                                      "--tune-steps", "1"])


def test_tuning_keeps_every_losss_bits(runs):
    (_, fixed), (_, tuned) = runs
    assert [r["loss_hex"] for r in tuned] == [r["loss_hex"] for r in fixed]
    assert [r["grad_norm_hex"] for r in tuned] == [r["grad_norm_hex"] for r in fixed]
    assert all("path" not in r and "schedule" not in r for r in fixed)


def test_the_paths_take_turns_then_the_chosen_one_stays(runs):
    _, (stdout, tuned) = runs
    ran = [r["path"] for r in tuned]
    assert [r["schedule"] for r in tuned] == ran  # the key's former name, for one release
    (deciding,) = [r for r in tuned if "tuned_path" in r]
    decision = deciding["tuned_path"]
    assert ran[:7] == ["combined_1f1b"] + PATHS and ran[7:] == [decision["chosen"]]
    assert deciding["step"] == 7
    assert decision["window"] == [2, 7] and list(decision["paths"]) == PATHS
    assert decision["cached"] is False and decision["dropped"] == {}
    for name in PATHS:
        assert f"| tune: {name} |" in stdout


def test_rank_0_prints_the_decisions_table_once(runs):
    _, (stdout, tuned) = runs
    lines = stdout.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("tune: steps 2-7, ")]
    assert len(head) == 1, stdout[-3000:]
    table = lines[head[0] + 1:head[0] + 2 + len(PATHS)]
    assert table[0].split() == ["path", "median", "min", "max", "steps"]
    assert [row.split()[0] for row in table[1:]] == PATHS
    chosen = [row.split()[0] for row in table[1:] if row.endswith("  chosen")]
    assert chosen == [tuned[-1]["path"]]
    assert "(tuned: 6 paths, 1 timed step(s) each, steps 2-7)" in stdout


@pytest.mark.slow
def test_allow_rounding_times_the_dispatch_once_per_rank_and_a_cached_rerun_is_its_bits(
        tmp_path):
    """--tune-allow-rounding adds combined_1f1b+wgrad+once: the tuned run's steps before it
    are an untuned run's bits, the step it ran sent once per rank; a rerun whose cached
    decision names it runs it from the first step, the bits of the run pinned to it
    (--moe-dispatch-once-per-rank --delay-wgrad-compute --tune off)."""
    once = "combined_1f1b+wgrad+once"
    cache = tmp_path / "cache"
    _, fixed = _train(tmp_path, "fixed", ["--tune", "off"])
    stdout, tuned = _train(tmp_path, "tuned", ["--tune", "on", "--tune-steps", "1",
                                               "--tune-allow-rounding", "--tune-cache",
                                               str(cache)])
    ran = [r["path"] for r in tuned]
    first = ran.index(once)
    assert [r["loss_hex"] for r in tuned[:first + 1]] == [r["loss_hex"] for r in fixed[:first + 1]]
    assert f"| tune: {once} |" in stdout
    (decision_file,) = cache.glob("*.json")
    decision = json.loads(decision_file.read_text())
    decision["chosen"] = once  # as if it had been the fastest
    decision_file.write_text(json.dumps(decision))
    stdout, cached = _train(tmp_path, "cached", ["--tune", "on", "--tune-steps", "1",
                                                 "--tune-allow-rounding", "--tune-cache",
                                                 str(cache)])
    assert f"tune: cached {once}" in stdout and {r["path"] for r in cached} == {once}
    _, pinned = _train(tmp_path, "pinned", ["--tune", "off", "--moe-dispatch-once-per-rank",
                                            "--delay-wgrad-compute"])
    assert [(r["loss_hex"], r["grad_norm_hex"]) for r in cached] == [
        (r["loss_hex"], r["grad_norm_hex"]) for r in pinned]
