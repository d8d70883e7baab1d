"""--moe-dispatch-hierarchy node through the training command. CPU: each rule's one error line;
4 gloo ranks as 2 emulated hosts of 2 (top-4, so the combine's per-host sums round apart from
the flat dispatch): overlap + delayed wgrad against the sequential schedule, the same bits;
against the flat once-per-rank dispatch, the same losses to rounding. GPU (2 GPUs as 2 hosts of
1, bf16): nothing is summed apart with one rank per host, so the hierarchy equals the flat
once-per-rank dispatch bit for bit, overlap on or off, and NCCL carries stage 1 over its
network transport."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from epoverlap.config import parse_config, validate_config
from epoverlap.config.resolve import SEQUENTIAL_FLAG, resolve_config
from epoverlap.errors import ConfigError

from gpu_runs import identical_losses, needs_gpus, train_cli
from job_control import REPO, job_env

from benchmarks.harness import train_bench

TINY = ["--preset", "tiny", "--device", "cpu"]
NODE = ["--moe-dispatch-hierarchy", "node"]
FLAT = ["--moe-dispatch-hierarchy", "flat", "--moe-dispatch-once-per-rank"]


@pytest.mark.parametrize("flags, message", [
    (["--expert-model-parallel-size", "4"], "span whole hosts, at least two: EP 4 over hosts "
                                            "of 4 ranks"),
    (["--expert-model-parallel-size", "4", "--emulate-hosts", "2",
      "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
     "needs the dropless, capacity or budget dispatch (not capacity_padded)"),
    (["--expert-model-parallel-size", "2", "--emulate-hosts", "2"], "EP 2 over hosts of 2"),
])
def test_hierarchy_errors_name_the_flag(flags, message, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(TINY + NODE + flags), 4, cuda_available=False)
    assert "--moe-dispatch-hierarchy" in str(err.value) and message in str(err.value)


def test_waves_refuse_the_hierarchy_in_one_line(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    argv = TINY + NODE + ["--expert-model-parallel-size", "4", "--emulate-hosts", "2",
                          "--moe-a2a-waves", "2"]
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(argv), 4, cuda_available=False)
    assert "--moe-a2a-waves" in str(err.value) and "--moe-dispatch-hierarchy flat" in str(err.value)


CPU_RUN = TINY + ["--expert-model-parallel-size", "4", "--emulate-hosts", "2",
                  "--moe-router-topk", "4", "--num-microbatches", "4", "--train-iters", "4",
                  "--deterministic-mode", "--mock-data"]


@pytest.mark.slow
def test_by_host_overlap_is_bitwise_sequential_and_near_flat_on_two_emulated_hosts(tmp_path):
    _, seq = train_cli(tmp_path, "node_seq", 4, CPU_RUN + NODE + [SEQUENTIAL_FLAG])
    out, ovl = train_cli(tmp_path, "node_ovl", 4, CPU_RUN + NODE + [
        "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"])
    assert "dispatch dropless, by host" in out
    assert identical_losses(seq, ovl)
    _, flat = train_cli(tmp_path, "flat", 4, CPU_RUN + FLAT + [SEQUENTIAL_FLAG])
    assert [r["loss"] for r in seq] == pytest.approx([r["loss"] for r in flat], rel=1e-5)
    # the sync-free form: fixed blocks per host and per host mate; 0.5 overflows and reruns
    for budget in ("1.25", "0.5"):
        out, budgeted = train_cli(tmp_path, f"node_budget_{budget}", 4, CPU_RUN + NODE + [
            "--moe-dispatch-budget", budget, "--overlap-moe-expert-parallel-comm",
            "--delay-wgrad-compute"])
        assert "by host" in out and identical_losses(seq, budgeted), budget
    assert any(r.get("dispatch_reruns") for r in budgeted), budgeted


@pytest.mark.slow
def test_local_copies_run_the_hierarchy_and_record_its_compute(tmp_path):
    """The harness's --comm-mode local_copy with the hierarchy (the compute-only baseline the
    simulator reads by-host compute from): 4 gloo ranks as 2 hosts of 2 run it, overlap + delayed
    wgrad, and the span files hold every node of the by-host layer on both lanes, its
    weight grads too."""
    from epoverlap.profiling.spans import read_span_directory
    spans = tmp_path / "spans"
    out, records = train_cli(tmp_path, "node_local", 4, CPU_RUN + NODE + [
        "--train-iters", "2", "--num-microbatches", "2", "--comm-mode", "local_copy",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute", "--profile-steps", "2:2", "--profile-dir", str(spans)],
        module="benchmarks.harness.train_bench")
    assert "dispatch dropless, by host" in out and len(records) == 2
    ranks = read_span_directory(spans)
    assert len(ranks) == 4
    kinds = {(s.lane, s.action[0], s.node) for s in ranks[0].steps[0].spans}
    assert {("compute", p, n) for p in "FB" for n in ("attn", "mlp")} <= kinds
    assert {("comm", p, n) for p in "FB" for n in ("dispatch", "combine")} <= kinds
    assert {("compute", "W", n) for n in ("attn", "mlp")} <= kinds


GPU_RUN = ["--preset", "small", "--train-iters", "12", "--expert-model-parallel-size", "2",
           "--emulate-hosts", "2", "--bf16", "--deterministic-mode", "--mock-data",
           "--cuda-graph-impl", "none", "--tune", "off"]


@pytest.mark.multigpu
@needs_gpus
def test_by_host_on_two_gpus_as_two_hosts_is_the_flat_bits(tmp_path):
    out, node = train_cli(tmp_path, "by_host_ovl", 2, GPU_RUN + NODE + [
        "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"])
    between = [line for line in out.splitlines() if "(between hosts)" in line]
    assert between and all("NET/" in line for line in between), out[-3000:]
    _, node_seq = train_cli(tmp_path, "by_host_seq", 2, GPU_RUN + NODE + [SEQUENTIAL_FLAG])
    _, flat = train_cli(tmp_path, "flat_seq", 2, GPU_RUN + FLAT + [SEQUENTIAL_FLAG])
    assert identical_losses(node_seq, node) and identical_losses(flat, node_seq)


@pytest.mark.multigpu
@needs_gpus
@pytest.mark.parametrize("gpus", [2, pytest.param(4, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs"))])
def test_by_host_budget_in_one_graph_per_iteration_is_the_dropless_bits(tmp_path, gpus):
    """The sync-free hierarchical dispatch (fixed blocks per host and per host mate) inside
    one CUDA graph of the whole iteration, with the overlap and delayed wgrad, against the
    dropless by-host dispatch run sequentially and eager: the same loss and grad norm bits.
    2 GPUs as 2 hosts of 1, 4 GPUs as 2 hosts of 2 (stage 2 over NVLink)."""
    run = GPU_RUN + ["--expert-model-parallel-size", str(gpus)]
    _, seq = train_cli(tmp_path, f"by_host_seq_{gpus}", gpus, run + NODE + [SEQUENTIAL_FLAG])
    out, graphed = train_cli(tmp_path, f"by_host_budget_full_{gpus}", gpus, run + NODE + [
        "--moe-dispatch-budget", "1.25", "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute", "--cuda-graph-impl", "full_iteration"])
    assert "by host" in out and "full_iteration" in out, out[-3000:]
    assert identical_losses(seq, graphed)


@pytest.mark.parametrize("local, flags, want", [
    ("2", [], "node"),  # 2 torchrun nodes of 2 ranks, EP 4 over both
    ("4", [], "flat"),  # one host
    ("4", ["--emulate-hosts", "2"], "node"),
    ("2", ["--moe-router-topk", "1"], "flat"),  # one expert a token: nothing to send once
    ("2", ["--expert-model-parallel-size", "2"], "flat"),  # EP inside a node
    ("1", ["--num-experts", "16", "--moe-router-topk", "2"], "flat"),  # 4 hosts: share 0.90
    ("2", ["--num-experts", "16", "--moe-router-topk", "2"], "node"),  # 2 hosts: share 0.77
    ("2", ["--moe-dispatch-budget", "2.0"], "node"),  # the budget by host: both stages
    ("2", ["--comm-mode", "local_copy"], "node"),  # the harness's local copies: both stages
    ("2", ["--moe-dispatch-hierarchy", "flat"], "flat"),  # given: kept
])
def test_the_auto_hierarchy_follows_the_hosts(local, flags, want, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    cfg = resolve_config(train_bench.parse_config(TINY + flags), 4, cuda_available=False)
    assert cfg.moe.moe_dispatch_hierarchy == want
    chosen = want == "node" and "--moe-dispatch-hierarchy" not in flags
    assert ("--moe-dispatch-hierarchy" in cfg.defaulted) == chosen  # the path line's "auto"
    validate_config(train_bench.parse_config(TINY + flags), 4, cuda_available=False)  # no error


@pytest.mark.slow
def test_bench_overlap_replays_both_stages_on_two_emulated_hosts(tmp_path):
    """bench_overlap on 4 gloo ranks as 2 emulated hosts: the modes take the hierarchical
    dispatch, and T_comm replays each stage's all-to-alls over its own group (the split-size
    exchanges after them: replayed among the stages, ranks that saw them in other orders
    waited on one another)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "benchmarks.harness.bench_overlap", "--shapes", "quick", "--out-dir",
           str(tmp_path), "--iters", "1", "--warmup", "0", "--rounds", "1", "--extra-flags",
           "--emulate-hosts 2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=job_env(),
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    shape = json.loads((tmp_path / "bench_overlap.json").read_text())["results"][0]
    assert all(shape[mode]["fb_ms"] > 0 for mode in ("seq", "ovl", "comp", "comm"))
