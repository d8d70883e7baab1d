"""Pipeline parallelism on gloo (2 and 4 CPU ranks), bit for bit against one stage.

The same model and data with the same microbatches, trained 2 steps (grad clipping active):
PP=2 on 2 ranks against PP=1 on 1 rank, and PP=2 x EP=2 on 4 ranks against PP=1 x EP=2 on 2
ranks, for the sequential 1F1B, the combined 1F1B (--overlap-moe-expert-parallel-comm, P2P on
the comm lane), delayed wgrad and virtual stages: the step-1 grads and final values of every
parameter, the losses and the grad norms have the same bits. Nothing forbids it: every layer
runs the same ops on the same inputs on whichever stage holds it, each parameter's grad adds the
microbatches in the same order (1F1B runs each chunk's backwards in microbatch order), the
reductions over data-parallel ranks have the same groups, and the grad norm and the loss add
per-parameter and per-layer slots in the whole model's order (`training.optimizer.grads`,
`trainer`). Then the same through the CLI: torchrun, `--log-json`, `epoverlap-compare-losses`, and
the profiled step's spans through the timeline tool (a track group per rank, bubbles marked).
PP=2 on 2 ranks runs in the default tier; the rest is the slow tier (`-m slow`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import run_ranks
from epoverlap.cli import timeline
from epoverlap.cli.compare_losses import compare_loss_logs
from pipeline_workers import OVERLAP, TINY_PP, VIRTUAL, WGRAD, mode_results
from epoverlap.config.resolve import SEQUENTIAL_FLAG

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
PP2 = ["--pipeline-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]


class _References(dict):
    """{"ep1": PP=1 on 1 rank, "ep2": PP=1 x EP=2 on 2 ranks} (sequential plans), each run when
    first asked for: the default tier needs only "ep1"."""

    def __init__(self, out: Path):
        super().__init__()
        self.out = out

    def __missing__(self, name: str) -> list:
        world, flags = {"ep1": (1, []), "ep2": (2, EP2)}[name]
        self[name] = run_ranks(mode_results, world, flags, [(name, [])], str(self.out), STEPS)
        return self[name]


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory) -> dict:
    """The references: PP=1 on 1 rank, and PP=1 x EP=2 on 2 ranks (sequential plans)."""
    return _References(tmp_path_factory.mktemp("one_stage"))


def assert_bitwise_equal_to(reference: list, pipelined: list, mode: str) -> None:
    """Every rank's losses and norms; each pipeline's joined stages vs its data rank's
    reference (grads and values of every parameter, as raw bits)."""
    ref_by_dp = {r["dp_rank"]: r for r in reference}
    for rank, result in enumerate(pipelined):
        assert result["losses"] == ref_by_dp[0]["losses"], (mode, rank)
        assert result["norms"] == ref_by_dp[0]["norms"], (mode, rank)
    for dp_rank, ref in ref_by_dp.items():
        stages = [r for r in pipelined if r["dp_rank"] == dp_rank]
        assert sorted(s["stage"] for s in stages) == [0, 1]
        for key in ("grads", "params"):
            joined = {name: bits for s in stages for name, bits in s[key].items()}
            assert sorted(joined) == sorted(ref[key]), (mode, key)
            differing = [name for name in joined if joined[name] != ref[key][name]]
            assert not differing, (mode, key, differing)


def test_pp2_on_two_ranks_equals_one_stage_bitwise(one_stage, tmp_path):
    modes = [("sequential", [SEQUENTIAL_FLAG]), ("overlap", OVERLAP),
             ("virtual_wgrad", VIRTUAL + WGRAD)]
    results = run_ranks(mode_results, 2, PP2, modes, str(tmp_path), STEPS, timeout_s=600)
    reference = [r["ep1"] for r in one_stage["ep1"]]
    for mode, _ in modes:
        assert_bitwise_equal_to(reference, [r[mode] for r in results], mode)
    assert "PP 2 x 2 virtual x DP 1" in results[0]["virtual_wgrad"]["describe"]


@pytest.mark.slow
def test_pp2_ep2_on_four_ranks_equals_one_stage_bitwise(one_stage, tmp_path):
    # the CLI test runs virtual + wgrad here
    modes = [("sequential", [SEQUENTIAL_FLAG]), ("wgrad", WGRAD)]
    results = run_ranks(mode_results, 4, PP2 + EP2, modes, str(tmp_path), STEPS, timeout_s=600)
    reference = [r["ep2"] for r in one_stage["ep2"]]
    for mode, _ in modes:
        assert_bitwise_equal_to(reference, [r[mode] for r in results], mode)
    assert "PP 2 x DP 2 (EP 2 x EDP 1)" in results[0]["sequential"]["describe"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    return env


def _torchrun(nproc: int, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "epoverlap.train", *TINY_PP,
           "--train-iters", str(STEPS), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(),
                          cwd=REPO)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, flags, reference", [
    (2, PP2 + WGRAD + ["--check-for-nan-in-loss-and-grad"], "ep1"),  # stage 0 has no loss
    (4, PP2 + EP2 + VIRTUAL + WGRAD, "ep2")])
def test_cli_pipeline_losses_equal_one_stage_per_compare_tool(one_stage, tmp_path, nproc,
                                                              flags, reference):
    log, spans = tmp_path / "pipeline.jsonl", tmp_path / "spans"
    result = _torchrun(nproc, *flags, "--log-json", str(log), "--profile-steps",
                       f"{STEPS}:{STEPS}", "--profile-dir", str(spans))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "= PP 2" in result.stdout and f"step    {STEPS}/{STEPS}" in result.stdout
    comparison = compare_loss_logs(one_stage[reference][0][reference]["log"], log)
    assert comparison.identical, comparison.message
    assert comparison.steps_compared == comparison.grad_norms_compared == STEPS
    assert timeline.main([str(spans), "--no-png"]) == 0  # one track group per rank
    summary = json.loads((spans / timeline.SUMMARY_FILE).read_text())["spans"]
    ranks = summary["steps"][0]["ranks"]
    assert len(ranks) == nproc and all(row["bubble_us"] > 0 for row in ranks)
    trace = json.loads((spans / timeline.TRACE_FILE).read_text())["traceEvents"]
    nodes = {(e["pid"], e["args"]["node"]) for e in trace if e.get("cat", "").startswith("comm")}
    assert (0, "send") in nodes and (nproc - 1, "recv") in nodes


@pytest.mark.slow
def test_fewer_microbatches_than_stages_exit_2_naming_the_flag():
    env = dict(_env(), WORLD_SIZE="2", RANK="0")  # checked before any process group
    result = subprocess.run([sys.executable, "-m", "epoverlap.train", *TINY_PP, *PP2,
                             "--num-microbatches", "1"], capture_output=True, text=True,
                            timeout=300, env=env, cwd=REPO)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["epoverlap-train: error: --num-microbatches=1: must be >= "
                     "--pipeline-model-parallel-size=2 (every stage needs a microbatch in "
                     "flight)"], result.stderr
