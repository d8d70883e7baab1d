"""How steps are timed and what a step reads (pure CPU, one process): steps that follow one
another are timed end to end from the step before, with one sync at the run's first step and
after anything else that ran between steps (an evaluation here), so the step times add up to
the run's time with nothing left out; the grad norm comes with the step's other figures in one
host read and equals the grad buffers' own norm."""

from __future__ import annotations

import math

import pytest

from checkpoint_workers import FLAGS
from dist_helpers import single_rank_groups
from epoverlap.config import parse_config
from epoverlap.training.loop.trainer import Trainer
from epoverlap.training.optimizer import grads as grads_module
from epoverlap.training.telemetry import step_stats as step_stats_module


@pytest.fixture
def trainer():
    built = Trainer(parse_config(FLAGS + ["--train-iters", "5", "--eval-interval", "3",
                                          "--eval-iters", "1"]),
                    single_rank_groups(), log=lambda msg: None)
    yield built
    built.close()


def test_back_to_back_steps_are_timed_end_to_end_with_a_sync_only_after_other_work(
        trainer, monkeypatch, one_thread):
    stepper, syncs, clocks = trainer.stepper, [], []
    sync_time = stepper.sync_time

    def counted_sync():
        syncs.append(len(clocks))  # the step being timed (0-based) when a sync starts one
        return sync_time()
    monkeypatch.setattr(stepper, "sync_time", counted_sync)
    step = stepper.step

    def clocked(n):
        before = stepper._clock
        result = step(n)
        clocks.append((before, stepper._clock, result.step_time_s))
        return result
    monkeypatch.setattr(stepper, "step", clocked)
    trainer.train()
    assert len(clocks) == 5
    # one sync before step 1, none before steps 2, 3 and 5; the evaluations (after steps 3 and
    # 5) sync themselves, and step 4 starts from a sync of its own
    assert syncs.count(0) == 1 and not {1, 2, 4} & set(syncs) and syncs.count(3) >= 2
    for index, (before, after, elapsed) in enumerate(clocks):
        assert after is not None
        if index in (1, 2, 4):  # after steps 1, 2 and 4: timed from that step's end
            assert before == clocks[index - 1][1]
            assert elapsed == pytest.approx(after - before, abs=1e-12)
        else:  # the first step and the one after the evaluation: from a sync
            assert before is None


def test_the_grad_norm_rides_in_the_steps_one_read(trainer, monkeypatch):
    reads = []
    host_list = step_stats_module.host_list
    for module in (step_stats_module, grads_module):  # the norm was read apart before
        monkeypatch.setattr(module, "host_list",
                            lambda values: reads.append(values.numel()) or host_list(values))
    stepper = trainer.stepper
    result = stepper.step(1)
    assert len(reads) == 1  # the norm, the loss, aux, imbalance, stop flags and tallies
    monkeypatch.undo()
    assert result.grad_norm == math.sqrt(stepper.grads.norm_squared().item())
    assert result.grad_norm == stepper.grads.global_norm()
