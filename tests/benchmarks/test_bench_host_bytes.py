"""benchmarks/harness/bench_host_bytes.py on 4 gloo ranks as 2 hosts of 2 (`slow`): the rows and
bytes each dispatch sends between hosts, counted from the recorded all-to-alls, against the
simulator's balanced-routing formula (written apart from the dispatch): within 3% for every
dispatch at top-8 of 64 and top-4 of 32 experts, and by host below once per rank below once
per expert; with --time, every comm node of every dispatch timed, its bytes the counted
ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.bench_host_bytes import DISPATCHES, changes_for_shape
from epoverlap.simulator.costs import A2aShape
from job_control import job_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bytes_between_hosts_match_the_simulators_dedup(tmp_path):
    out = tmp_path / "host_bytes.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "benchmarks.harness.bench_host_bytes", "--hosts", "2", "--tokens", "2048",
           "--hidden", "128", "--device", "cpu", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=job_env(),
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"64:8", "32:4"}
    for case, dispatches in cases.items():
        for name, got in dispatches.items():
            assert got["rows"] == pytest.approx(got["predicted_rows"], rel=0.03), (case, name)
            assert got["bytes"] == pytest.approx(got["predicted_bytes"], rel=0.03), (case, name)
        sent = [dispatches[name]["bytes"] for name in ("by_host", "per_rank", "per_expert")]
        assert sent == sorted(sent) and sent[0] < 0.6 * sent[2], case


@pytest.mark.slow
def test_timing_covers_every_node_of_every_dispatch_with_the_counted_bytes(tmp_path):
    """--time on 4 gloo ranks as 2 hosts: each dispatch's five nodes timed (positive medians,
    one slowest-rank sample per iteration); the forward dispatch's bytes between hosts are the
    counted ones, the combine's (either direction) the counted rows' hidden bytes; the link's
    peak from --links gives each node's share of it."""
    out, links = tmp_path / "host_timing.json", tmp_path / "links.json"
    links.write_text(json.dumps({"peaks": {"inter": {"gbps": 2.0}}}))
    hidden = 64
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "benchmarks.harness.bench_host_bytes", "--hosts", "2", "--tokens", "256",
           "--hidden", str(hidden), "--cases", "64:8", "--device", "cpu", "--time", "--iters",
           "2", "--warmup", "1", "--links", str(links), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=job_env(),
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| 64:8 | by_host | B.dispatch |" in result.stdout
    record = json.loads(out.read_text())
    assert record["timing"]["peak_between_hosts_gbps"] == 2.0 and record["dtype"] == "float32"
    assert len(set(record["nccl_hostid_per_rank"])) == 2
    for name, got in record["cases"]["64:8"].items():
        nodes = got["timing"]["nodes"]
        assert set(nodes) == {"F.dispatch", "B.dispatch", "F.combine", "B.combine", "exchange"}
        for node, t in nodes.items():
            assert t["median_us"] > 0 and len(t["samples_us"]) == 2, (name, node)
            assert t["of_peak_between_hosts"] == pytest.approx(t["gbps_between_hosts"] / 2.0)
        world = record["world"]
        assert nodes["F.dispatch"]["bytes_between_hosts"] * world == pytest.approx(got["bytes"])
        rows_bytes = got["rows"] * hidden * 4 / world
        for node in ("B.combine", "F.combine"):
            assert nodes[node]["bytes_between_hosts"] == pytest.approx(rows_bytes), (name, node)
        assert nodes["B.dispatch"]["bytes_to_peers"] == pytest.approx(
            nodes["F.dispatch"]["bytes_to_peers"]), name
        counts = A2aShape(256, 8, hidden, 64, 4, world, hosts=2, **changes_for_shape(
            DISPATCHES[name])).counts  # int64 counts a rank sends, its own share included
        assert nodes["exchange"]["bytes_to_peers"] == counts * 8 * (world - 1) / world, name


def test_a_node_is_timed_from_a_common_start_after_the_host_queued_it(monkeypatch):
    """CUDA's order, with the device calls stood in for (no GPU here): the long sleep is queued
    first, then the all-reduce that lines the ranks' streams up, then the start event, then the
    node; a start event already passed when the node was queued is reported host-late; a host
    read (the exchange) finishes before the end event."""
    from benchmarks.harness import bench_host_bytes as bench
    calls = []

    class Event:
        def __init__(self, enable_timing):
            self.name = "start" if not any(c[0] == "event" for c in calls) else "end"
            calls.append(("event", self.name))

        def record(self):
            calls.append(("record", self.name))

        def query(self):
            calls.append(("query", self.name))
            return self.name == "start" and passed

        def synchronize(self):
            calls.append(("synchronize", self.name))

        def elapsed_time(self, other):
            return 3.5

    monkeypatch.setattr(bench.torch.cuda, "_sleep", lambda cycles: calls.append(("sleep",
                                                                                   cycles)))
    monkeypatch.setattr(bench.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench.dist, "all_reduce", lambda flag: calls.append(("all_reduce",)))
    for passed in (False, True):
        calls.clear()
        got = bench.node_ms(lambda: calls.append(("queue",)) or "x",
                            lambda pending: calls.append(("finish", pending)), True, None)
        assert got == (3.5, passed)
        assert calls == [("sleep", bench.LAUNCH_AHEAD_CYCLES), ("all_reduce",),
                         ("event", "start"), ("event", "end"), ("record", "start"), ("queue",),
                         ("query", "start"), ("finish", "x"), ("record", "end"),
                         ("synchronize", "end")]


def test_with_the_exchange_beside_each_all_to_all_node_starts_one_first_and_reads_it():
    from benchmarks.harness import bench_host_bytes as bench
    order = []

    class Exchange:
        def read(self):
            order.append("read")

    def node(name):
        return lambda: order.append(name)
    nodes = object.__new__(bench.NodeBench)  # the calls' order only: no dispatcher needed
    nodes.start_exchange = lambda: (order.append("exchange"), Exchange())[1]
    nodes.dispatch_forward, nodes.backward = node("F.dispatch"), node("backward")
    nodes.combine_forward = node("F.combine")
    for beside in (True, False):
        order.clear()
        nodes.exchange_beside = beside
        calls = nodes.calls()
        assert [name for name, _, _ in calls] == list(bench.NODES)
        for _, queue, finish in calls:
            pending = queue()
            if finish is not None:
                finish(pending)
        plain = ["F.dispatch", "backward", "F.combine", "backward"]
        expected = [step for name in plain for step in ("exchange", name, "read")] if beside \
            else plain
        assert order == expected + ["exchange", "read"]


def test_the_exchange_beside_needs_the_timing(monkeypatch, capsys):
    from benchmarks.harness import bench_host_bytes as bench
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--exchange-beside"])
    assert stop.value.code == 2 and "it needs --time" in capsys.readouterr().err
    assert bench.parse_args(["--time", "--exchange-beside"]).exchange_beside
