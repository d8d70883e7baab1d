"""What a run reports besides its step (pure CPU, one process): the ETA counts the steps left to
--train-iters (after a resume too), the W&B sink (a stub `wandb` module in sys.modules) logs
TensorBoard's scalars under the same tags, offline unless WANDB_API_KEY is set, and is finished
on every way out of training; --manual-gc collects between steps only and gives the collector
back at the end, also after a failing step."""

from __future__ import annotations

import gc
import math
import sys
import types
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from checkpoint_workers import FLAGS
from dist_helpers import single_rank_groups
from epoverlap.config import parse_config
from epoverlap.training.loop import manual_gc as manual_gc_module
from epoverlap.training.telemetry.metrics import EvalResult
from epoverlap.training.loop.manual_gc import ManualGC
from epoverlap.training.telemetry.metrics import (IMBALANCE_WARN_STEPS, Reporter, StepResult,
                                                  format_duration, imbalance_warn_limit)
from epoverlap.training.telemetry.tensorboard import SCALAR_TAGS, scalars_of
from epoverlap.training.loop.trainer import Trainer
from epoverlap.training.telemetry.wandb_log import WandbLog


def _reporter(flags: list[str]) -> Reporter:
    """A reporter of this config on one CPU rank, with none of a built run's other pieces."""
    groups = SimpleNamespace(device=torch.device("cpu"), is_first=lambda: True)
    return Reporter(parse_config(flags), groups, print, data=None, params={}, backend="torch",
                    recorder=None, compile_watch=None)


def _result(step: int, seconds: float) -> StepResult:
    return StepResult(step=step, loss=5.0 / step, lr=1e-3, grad_norm=0.5, aux_loss=0.02,
                      load_imbalance=1.5, step_time_s=seconds, tokens=1000, peak_mem_gib=None,
                      tflops_per_gpu=0.01)


# ------------------------------------------------------------------------------ the ETA
def test_eta_counts_the_steps_left_to_train_iters_after_a_resume():
    reporter = _reporter(["--train-iters", "20"])
    results = [_result(11, 9.0), _result(12, 1.0), _result(13, 2.0)]  # resumed at step 10
    # 7 steps left (not 20 - 3), at the mean of the steps after this process's first
    assert reporter._eta(results[-1], results) == f" | ETA {format_duration(7 * 1.5)}"
    assert reporter._eta(results[0], results[:1]) == f" | ETA {format_duration(9 * 9.0)}"
    done = [_result(step, 1.0) for step in (19, 20)]
    assert reporter._eta(done[-1], done) == ""  # step 20/20: nothing left


# ---------------------------------------------------------------------------- the collapse warning
def _watched(flags: list[str], imbalances: list[float], capsys) -> str:
    """What the imbalance watch prints over steps of these imbalances."""
    reporter = _reporter(flags)
    for step, imbalance in enumerate(imbalances, 1):
        reporter._watch_imbalance(replace(_result(step, 1.0), load_imbalance=imbalance))
    return capsys.readouterr().err


def test_the_collapse_warning_fires_at_8_experts_top_2_where_4_is_the_most(capsys):
    assert imbalance_warn_limit(8, 2) == pytest.approx(3.6)  # 0.9 x E / k = 0.9 x 4
    assert imbalance_warn_limit(64, 2) == 4.0 and imbalance_warn_limit(0, 2) == math.inf
    e8k2 = ["--num-experts", "8", "--moe-router-topk", "2"]
    # the tiny preset's collapse: 3.96-4.00, never above 4
    collapsed = _watched(e8k2, [3.96, 4.0] * (IMBALANCE_WARN_STEPS // 2), capsys)
    assert collapsed.count("warning: load imbalance at or above 3.6 for 20 steps") == 1
    assert "(now 4.00 at step 20)" in collapsed
    assert _watched(e8k2, [4.0] * (IMBALANCE_WARN_STEPS - 1), capsys) == ""  # one step short
    streak_broken = [4.0] * 10 + [3.5] + [4.0] * (IMBALANCE_WARN_STEPS - 1)
    assert _watched(e8k2, streak_broken, capsys) == ""
    # with many experts the limit stays 4
    e64 = ["--num-experts", "64", "--moe-router-topk", "2"]
    assert _watched(e64, [3.9] * IMBALANCE_WARN_STEPS, capsys) == ""
    assert "at or above 4 for 20" in _watched(e64, [4.0] * IMBALANCE_WARN_STEPS, capsys)


# ------------------------------------------------------------------------------ W&B
class _Run:
    def __init__(self, **settings):
        self.settings, self.logged, self.finished = settings, [], 0

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, dict(data)))

    def finish(self) -> None:
        self.finished += 1


