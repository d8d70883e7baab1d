"""Megatron-LM's checkpoint load options, on one CPU process: --finetune takes the weights alone
and starts at step 1; --no-load-optim starts the optimizer afresh and --no-load-rng keeps the
random state --seed gives, each leaving everything else as a plain resume loads it."""

from __future__ import annotations

import pytest
import torch

from checkpoint_workers import FLAGS
from dist_helpers import single_rank_groups
from epoverlap.config import parse_config
from epoverlap.training.checkpoints.checkpoint_files import find_resume_checkpoint
from epoverlap.training.loop.trainer import Trainer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of step 2 (optimizer state and router generators in it)."""
    folder = tmp_path_factory.mktemp("saved")
    trainer = Trainer(parse_config(FLAGS + ["--train-iters", "2", "--save", str(folder)]),
                      single_rank_groups(), log=lambda msg: None)
    try:
        trainer.train()
    finally:
        trainer.close()
    return folder


def _loaded(saved, *options: str, logs: list = None) -> Trainer:
    argv = FLAGS + ["--train-iters", "4", "--load", str(saved), *options]
    return Trainer(parse_config(argv), single_rank_groups(),
                   log=(logs.append if logs is not None else lambda msg: None),
                   resume=find_resume_checkpoint(str(saved), None))


def _weights(trainer: Trainer) -> dict:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def _optimizer_state(trainer: Trainer) -> list:
    return [trainer.parts.optimizer.state_of(master) for master in trainer.parts.optimizer.masters]


def _balancing_states(trainer: Trainer) -> list:
    return [r.balancing_rng.get_state() for r in trainer.model.routers()]


@pytest.fixture(scope="module")
def plain(saved):
    trainer = _loaded(saved)
    yield trainer
    trainer.close()


def test_a_plain_resume_loads_weights_optimizer_random_state_and_step(plain):
    assert plain.start_step == 2
    assert all(state for state in _optimizer_state(plain))


def test_finetune_takes_the_weights_alone_and_starts_at_step_one(saved, plain):
    logs: list[str] = []
    tuned = _loaded(saved, "--finetune", logs=logs)
    try:
        assert tuned.start_step == 0
        assert all(torch.equal(a, b) for a, b in zip(_weights(tuned).values(),
                                                     _weights(plain).values()))
        assert not any(_optimizer_state(tuned))
        fresh = Trainer(parse_config(FLAGS + ["--train-iters", "4"]), single_rank_groups(),
                        log=lambda msg: None)
        try:
            assert all(torch.equal(a, b) for a, b in zip(_balancing_states(tuned),
                                                         _balancing_states(fresh)))
        finally:
            fresh.close()
        resumed = [line for line in logs if "fine-tuning from the weights of" in line]
        assert len(resumed) == 1 and "(step 2)" in resumed[0], logs
        assert [r.step for r in tuned.train()] == [1, 2, 3, 4]
    finally:
        tuned.close()


def test_no_load_optim_starts_the_optimizer_afresh_at_the_checkpoints_step(saved, plain):
    logs: list[str] = []
    trainer = _loaded(saved, "--no-load-optim", logs=logs)
    try:
        assert trainer.start_step == 2 and not any(_optimizer_state(trainer))
        assert all(torch.equal(a, b) for a, b in zip(_balancing_states(trainer),
                                                     _balancing_states(plain)))
        assert any("at step 2 (optimizer afresh)" in line for line in logs), logs
    finally:
        trainer.close()


def test_no_load_rng_keeps_the_random_state_the_seed_gave(saved, plain):
    trainer = _loaded(saved, "--no-load-rng")
    fresh = Trainer(parse_config(FLAGS + ["--train-iters", "4"]), single_rank_groups(),
                    log=lambda msg: None)
    try:
        assert trainer.start_step == 2 and all(_optimizer_state(trainer))
        assert all(torch.equal(a, b) for a, b in zip(_balancing_states(trainer),
                                                     _balancing_states(fresh)))
        assert not all(torch.equal(a, b) for a, b in zip(_balancing_states(trainer),
                                                         _balancing_states(plain)))
    finally:
        trainer.close()
        fresh.close()
