"""The contention levers' surface (pure CPU, then one gloo run): the NCCL CTA budget flags of
the expert-parallel communicator and the comm-stream priority, their rules, the pg_options
object built for NCCL, and gloo runs untouched by it."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import epoverlap.config.validate as config
from epoverlap.config import parse_config, validate_config
from epoverlap.errors import ConfigError
from epoverlap.parallel.groups import NcclCtaBudget, build_ep_options

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-experts", "8", "--moe-router-topk", "2", "--train-iters", "5"]
EP2 = ["--expert-model-parallel-size", "2"]
OVERLAP = EP2 + ["--overlap-moe-expert-parallel-comm"]
TIMEOUT = datetime.timedelta(minutes=3)


def test_flags_set_their_fields_and_default_to_nccl_and_a_high_priority_stream():
    cfg = parse_config(BASE)
    assert (cfg.parallel.moe_a2a_nccl_max_ctas, cfg.parallel.moe_a2a_nccl_min_ctas) == (None,
                                                                                         None)
    assert cfg.overlap.comm_stream_priority == "high" and cfg.overlap.comm_stream_high_priority
    assert cfg.parallel.moe_grouped_gemm_sm_carveout is None
    cfg = parse_config(BASE + ["--moe-a2a-nccl-max-ctas", "8", "--moe-a2a-nccl-min-ctas", "2",
                               "--comm-stream-priority", "normal",
                               "--moe-grouped-gemm-sm-carveout", "8"])
    assert cfg.parallel.moe_grouped_gemm_sm_carveout == 8
    assert (cfg.parallel.moe_a2a_nccl_max_ctas, cfg.parallel.moe_a2a_nccl_min_ctas) == (8, 2)
    assert cfg.overlap.comm_stream_priority == "normal"
    assert not cfg.overlap.comm_stream_high_priority


@pytest.fixture
def nccl_configurable(monkeypatch):
    """As on a CUDA build of torch with NCCL >= 2.17 (this CPU build has no NCCL)."""
    monkeypatch.setattr(config, "nccl_config_unavailable", lambda: None)


@pytest.mark.parametrize("argv", [
    EP2 + ["--moe-a2a-nccl-max-ctas", "8"],
    EP2 + ["--moe-a2a-nccl-max-ctas", "64", "--moe-a2a-nccl-min-ctas", "64"],
    EP2 + ["--moe-a2a-nccl-min-ctas", "1"],
    OVERLAP + ["--comm-stream-priority", "normal"],
    OVERLAP + ["--moe-grouped-gemm-sm-carveout", "8", "--moe-a2a-nccl-max-ctas", "8"],
    ["--moe-grouped-gemm-sm-carveout", "64"],
])
def test_accepted_on_cuda(nccl_configurable, argv):
    validate_config(parse_config(BASE + argv), 2, cuda_available=True)


@pytest.mark.parametrize("argv, cuda, flag, fragment", [
    (EP2 + ["--moe-a2a-nccl-max-ctas", "8"], False, "--moe-a2a-nccl-max-ctas=8", "gloo"),
    (["--moe-a2a-nccl-min-ctas", "2", "--expert-model-parallel-size", "1"], True,
     "--moe-a2a-nccl-min-ctas=2",
     "--expert-model-parallel-size > 1"),
    (EP2 + ["--moe-a2a-nccl-max-ctas", "0"], True, "--moe-a2a-nccl-max-ctas=0", "[1, 64]"),
    (EP2 + ["--moe-a2a-nccl-max-ctas", "65"], True, "--moe-a2a-nccl-max-ctas=65", "[1, 64]"),
    (EP2 + ["--moe-a2a-nccl-max-ctas", "4", "--moe-a2a-nccl-min-ctas", "8"], True,
     "--moe-a2a-nccl-min-ctas=8", "<= --moe-a2a-nccl-max-ctas=4"),
    (["--comm-stream-priority", "low"], True, "--comm-stream-priority=low", "high, normal"),
    (EP2 + ["--comm-stream-priority", "normal", "--no-overlap-moe-expert-parallel-comm"], True,
     "--comm-stream-priority=normal",
     "--overlap-moe-expert-parallel-comm"),
    (OVERLAP + ["--comm-stream-priority", "normal"], False, "--comm-stream-priority=normal",
     "CUDA device"),
    (OVERLAP + ["--moe-grouped-gemm-sm-carveout", "8"], False,
     "--moe-grouped-gemm-sm-carveout=8", "on CPU"),
    (["--moe-grouped-gemm-sm-carveout", "0"], True, "--moe-grouped-gemm-sm-carveout=0",
     "[1, 64]"),
    (["--moe-grouped-gemm-sm-carveout", "65"], True, "--moe-grouped-gemm-sm-carveout=65",
     "[1, 64]"),
    (["--moe-grouped-gemm-sm-carveout", "4", "--num-experts", "0"], True,
     "--moe-grouped-gemm-sm-carveout=4", "--num-experts"),
])
def test_refused_naming_the_flag(nccl_configurable, argv, cuda, flag, fragment):
    with pytest.raises(ConfigError) as info:
        validate_config(parse_config(BASE + argv), 2, cuda_available=cuda)
    message = str(info.value)
    assert message.startswith(flag) and fragment in message, message


def test_a_torch_without_nccl_is_named_on_cuda():
    """This CPU build of torch has no NCCL: the check says so, naming the flag."""
    reason = config.nccl_config_unavailable()
    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL")
    assert reason == "this torch build has no NCCL"
    with pytest.raises(ConfigError, match=r"^--moe-a2a-nccl-max-ctas=8: this torch build"):
        validate_config(parse_config(BASE + EP2 + ["--moe-a2a-nccl-max-ctas", "8"]), 2, True)


class FakeNcclConfig:
    """ncclConfig_t's CTA fields as NCCL_CONFIG_INITIALIZER leaves them (undefined: INT_MIN)."""

    def __init__(self):
        self.max_ctas = self.min_ctas = self.cga_cluster_size = -2**31


