"""A Megatron-LM user's pretrain flags through the real command (torchrun, 2 gloo ranks, EP 2):
--train-samples sets the step count (samples // global batch), the learning rate follows
--lr-decay-style WSD with --lr-warmup-fraction and --lr-wsd-decay-iters step by step,
--eval-interval / --eval-iters print a validation line and fill the JSON record at each
evaluation and after the last step, and --manual-gc runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from epoverlap.config import parse_config
from epoverlap.training.optimizer.optim import lr_at

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--preset", "tiny", "--mock-data", "--hidden-size", "64", "--seq-length", "64",
         "--micro-batch-size", "2", "--num-microbatches", "2", "--distributed-timeout-minutes",
         "3", "--train-samples", "44",  # global batch 2 x 2 x 2 ranks = 8: 5 steps (44 // 8)
         "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters",
         "2", "--lr-warmup-fraction", "0.2", "--eval-interval", "2", "--eval-iters", "1",
         "--manual-gc", "--manual-gc-interval", "2"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_flags")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "epoverlap.train", *FLAGS, "--expert-model-parallel-size", "2",
           "--log-json", str(out / "log.jsonl")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return result.stdout, records


def test_train_samples_set_the_step_count(job):
    stdout, records = job
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert re.search(r"^step    5/5 \|", stdout, re.M) and "done: 5 steps" in stdout


def test_the_learning_rate_follows_the_wsd_schedule(job):
    _, records = job
    train = parse_config(FLAGS).for_world(2).train
    assert (train.train_iters, train.warmup_steps) == (5, 1)
    assert [r["lr"] for r in records] == [lr_at(s, train) for s in range(1, 6)]
    peak, floor = train.lr, train.min_lr  # warmup 1 step, stable to 3, linear decay 4..5
    assert [r["lr"] for r in records] == pytest.approx([peak, peak, peak, (peak + floor) / 2,
                                                       floor], abs=1e-15)


def test_each_evaluation_is_a_line_and_json_fields(job):
    stdout, records = job
    shown = re.findall(r"^validation at step (\d+) \| loss (\S+) \| ppl \S+ \| \S+ s$", stdout,
                       re.M)
    assert [int(step) for step, _ in shown] == [2, 4, 5]
    by_step = {r["step"]: r for r in records}
    for step, loss in shown:
        assert loss == f"{by_step[int(step)]['valid_loss']:.4f}"
    assert [s for s, r in by_step.items() if "valid_loss_hex" in r] == [2, 4, 5]
