"""What a run leaves for a user to find (one CPU process through the training command): with
--log-dir each rank's file holds a header naming the rank and everything the rank printed;
the resolved configuration is printed once and written as JSON beside --log-json."""

from __future__ import annotations

import json
import subprocess
import sys

from job_control import REPO, job_env


def test_log_dir_and_the_resolved_config(tmp_path):
    logs, log_json = tmp_path / "logs", tmp_path / "run.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "epoverlap.train", "--preset", "tiny", "--mock-data",
         "--hidden-size", "64", "--train-iters", "2", "--swiglu", "--log-dir", str(logs),
         "--log-json", str(log_json)],
        capture_output=True, text=True, env=job_env(), cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    text = (logs / "rank-00000.log").read_text()
    assert text.startswith("epoverlap-train: rank 0 of 1 on ")
    for line in result.stdout.splitlines():  # everything printed is in the rank's file too
        assert line in text, line
    assert "step    2/2 |" in text and "accepted from Megatron-LM, no effect here: --swiglu" in text
    config_lines = [line for line in result.stdout.splitlines() if line.startswith("config: ")]
    assert len(config_lines) == 1 and "--hidden-size 64" in config_lines[0]
    saved = json.loads((tmp_path / "run.config.json").read_text())
    assert saved["flags"] == config_lines[0][len("config: "):]
    assert saved["config"]["model"]["hidden_size"] == 64 and saved["world_size"] == 1
