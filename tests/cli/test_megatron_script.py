"""A Megatron-LM user's command line through the real commands (CPU): the pasted Mixtral
example (tests/fixtures/megatron_scripts), its data and tokenizer flags adapted, trains on 2
gloo ranks under torchrun with its accepted-flags note and no refusal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from job_control import REPO, job_env
from megatron_scripts import flag_values, script_args


ADAPTED = {"--tokenizer-type": [], "--tokenizer-model": [],  # a Llama-2 sentencepiece model
           "--wandb-project": [], "--wandb-exp-name": []}   # an optional extra


@pytest.mark.slow
def test_the_pasted_mixtral_example_trains_on_two_cpu_ranks(tmp_path):
    args = [token for group in flag_values(script_args("mixtral_8x7b_distributed.args"))
            if group[0] not in ADAPTED for token in group]
    log = tmp_path / "mixtral.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "epoverlap.train", *args, "--log-json", str(log)],
        capture_output=True, text=True, env=job_env(), cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "accepted from Megatron-LM, no effect here: --use-mcore-models" in result.stdout
    assert "error" not in result.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 8))  # --train-iters 7
    assert records[0]["lr"] > 0 and records[-1]["loss"] < records[0]["loss"]


def test_the_launcher_refuses_each_unbuilt_flag_in_a_line_of_its_own():
    result = subprocess.run([sys.executable, "-m", "epoverlap.cli.launch", "--fp16",
                             "--dynamic-context-parallel"], capture_output=True, text=True,
                            env=job_env(), cwd=REPO, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "epoverlap-launch: error: --fp16=True: fp16 training is not implemented; use --bf16",
        "epoverlap-launch: error: --dynamic-context-parallel=True: dynamic context parallelism "
        "(a CP size per packed microbatch) is not implemented: give a fixed "
        "--context-parallel-size"]
