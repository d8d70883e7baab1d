"""Megatron-LM's own MoE scripts through the real commands (CPU), shrunk by the one rule
(`megatron_scripts.shrunk`, paths under the run's folder): on 2 gloo ranks under torchrun each
trains (its accepted-flags note, then every step) or stops in one run, every refusal a line
of its own; and the launcher refuses each flag epoverlap does not build in a line of its own,
before torchrun starts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from job_control import REPO, job_env
from megatron_scripts import (DEEPSEEK_V2_LITE, EP_OVERLAP, MIXTRAL, QWEN3, RANKS, pasted,
                              write_run_files)

MLA = ["--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
       "--qk-pos-emb-head-dim", "--v-head-dim"]
OUTCOMES = {  # None: trains its 6 steps; else the flags of the refusal lines, in order
    MIXTRAL: None, QWEN3: None,
    DEEPSEEK_V2_LITE: MLA[:1] + MLA[2:] + ["--rotary-scaling-factor"], EP_OVERLAP: MLA}


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripts")
    write_run_files(root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OUTCOMES))
def test_each_script_trains_or_is_refused_in_one_run_on_two_cpu_ranks(name, run_folder):
    log = run_folder / f"{name}.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={RANKS}", "-m", "epoverlap.train", *pasted(name, run_folder),
         "--log-json", str(log)],
        capture_output=True, text=True, env=job_env(), cwd=run_folder, timeout=600)
    refused = OUTCOMES[name]
    errors = [line.split(": error: ", 1)[1] for line in result.stderr.splitlines()
              if line.startswith("epoverlap-train: error: ")]
    if refused is not None:
        assert result.returncode != 0 and [e.split("=", 1)[0] for e in errors] == refused, \
            result.stderr[-3000:]
        return
    assert result.returncode == 0 and not errors, result.stderr[-3000:]
    assert "accepted from Megatron-LM, no effect here: " in result.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))  # the rule's --train-iters 6
    assert all(math.isfinite(r["loss"]) for r in steps)  # random tokens: nothing to learn
    if name == MIXTRAL:  # --eval-interval 3 through the 2 pipeline stages; --split 99990,8,2
        assert [r["step"] for r in steps if "valid_loss" in r] == [3, 6]


def test_the_launcher_refuses_each_unbuilt_flag_in_a_line_of_its_own():
    result = subprocess.run([sys.executable, "-m", "epoverlap.cli.launch", "--fp16",
                             "--hybrid-context-parallel"], capture_output=True, text=True,
                            env=job_env(), cwd=REPO, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "epoverlap-launch: error: --fp16=True: fp16 training is not implemented; use --bf16",
        "epoverlap-launch: error: --hybrid-context-parallel=True: hybrid context parallelism "
        "(sub-samples regrouped over the DP x CP ranks) is not implemented: give "
        "--dynamic-context-parallel (a CP size per microbatch)"]
