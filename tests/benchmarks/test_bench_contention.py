"""benchmarks/harness/bench_contention.py: its arguments, the sizes it derives from the Megatron shapes
(worked out by hand from the megatron-cmp preset), the beside-window arithmetic on made-up
event times, the table and JSON it writes (pure CPU); the whole tool on one GPU (`gpu`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epoverlap.parallel.groups import NcclCtaBudget
from benchmarks.harness import bench_contention as bc

REPO = Path(__file__).resolve().parents[2]


def test_arguments_and_their_defaults():
    args = bc.parse_args([])
    assert args.shapes == ["megatron_e32_k4_mbs2x8", "megatron_e8_k8_f4096_mbs8x4"]
    assert args.loads == ["nccl", "triton_copy", "sm_copy", "memcpy_d2d", "d2h_pinned"]
    assert args.computes == ["gemm", "grouped"]
    assert args.budgets == [NcclCtaBudget()]  # one rank: NCCL runs no kernel to budget
    assert args.copy_ctas == ["sms", "32", "16", "8", "4", "2"]
    assert args.compute_sms == ["all"]  # the GEMMs on every SM, no green context
    assert bc.parse_args(["--compute-sms", "all, 124,116c"]).compute_sms == ["all", "124", "116c"]
    assert [bc.split_compute_sms(v) for v in ("all", "124", "116c")] == [
        (None, False), (124, False), (116, True)]
    loads = bc.loads_of(args, sms=132)
    assert [(load.kind, load.label()) for load in loads] == [
        ("nccl", "NCCL default"), ("triton_copy", "132"), ("triton_copy", "32"),
        ("triton_copy", "16"), ("triton_copy", "8"), ("triton_copy", "4"), ("triton_copy", "2"),
        ("sm_copy", "-"), ("memcpy_d2d", "-"), ("d2h_pinned", "-")]


def test_two_ranks_sweep_the_nccl_budget_by_default(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert bc.parse_args([]).budgets == [NcclCtaBudget(), NcclCtaBudget(16), NcclCtaBudget(8),
                                         NcclCtaBudget(4), NcclCtaBudget(2)]
    args = bc.parse_args(["--max-ctas", "default,8", "--min-ctas", "1", "--loads", "nccl",
                          "--computes", "grouped", "--scale", "0.5", "--ep", "4"])
    assert args.budgets == [NcclCtaBudget(None, 1), NcclCtaBudget(8, 1)]
    assert (args.loads, args.computes, args.scale, args.ep) == (["nccl"], ["grouped"], 0.5, 4)


@pytest.mark.parametrize("argv, message", [
    (["--loads", "nccl,rdma"], "--loads 'nccl,rdma': allowed: nccl"),
    (["--shapes", "nope"], "--shapes 'nope': allowed:"),
    (["--computes", ""], "--computes '': allowed: gemm, grouped"),
    (["--max-ctas", "8,lots"], "'lots' is neither 'default' nor a CTA count"),
    (["--scale", "2"], "--scale 2.0: must be in (0, 1]"),
    (["--iters", "0"], "--iters 0: must be >= 1"),
    (["--ep", "0"], "--ep 0: must be >= 1"),
    (["--copy-ctas", "sms,0"], "--copy-ctas 'sms,0': counts >= 1 or 'sms'"),
    (["--compute-sms", "all,0"], "--compute-sms 'all,0': 'all' or SM counts >= 1"),
    (["--compute-sms", "most"], "--compute-sms 'most': 'all' or SM counts >= 1"),
    (["--compute-sms", "120cc"], "--compute-sms '120cc': 'all' or SM counts >= 1"),
])
def test_bad_arguments_exit_2_naming_them(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        bc.parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_sizes_of_the_megatron_shapes_by_hand():
    # megatron-cmp: hidden 2048, 16 heads (no GQA: 16 kv heads of 128), seq 2048, 32 experts,
    # top-4, expert FFN 1024, micro batch 2
    e32 = bc.bench_sizes("megatron_e32_k4_mbs2x8", ep=2)
    assert (e32.tokens, e32.hidden, e32.qkv_out) == (2 * 2048, 2048, 2048 + 2 * 16 * 128)
    assert (e32.rows, e32.local_experts, e32.expert_ffn) == (4096 * 4, 16, 1024)
    assert e32.a2a_bytes == 16384 * 2048 * 2 == 64 * 2**20
    assert e32.grouped_flops == 2 * 16384 * 2048 * 2048
    # the e8 shape: 8 experts, top-8, FFN 4096, micro batch 8
    e8 = bc.bench_sizes("megatron_e8_k8_f4096_mbs8x4", ep=2)
    assert (e8.tokens, e8.rows, e8.local_experts, e8.expert_ffn) == (16384, 131072, 4, 4096)
    assert e8.a2a_bytes == 512 * 2**20
    assert "all-to-all 131072 rows x 2048 bf16 = 512.0 MiB per rank" in e8.describe()
    assert bc.bench_sizes("megatron_e8_k8_f4096_mbs8x4", ep=8).local_experts == 1


def test_scaled_sizes_keep_whole_aligned_rows_per_expert():
    small = bc.bench_sizes("megatron_e32_k4_mbs2x8", ep=2, scale=0.05, world=2)
    assert small.tokens == 208  # 4096 x 0.05 = 204.8, to a multiple of 16
    assert small.rows == 1024  # 832 routed rows up to a multiple of 16 rows x 16 experts x 2
    assert small.rows % (16 * small.local_experts * 2) == 0
    with pytest.raises(ValueError, match="--ep 3 does not divide the 32 experts"):
        bc.bench_sizes("megatron_e32_k4_mbs2x8", ep=3)


def test_beside_windows_by_hand():
    # loads back to back from 0 to 50.8 with 0.2-us gaps; GEMMs from 5 to 45, then one at
    # 49-60 that the loads cover for 1.8 of its 11 us
    loads = [(0, 10), (10.2, 20.2), (20.4, 30.4), (30.6, 40.6), (40.8, 50.8)]
    gemms = [(5, 15), (15, 27), (27, 45), (49, 60)]
    beside = bc._beside([loads, gemms])
    # covered: 9.8 of 10, 11.8 of 12, 17.6 of 18 (>= 90%); not 1.8 of 11
    assert beside.computes_inside == 3 and beside.compute_ms == 12  # median of 10, 12, 18
    # loads covered by the GEMMs (5..45, 49..60): the middle three; 0-10 and 40.8-50.8 only
    # for 5 and 6 of their 10 us
    assert beside.loads_inside == 3 and beside.comm_ms == 10
    assert beside.load_duty == pytest.approx((5 + 10 + 10 + 10 + 10) / 55)
    assert beside.compute_duty == pytest.approx((40 + 1.8) / 50.8)


def test_covered_walks_the_busy_intervals():
    busy = [(0.0, 2.0), (3.0, 5.0), (8.0, 9.0)]
    assert bc._covered(1.0, 4.0, busy) == 2.0
    assert bc._covered(5.0, 8.0, busy) == 0.0
    assert bc._covered(-1.0, 10.0, busy) == 5.0


def test_the_plan_outlasts_the_gemms():
    gemms, lead, loads = bc.together_plan(compute_ms=0.2, load_ms=1.0, iters=20)
    assert gemms == 20  # 4 loads of 1 ms fit in 20 GEMMs of 0.2 ms
    assert lead == 3  # (20 x 0.05 + 1) ms of host queueing, one load each, plus one
    assert (loads - lead) * 1.0 >= gemms * 0.2 * bc.SLOWDOWN_MARGIN
    assert bc.together_plan(0.005, 10.0, 20)[0] == 4000  # 8000 GEMMs asked for: the cap
    # more GEMMs asked for (a retry): more loads ahead to cover their queueing
    assert bc.together_plan(0.2, 1.0, 20, gemms=80)[1] == 6  # (80 x 0.05 + 1) / 1 + 1


def _row(**over):
    row = {"shape": "s", "compute": "gemm", "load": "nccl", "ctas": "max 8",
           "compute_sms": "124", "bytes": 2e9,
           "ran_as": "ncclDevKernel_SendRecv", "compute_alone_ms": 2.0,
           "compute_beside_ms": 2.2, "comm_alone_ms": 4.0, "comm_beside_ms": 5.0,
           "load_duty": 0.98}
    return bc.finish_row({**row, **over})


def test_rows_get_both_slowdowns_and_the_table_prints_them(tmp_path):
    row = _row()
    assert row["compute_slowdown"] == pytest.approx(1.1)
    assert row["comm_slowdown"] == pytest.approx(1.25)
    assert row["comm_gbps"] == pytest.approx(500.0)  # 2e9 bytes in 4 ms
    missing = _row(compute_beside_ms=None, load="d2h_pinned", ctas="-")
    assert missing["compute_slowdown"] is None
    table = bc.markdown_table([row, missing]).splitlines()
    assert table[0].startswith("| shape | compute | load | CTAs | compute SMs | compute alone ms |")
    assert table[2] == ("| s | gemm | nccl | max 8 | 124 | 2.000 | 2.200 | 1.100 | 4.000 | "
                        "5.000 | 1.250 | 500 | 0.98 | ncclDevKernel_SendRecv |")
    assert table[3].split(" | ")[6:8] == ["-", "-"]
    path = bc.write_report(tmp_path / "out", {"rows": [row, missing]})
    assert json.loads(path.read_text())["rows"][1]["compute_slowdown"] is None


def test_the_symm_vdev_load_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    """Without CUDA and NVSHMEM (here), or with an EP group short of the world, the load names
    itself and why, in one line, before touching a buffer."""
    import torch.distributed as dist
    from types import SimpleNamespace
    from benchmarks.harness import bench_symm_a2a
    sizes = bc.bench_sizes("megatron_e32_k4_mbs2x8", 2, 0.05)
    groups = SimpleNamespace(ep_size=2, ep=SimpleNamespace(pg=None))
    with pytest.raises(RuntimeError, match=r"^bench_contention --loads symm_vdev: needs CUDA"):
        bc.symm_vdev_load(groups, sizes, torch.device("cpu"))
    monkeypatch.setattr(bench_symm_a2a, "unavailable", lambda: "")
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 4)
    with pytest.raises(RuntimeError, match=r"whole world of 2\+ GPUs \(EP 2, world 4\)"):
        bc.symm_vdev_load(groups, sizes, torch.device("cpu"))


def test_without_a_gpu_it_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    result = subprocess.run([sys.executable, "-m", "benchmarks.harness.bench_contention"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bench_contention: needs a CUDA GPU (GEMMs beside NCCL all-to-alls and copies on CUDA "
        "streams); none is visible here"]


def _run_one_rank(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """The tool as one process (world size 1, no torchrun variables) at 5% of the
    megatron_e32_k4_mbs2x8 tokens, 3 iterations after 1 warm-up, plus `args`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), str(REPO / ".pathshim"), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.harness.bench_contention", "--shapes",
         "megatron_e32_k4_mbs2x8", "--scale", "0.05", "--iters", "3", "--warmup", "1", *args,
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_whole_tool_on_one_gpu_at_a_tiny_size(tmp_path):
    """World size 1 (its own single-process NCCL group): two NCCL budgets, the CTA-limited
    copy at two grids and the three other copies beside both GEMMs, a few iterations at 5% of
    the tokens."""
    result = _run_one_rank(tmp_path, "--max-ctas", "default,2", "--copy-ctas", "sms,2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sizes: megatron_e32_k4_mbs2x8 (EP 2): T=208 tokens" in result.stdout
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| shape | compute | load | CTAs |") and len(table) == 16
    report = json.loads((tmp_path / bc.JSON_FILE).read_text())
    assert report["environment"]["world"] == 1
    rows = report["rows"]
    sms = str(torch.cuda.get_device_properties(0).multi_processor_count)
    assert [(r["load"], r["ctas"]) for r in rows[::2]] == [
        ("nccl", "NCCL default"), ("nccl", "max 2"), ("triton_copy", sms), ("triton_copy", "2"),
        ("sm_copy", "-"), ("memcpy_d2d", "-"), ("d2h_pinned", "-")]
    assert [r["compute"] for r in rows] == ["gemm", "grouped"] * 7
    for row in rows:
        assert row["compute_alone_ms"] > 0 and row["comm_alone_ms"] > 0, row
        assert row["bytes"] == 1024 * 2048 * 2 and row["ran_as"], row
        assert row["compute_slowdown"] is None or row["compute_slowdown"] > 0, row
        assert row["ran_as"] != "nothing on the GPU", row
        assert 0 <= row["load_duty"] <= 1.0 + 1e-6 and len(row["plan"]) == 3, row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemms_on_a_green_context_of_fewer_sms(tmp_path):
    """--compute-sms: the GEMMs alone and beside a copy on every SM, then on a green context of
    all but 16 SMs, without and with the GEMMs carved out to it; every row timed and labelled
    with its SM count. Where this torch has no green contexts the tool must say so in one
    line (exit 2), not run on every SM unlabelled. More SMs than the GPU has: the same."""
    from torch.cuda import green_contexts
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = _run_one_rank(tmp_path, "--loads", "triton_copy", "--copy-ctas", "8", "--computes",
                           "grouped", "--compute-sms", f"all,{sms - 16},{sms - 16}c")
    too_many = _run_one_rank(tmp_path, "--loads", "triton_copy", "--computes", "grouped",
                             "--compute-sms", f"{sms}c")
    assert too_many.returncode == 2, too_many.stderr[-3000:]
    assert too_many.stderr.strip().splitlines()[-1] == (
        f"bench_contention: --compute-sms {sms}c: this GPU has {sms} SMs; give fewer, or 'all'")
    if not getattr(green_contexts, "SUPPORTED", False):
        assert result.returncode == 2 and "built without CUDA green contexts" in result.stderr
        return
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / bc.JSON_FILE).read_text())["rows"]
    assert [r["compute_sms"] for r in rows] == ["all", str(sms - 16), f"{sms - 16}c"]
    for row in rows:
        assert row["compute_alone_ms"] > 0 and row["compute_beside_ms"] > 0, row
        assert row["comm_alone_ms"] > 0 and row["comm_beside_ms"] > 0, row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_host_transport_load_runs_on_copy_engines_beside_both_gemms(tmp_path):
    """The host-memory all-to-all's load (two ranks' transports in this process, slots of
    256 KiB: several chunks a pair): timed alone and beside both GEMMs, and the profiler sees
    only copies (device-to-host and host-to-device), no kernel."""
    # full size (the last --scale wins): at 5% both GEMMs run for microseconds, launch-bound,
    # and their busy time covered no load in two of the H200 runs
    result = _run_one_rank(tmp_path, "--loads", "host_transport", "--host-slot-kib", "256",
                           "--scale", "1.0")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / bc.JSON_FILE).read_text())["rows"]
    assert [(r["load"], r["compute"]) for r in rows] == [("host_transport", "gemm"),
                                                         ("host_transport", "grouped")]
    for row in rows:
        assert row["comm_alone_ms"] > 0 and row["comm_beside_ms"] is not None, row
        assert "Memcpy DtoH" in row["ran_as"] and "Memcpy HtoD" in row["ran_as"], row
        assert "Kernel" not in row["ran_as"] and "kernel" not in row["ran_as"], row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_peer_transport_load_runs_device_to_device_beside_both_gemms(tmp_path):
    """The peer-memory all-to-all's load (two ranks' transports in this process, their slots
    on this GPU, 256 KiB: several chunks a pair): timed alone and beside both GEMMs, and the
    profiler sees device-to-device copies, none through the host."""
    result = _run_one_rank(tmp_path, "--loads", "peer_transport", "--host-slot-kib", "256",
                           "--scale", "1.0")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / bc.JSON_FILE).read_text())["rows"]
    assert [(r["load"], r["compute"]) for r in rows] == [("peer_transport", "gemm"),
                                                         ("peer_transport", "grouped")]
    for row in rows:
        assert row["comm_alone_ms"] > 0 and row["comm_beside_ms"] is not None, row
        assert "Memcpy DtoD" in row["ran_as"] and "DtoH" not in row["ran_as"], row