@pytest.fixture
def wandb_stub(monkeypatch):
    """A `wandb` module whose init returns a `_Run` (the runs made are in `.runs`)."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**settings):
        module.runs.append(_Run(**settings))
        return module.runs[-1]
    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return module


def test_wandb_logs_the_tensorboard_scalars_offline_beside_the_json_log(wandb_stub, tmp_path):
    cfg = parse_config(["--wandb-project", "proj", "--wandb-exp-name", "run-1",
                        "--log-json", str(tmp_path / "logs" / "run.jsonl")])
    sink = WandbLog(cfg)
    run = wandb_stub.runs[0]
    assert run.settings["project"] == "proj" and run.settings["name"] == "run-1"
    assert run.settings["mode"] == "offline" and run.settings["dir"] == str(tmp_path / "logs")
    assert run.settings["config"]["train"]["train_iters"] == cfg.train.train_iters
    plain = _result(1, 0.25).to_json()
    evaluated = {**_result(2, 0.25).to_json(), **EvalResult(2, 2.5, 0.1, 3).record()}
    for record in (plain, evaluated):
        sink.write(record)
    sink.close()
    sink.close()  # once only
    assert run.logged == [(1, scalars_of(plain)), (2, scalars_of(evaluated))]
    assert run.logged[1][1]["lm loss validation"] == 2.5
    assert run.logged[1][1]["lm loss validation ppl"] == pytest.approx(12.182493960703473)
    assert "lm loss validation" not in run.logged[0][1]
    assert set(run.logged[1][1]) <= set(SCALAR_TAGS.values())
    assert run.finished == 1


def test_wandb_goes_online_with_an_api_key_into_its_save_dir(wandb_stub, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    WandbLog(parse_config(["--wandb-project", "p", "--wandb-save-dir", str(tmp_path / "w")]))
    assert wandb_stub.runs[0].settings["mode"] == "online"
    assert wandb_stub.runs[0].settings["dir"] == str(tmp_path / "w")
    assert (tmp_path / "w").is_dir()


def _trainer(argv: list[str]) -> Trainer:
    return Trainer(parse_config(FLAGS + argv), single_rank_groups(), log=lambda msg: None)


def test_a_run_logs_every_step_and_evaluation_to_wandb_and_finishes(wandb_stub, tmp_path,
                                                                     one_thread):
    trainer = _trainer(["--train-iters", "3", "--wandb-project", "p", "--wandb-save-dir",
                        str(tmp_path), "--eval-interval", "2", "--eval-iters", "1"])
    try:
        results = trainer.train()
    finally:
        trainer.close()
    (run,) = wandb_stub.runs
    assert [step for step, _ in run.logged] == [1, 2, 3]
    assert [data["lm loss"] for _, data in run.logged] == [r.loss for r in results]
    assert [("lm loss validation" in data) for _, data in run.logged] == [False, True, True]
    assert run.finished == 1


def test_a_failing_step_still_finishes_the_wandb_run(wandb_stub, tmp_path, one_thread):
    trainer = _trainer(["--wandb-project", "p", "--wandb-save-dir", str(tmp_path)])
    step = trainer.step

    def fail_at_2(number):
        if number == 2:
            raise RuntimeError("step 2 failed")
        return step(number)
    trainer.step = fail_at_2
    try:
        with pytest.raises(RuntimeError, match="step 2 failed"):
            trainer.train()
    finally:
        trainer.close()
    (run,) = wandb_stub.runs
    assert [s for s, _ in run.logged] == [1] and run.finished == 1


# ------------------------------------------------------------------------------ --manual-gc
@pytest.fixture
def collections(monkeypatch):
    """Each gc.collect() of `training.loop.manual_gc`, with whether the collector was enabled."""
    calls = []
    monkeypatch.setattr(manual_gc_module.gc, "collect", lambda: calls.append(gc.isenabled()))
    return calls


def test_manual_gc_collects_at_the_start_and_every_interval_only(collections):
    assert gc.isenabled()
    control = ManualGC(True, 3)
    control.start()
    assert not gc.isenabled() and collections == [False]
    for step in range(1, 8):
        control.after_step(step)
    assert len(collections) == 3  # the start, steps 3 and 6
    control.stop()
    assert gc.isenabled()
    once = ManualGC(True, 0)  # 0: at the start only
    once.start()
    for step in range(1, 5):
        once.after_step(step)
    once.stop()
    assert len(collections) == 4 and gc.isenabled()
    off = ManualGC(False, 2)
    off.start()
    off.after_step(2)
    off.stop()
    assert len(collections) == 4 and gc.isenabled()


def test_manual_gc_in_a_run_and_after_a_failing_step(collections, one_thread):
    seen = []
    trainer = _trainer(["--manual-gc", "--manual-gc-interval", "2"])
    step = trainer.step
    trainer.step = lambda number: seen.append(gc.isenabled()) or step(number)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert seen == [False] * 4 and len(collections) == 3 and gc.isenabled()  # start, 2, 4
    trainer = _trainer(["--manual-gc", "--manual-gc-interval", "2"])
    trainer.step = lambda number: 1 / 0
    try:
        with pytest.raises(ZeroDivisionError):
            trainer.train()
    finally:
        trainer.close()
    assert gc.isenabled()


# ------------------------------------------------------------------------------ MFU
def test_mfu_on_the_step_line_record_and_summary_only_when_known():
    from epoverlap.training.telemetry.metrics import RunSummary
    known = [replace(_result(step, seconds), megatron_tflops_per_gpu=tflops, mfu=tflops / 989.0)
             for step, seconds, tflops in ((1, 1.0, 300.0), (2, 3.0, 500.0))]
    record = known[0].to_json()
    assert record["megatron_tflops_per_gpu"] == 300.0 and record["mfu"] == 300.0 / 989.0
    cpu = replace(_result(1, 1.0), megatron_tflops_per_gpu=0.01)
    assert "mfu" not in cpu.to_json()
    reporter = _reporter(["--train-iters", "2"])
    assert " | MFU 30.3% | " in reporter._step_line(known[0], known)
    assert "MFU" not in reporter._step_line(cpu, [cpu])
    summary = RunSummary(steps=2, seconds=4.0, tokens=2000, first_loss=5.0, last_loss=2.5,
                         peak_mem_gib=1.0, on_gpu=True)
    summary.add_flops(known)
    assert summary.megatron_tflops_per_gpu == pytest.approx(450.0)  # time-weighted
    assert summary.line("/GPU").endswith("| 450 TFLOP/s (Megatron-LM formula), MFU 45.5%")


# ------------------------------------------------------------------------------ the path
def test_the_record_names_a_tuned_steps_path_under_path_and_its_former_key_schedule():
    tuned = replace(_result(1, 1.0), path="combined_1f1b+wgrad+w4").to_json()
    assert tuned["path"] == tuned["schedule"] == "combined_1f1b+wgrad+w4"
    untuned = _result(1, 1.0).to_json()
    assert "path" not in untuned and "schedule" not in untuned
