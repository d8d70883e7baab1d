"""gloo tier, dropout (issue 47): with --attention-dropout and --hidden-dropout on 2 CPU ranks
(EP 2; a dense layer, two MoE layers, a shared expert), every overlapped schedule (combined
1F1B, its early-release and paired-ends forms, delayed weight grads, the overlap probe
switching schedules mid-run) gives the sequential schedule's grads and losses bit for bit: the
masks come from each microbatch's seed, never from when or on which lane a node runs."""

from __future__ import annotations

import pytest

from dist_helpers import run_ranks
from gloo_workers import assert_modes_match_sequential, mode_grads_and_losses

DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--num-layers", "3",
           "--moe-first-k-dense-replace", "1", "--moe-shared-expert-intermediate-size", "16"]
STEPS = 8  # the probe alternates schedules over steps 2-7, then keeps one

pytestmark = pytest.mark.slow


def test_overlap_with_dropout_is_bitwise_equal_to_sequential(tmp_path):
    results = run_ranks(mode_grads_and_losses, 2, 2, str(tmp_path), STEPS, DROPOUT,
                        timeout_s=600)
    assert_modes_match_sequential(results, tmp_path, STEPS)