class FakeOptions:
    def __init__(self):
        self.config, self._timeout = FakeNcclConfig(), datetime.timedelta(minutes=10)


def test_options_carry_the_budget_and_leave_the_rest_to_nccl():
    options = build_ep_options(NcclCtaBudget(max_ctas=8), "nccl", TIMEOUT, FakeOptions)
    assert options.config.max_ctas == 8
    assert options.config.min_ctas == options.config.cga_cluster_size == -2**31  # untouched
    assert options._timeout == TIMEOUT  # the group's timeout: torch warns when they differ
    options = build_ep_options(NcclCtaBudget(max_ctas=16, min_ctas=4), "nccl", TIMEOUT,
                               FakeOptions)
    assert (options.config.max_ctas, options.config.min_ctas) == (16, 4)


def test_no_budget_means_no_options_on_any_backend():
    for budget in (None, NcclCtaBudget()):
        for backend in ("nccl", "gloo"):
            assert build_ep_options(budget, backend, TIMEOUT, FakeOptions) is None


def test_a_budget_on_gloo_is_refused():
    with pytest.raises(ValueError, match="gloo process group: it applies to NCCL"):
        build_ep_options(NcclCtaBudget(min_ctas=2), "gloo", TIMEOUT, FakeOptions)


@pytest.mark.skipif(config.nccl_config_unavailable() is not None,
                    reason="this torch build cannot configure NCCL communicators (CPU build)")
def test_real_nccl_options_take_the_budget():
    options = build_ep_options(NcclCtaBudget(max_ctas=8, min_ctas=2), "nccl", TIMEOUT)
    assert isinstance(options, dist.ProcessGroupNCCL.Options)
    assert (options.config.max_ctas, options.config.min_ctas) == (8, 2)


def test_budget_describes_itself():
    assert NcclCtaBudget().describe() == "NCCL default"
    assert NcclCtaBudget(max_ctas=8, min_ctas=1).describe() == "CTAs max 8, min 1"


@pytest.mark.slow
def test_gloo_groups_are_unaffected_and_a_budget_there_is_refused():
    from dist_helpers import run_ranks
    from gloo_workers import groups_with_a_cta_budget
    results = run_ranks(groups_with_a_cta_budget, 2)
    for rank, (recv, backend, refusal) in enumerate(results):
        assert backend == "gloo"
        assert recv == [0.0 + rank, 10.0 + rank]  # element r of every rank's send, r = me
        assert refusal is not None and "CTAs max 4" in refusal and "gloo" in refusal


def test_bench_overlap_sweep_values():
    from benchmarks.harness.bench_overlap import budget_flags, parse_budgets
    budgets = parse_budgets("default, 16,2", 1)
    assert budgets == [NcclCtaBudget(None, 1), NcclCtaBudget(16, 1), NcclCtaBudget(2, 1)]
    assert parse_budgets("default", None) == [NcclCtaBudget()]
    assert budget_flags(budgets[1]) == ["--moe-a2a-nccl-max-ctas", "16",
                                        "--moe-a2a-nccl-min-ctas", "1"]
    assert budget_flags(NcclCtaBudget()) == []
    for bad in ("", "8,x", "-1"):
        with pytest.raises(ValueError, match="--max-ctas"):
            parse_budgets(bad, None)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU is visible: the run would use NCCL, where the budget is valid")
def test_bench_overlap_refuses_a_budget_on_gloo_in_one_line():
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "benchmarks.harness.bench_overlap",
                             "--max-ctas", "default,8"], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, WORLD_SIZE="2", RANK="0"), cwd=repo)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "bench_overlap: error: --moe-a2a-nccl-max-ctas=8: sets the NCCL communicator of the "
        "expert-parallel group: this run is on CPU, where the groups use gloo (no CTAs to "
        "budget)")
