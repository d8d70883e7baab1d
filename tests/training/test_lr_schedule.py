"""The learning-rate schedule (`training.optimizer.optim.lr_at`): each --lr-decay-style (constant,
linear, cosine, WSD with each --lr-wsd-decay-style) against values worked out by hand from
Megatron-LM's `OptimizerParamScheduler.get_lr` at num_steps = our step; --lr-decay-iters,
--lr-warmup-fraction and --lr-wsd-decay-iters; and the default (cosine over --train-iters
after --lr-warmup-iters) equal bit for bit to the formula epoverlap had before the styles."""

from __future__ import annotations

import dataclasses
import math

import pytest

from epoverlap.config import parse_config
from epoverlap.config.sections import TrainConfig
from epoverlap.training.optimizer.optim import lr_at

# peak 1.0, floor 0.1 (delta 0.9), warmup 2 steps, decay over 10 steps: after the warmup the
# decay's progress at step s is (s - 2) / 8
BASE = dict(lr=1.0, min_lr=0.1, lr_warmup_iters=2, train_iters=10)
COS_QUARTER = 0.1 + 0.45 * (1 + math.sqrt(0.5))  # cosine at progress 1/4


def _cfg(**changes) -> TrainConfig:
    return TrainConfig(**{**BASE, **changes})


def _lrs(cfg: TrainConfig, steps) -> list[float]:
    return [lr_at(step, cfg) for step in steps]


def test_warmup_is_linear_from_one_warmup_step_of_the_peak():
    for style in ("constant", "linear", "cosine", "WSD"):
        assert _lrs(_cfg(lr_decay_style=style), (1, 2)) == [0.5, 1.0], style


def test_constant_stays_at_the_peak_past_the_decay_end():
    assert _lrs(_cfg(lr_decay_style="constant"), (3, 6, 10, 11, 50)) == [1.0] * 5


def test_linear():
    got = _lrs(_cfg(lr_decay_style="linear"), (3, 4, 6, 10, 11))
    assert got == pytest.approx([0.1 + 0.9 * 7 / 8, 0.1 + 0.9 * 6 / 8, 0.55, 0.1, 0.1],
                                abs=1e-15)


def test_cosine():
    got = _lrs(_cfg(lr_decay_style="cosine"), (4, 6, 8, 10, 11))
    assert got == pytest.approx([COS_QUARTER, 0.55, 0.1 + 0.45 * (1 - math.sqrt(0.5)), 0.1,
                                 0.1], abs=1e-15)
    assert lr_at(10, _cfg()) == 0.1 and lr_at(11, _cfg()) == 0.1  # the floor exactly


# WSD with --lr-wsd-decay-iters 4: stable at the peak through step 6 (= 10 - 4), then the decay
# shape over steps 7..10 (ratio (s - 6) / 4), the floor after
WSD_HALF = {  # the value at step 8 (ratio 1/2) of each shape
    "linear": 0.1 + 0.9 * 0.5,
    "cosine": 0.1 + 0.9 * 0.5,
    "exponential": 0.1 + 0.9 * (2 * math.sqrt(0.5) - 1),
    "minus_sqrt": 0.1 + 0.9 * (1 - math.sqrt(0.5)),
}
WSD_QUARTER = {  # step 7 (ratio 1/4)
    "linear": 0.1 + 0.9 * 0.75,
    "cosine": 0.1 + 0.9 * 0.5 * (1 + math.sqrt(0.5)),
    "exponential": 0.1 + 0.9 * (2 * 0.5 ** 0.25 - 1),
    "minus_sqrt": 0.1 + 0.9 * 0.5,
}


@pytest.mark.parametrize("shape", sorted(WSD_HALF))
def test_wsd_holds_the_peak_then_decays_in_its_shape(shape):
    cfg = _cfg(lr_decay_style="WSD", lr_wsd_decay_style=shape, lr_wsd_decay_iters=4)
    got = _lrs(cfg, range(1, 13))
    assert got[:6] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert got[6:8] == pytest.approx([WSD_QUARTER[shape], WSD_HALF[shape]], abs=1e-15)
    assert got[9:] == pytest.approx([0.1] * 3, abs=1e-15)  # step 10: the end of the decay
    assert got[8] > 0.1


def test_wsd_without_decay_iters_decays_over_every_step_after_the_warmup():
    cfg = _cfg(lr_decay_style="WSD", lr_wsd_decay_style="linear")
    assert lr_at(6, cfg) == pytest.approx(0.55, abs=1e-15)  # ratio (6 - 2) / 8
    assert lr_at(3, cfg) == pytest.approx(0.1 + 0.9 * 7 / 8, abs=1e-15)


