"""benchmarks/harness/bench_a2a_links.py: the groups, link pairs and byte shares of a host
split (pure CPU), its argument checks, and the whole tool on 4 gloo ranks as 2 emulated hosts
(`slow`): the record's groups, samples, bandwidths and peaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import bench_a2a_links as bl
from job_control import job_env

REPO = Path(__file__).resolve().parents[2]


def test_groups_of_two_hosts_of_two():
    assert bl.group_members(4, 2) == {"intra": [[0, 1], [2, 3]], "inter": [[0, 2], [1, 3]],
                                      "flat": [[0, 1, 2, 3]]}
    assert bl.link_pairs(4, 2) == {"intra": (0, 1), "inter": (0, 2)}


def test_groups_of_one_rank_are_left_out():
    # 2 hosts of one GPU: no intra group, no intra pair
    assert bl.group_members(2, 2) == {"inter": [[0, 1]], "flat": [[0, 1]]}
    assert bl.link_pairs(2, 2) == {"inter": (0, 1)}
    # one host: no rail
    assert bl.group_members(4, 1) == {"intra": [[0, 1, 2, 3]], "flat": [[0, 1, 2, 3]]}
    assert bl.link_pairs(4, 1) == {"intra": (0, 1)}
    assert bl.group_members(8, 4)["inter"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_the_flat_group_is_held_against_the_network_by_the_bytes_that_cross_hosts():
    assert bl.link_share("intra", 2, 2) == ("intra", 0.5)
    assert bl.link_share("inter", 4, 2) == ("inter", 0.75)
    assert bl.link_share("flat", 4, 2) == ("inter", 0.5)  # 2 of 4 quarters go to host 1
    assert bl.link_share("flat", 4, 4) == ("intra", 0.75)  # one host: no network


def test_arguments_and_their_defaults(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = bl.parse_args([])
    assert (args.emulate_hosts, args.mib, args.device) == (2, [1.0, 4.0, 16.0, 64.0], "auto")
    assert bl.parse_args(["--mib", "0.5,2"]).mib == [0.5, 2.0]


@pytest.mark.parametrize("argv, world, local_world, message", [
    (["--emulate-hosts", "3"], 4, 4, "--emulate-hosts 3: must divide the world size 4"),
    (["--emulate-hosts", "2"], 8, 4, "emulated hosts split one machine's ranks"),
    (["--mib", "1,0"], 4, 4, "--mib: invalid mib_list value"),
    (["--iters", "0"], 4, 4, "--iters 0 must be >= 1"),
    (["--beside-gemm", "-1"], 4, 4, "--beside-gemm -1: a GEMM size >= 1, or 0 for none"),
])
def test_bad_arguments_exit_2_naming_them(monkeypatch, capsys, argv, world, local_world,
                                          message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    with pytest.raises(SystemExit) as stop:
        bl.parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_the_gemm_beside_needs_cuda_and_says_so_before_any_group(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert bl.parse_args([]).beside_gemm == 0
    assert bl.main(["--device", "cpu", "--emulate-hosts", "1", "--beside-gemm", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--beside-gemm needs CUDA" in err


@pytest.mark.slow
def test_four_gloo_ranks_as_two_hosts_record_every_group_and_link(tmp_path):
    out = tmp_path / "a2a_links.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", "-m", "benchmarks.harness.bench_a2a_links", "--device", "cpu",
           "--emulate-hosts", "2", "--mib", "0.0625,0.25", "--iters", "3", "--warmup", "1",
           "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                            env=job_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| flat | 4 | 0.25 |" in result.stdout
    record = json.loads(out.read_text())
    assert record["groups"] == {"intra": [[0, 1], [2, 3]], "inter": [[0, 2], [1, 3]],
                                "flat": [[0, 1, 2, 3]]}
    hosts = record["environment"]["nccl_hostid_per_rank"]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]
    assert record["environment"]["backend"] == "gloo" and record["transport"] is None
    results = record["results"]
    assert [(r["group"], r["bytes"]) for r in results] == [
        (group, size) for group in ("intra", "inter", "flat") for size in (2 ** 16, 2 ** 18)]
    for r in results:
        assert len(r["samples_ms"]) == 3 and all(ms > 0 for ms in r["samples_ms"])
        assert len(r["rank_samples_ms"]) == 4
        assert all(len(samples) == 3 for samples in r["rank_samples_ms"])
        assert r["samples_ms"] == [max(column) for column in zip(*r["rank_samples_ms"])]
        assert r["gbps_per_gpu"] > 0 and r["link_gbps"] > 0 and r["of_peak"] > 0
        assert r["link"] == ("intra" if r["group"] == "intra" else "inter")
    peaks = record["peaks"]
    assert {link: peak["pair"] for link, peak in peaks.items()} == {"intra": [0, 1],
                                                                    "inter": [0, 2]}
    for peak in peaks.values():
        assert [s["bytes"] for s in peak["sizes"]] == [2 ** 16, 2 ** 18]
        assert peak["gbps"] == max(s["gbps"] for s in peak["sizes"]) > 0
        for s in peak["sizes"]:
            assert len(s["samples_ms"]) == 3 and all(ms > 0 for ms in s["samples_ms"])
            idle = [i for i, samples in enumerate(s["rank_samples_ms"]) if samples[0] is None]
            assert sorted(set(range(4)) - set(idle)) == peak["pair"]
