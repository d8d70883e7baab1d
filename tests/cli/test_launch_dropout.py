"""Launch tier, dropout (issue 47): the main job on 2 CPU ranks (torchrun, EP 2) with
--attention-dropout and --hidden-dropout writes the same losses and grad norms, bit for bit, with
the EP overlap (and delayed weight grads) as without it, and dropout moves the losses."""

from __future__ import annotations

import json

import pytest

from epoverlap.config.resolve import SEQUENTIAL_FLAG
from run_paths import assert_schedules_differ, read_run_record, record_of_output
from test_launch import QUICK, _run, _torchrun

DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
OVERLAP = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]


def _log(tmp_path, name, *extra) -> str:
    """The --log-json of a 4-step run; its output's `config:` and `path:` lines to NAME.path."""
    log = tmp_path / f"{name}.jsonl"
    result = _run(_torchrun(2, *QUICK, "--num-microbatches", "4", "--train-iters", "4",
                            "--deterministic-mode", "--expert-model-parallel-size", "2",
                            "--mock-data", "--log-json", str(log), *extra))
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp_path / f"{name}.path").write_text("\n".join(record_of_output(result.stdout)))
    return str(log)


@pytest.mark.slow
def test_dropout_runs_with_and_without_the_overlap_write_identical_losses(tmp_path):
    off = _log(tmp_path, "off", *DROPOUT, SEQUENTIAL_FLAG)  # auto at EP 2: the overlap
    on = _log(tmp_path, "on", *DROPOUT, *OVERLAP)
    assert_schedules_differ(read_run_record(tmp_path, "off"), read_run_record(tmp_path, "on"))
    compare = _run(["epoverlap-compare-losses", off, on])
    assert compare.returncode == 0, compare.stdout + compare.stderr
    assert compare.stdout.strip() == "identical (4 steps): losses and grad norms"
    plain = _log(tmp_path, "plain")
    with open(plain) as a, open(off) as b:
        assert [json.loads(line)["loss_hex"] for line in a] != \
            [json.loads(line)["loss_hex"] for line in b]