def test_decay_iters_end_the_decay_before_the_last_step():
    """--lr-decay-iters 6: the decay runs over steps 3..6 (progress (s - 2) / 4); the floor
    after, through --train-iters."""
    for style, at_4 in (("cosine", 0.55), ("linear", 0.55)):
        cfg = _cfg(lr_decay_style=style, lr_decay_iters=6)
        assert lr_at(4, cfg) == pytest.approx(at_4, abs=1e-15), style
        assert _lrs(cfg, (6, 7, 10)) == pytest.approx([0.1] * 3, abs=1e-15), style
    wsd = _cfg(lr_decay_style="WSD", lr_wsd_decay_style="linear", lr_decay_iters=6,
               lr_wsd_decay_iters=2)
    assert _lrs(wsd, (4, 5, 6, 9)) == pytest.approx([1.0, 0.55, 0.1, 0.1], abs=1e-15)


def test_warmup_fraction_counts_in_decay_steps():
    cfg = _cfg(lr_warmup_iters=0, lr_warmup_fraction=0.25, lr_decay_iters=8, train_iters=12)
    assert cfg.warmup_steps == 2
    assert _lrs(cfg, (1, 2)) == [0.5, 1.0]
    assert lr_at(5, cfg) == pytest.approx(0.55, abs=1e-15)  # cosine half way over 3..8
    assert lr_at(8, cfg) == 0.1 and lr_at(12, cfg) == 0.1


def test_flags_reach_the_schedule():
    train = parse_config(["--lr", "1.0", "--min-lr", "0.1", "--train-iters", "10",
                          "--lr-warmup-fraction", "0.2", "--lr-decay-style", "WSD",
                          "--lr-wsd-decay-style", "minus_sqrt", "--lr-wsd-decay-iters", "4",
                          "--lr-decay-iters", "10"]).train
    assert train.warmup_steps == 2
    assert lr_at(8, train) == pytest.approx(WSD_HALF["minus_sqrt"], abs=1e-15)


def _old_lr_at(step: int, cfg: TrainConfig) -> float:
    """`lr_at` as it was before the decay styles (commit 019e767), verbatim."""
    if cfg.lr_warmup_iters and step <= cfg.lr_warmup_iters:
        return cfg.lr * step / cfg.lr_warmup_iters
    decay_steps = max(cfg.train_iters - cfg.lr_warmup_iters, 1)
    progress = min(max(step - cfg.lr_warmup_iters, 0) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def test_the_default_schedule_is_the_old_formula_bit_for_bit():
    default = parse_config([]).train
    assert default.lr_decay_style == "cosine" and default.lr_decay_iters is None
    cases = [default, parse_config(["--preset", "tiny"]).train]
    for train_iters, warmup, lr, min_lr in ((20, 2, 3e-3, 3e-4), (8, 3, 3e-3, 3e-4),
                                            (1, 0, 1e-3, 0.0), (3, 3, 1e-4, 1e-5),
                                            (1000, 37, 6e-4, 6e-5), (7, 10, 2e-3, 1e-3)):
        cases.append(dataclasses.replace(default, train_iters=train_iters,
                                         lr_warmup_iters=warmup, lr=lr, min_lr=min_lr))
    for cfg in cases:
        for step in range(1, cfg.train_iters + 3):
            assert lr_at(step, cfg).hex() == _old_lr_at(step, cfg).hex(), (cfg, step)


def test_a_schedule_in_sequences_is_megatron_lm_s_on_sequences_trained():
    """--train-samples with --lr-warmup-samples / --lr-decay-samples: Megatron-LM steps its
    scheduler by the global batch, so at step s it is at s x batch sequences; 3 warmup and 21
    decay sequences over a batch of 2 end the warmup at 1.5 steps, the decay at 10.5."""
    cfg = parse_config(["--micro-batch-size", "1", "--global-batch-size", "2",
                        "--train-samples", "20", "--lr", "1.0", "--min-lr", "0.1",
                        "--lr-decay-style", "linear", "--lr-warmup-samples", "3",
                        "--lr-decay-samples", "21", "--lr-warmup-init", "0.2"]).for_world(2)
    t = cfg.train
    assert (t.train_iters, t.warmup_steps, t.decay_steps) == (10, 1.5, 10.5)

    def megatron(samples: int) -> float:  # get_lr with num_steps in sequences
        if samples <= 3:
            return 0.2 + (1.0 - 0.2) * samples / 3
        return 1.0 - (1.0 - 0.1) * (samples - 3) / (21 - 3)
    for step in (1, 2, 5, 10):
        assert math.isclose(lr_at(step, t), megatron(2 * step), rel_tol=1e-12), step


def test_the_warmup_init_is_where_the_warmup_starts_and_0_keeps_the_bits():
    assert _lrs(_cfg(lr_warmup_init=0.5), (1, 2)) == [0.75, 1.0]
    assert _lrs(_cfg(lr_warmup_init=0.0), range(1, 12)) == _lrs(_cfg(), range(1, 12))
