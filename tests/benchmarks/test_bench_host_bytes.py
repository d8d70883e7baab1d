"""benchmarks/harness/bench_host_bytes.py on 4 gloo ranks as 2 hosts of 2 (`slow`): the rows and
bytes each dispatch sends between hosts, counted from the recorded all-to-alls, against the
simulator's balanced-routing formula (written apart from the dispatch): within 3% for every
dispatch at top-8 of 64 and top-4 of 32 experts, and by host below once per rank below once
per expert."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
