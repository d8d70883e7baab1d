"""--moe-router-force-load-balancing (the benchmark router: random logits) on gloo: each
data-parallel rank draws its own routing, as learned routers route each rank's tokens their own
way (one draw shared by every rank made each rank send every other the same rows, a friendlier
pattern than any real run); a rank's draw is the same in every build, and its routing gives the
same bits under every schedule."""

from __future__ import annotations

import torch

from dist_helpers import run_ranks
from gloo_workers import (MODES, assert_modes_match_sequential, forced_balance_routings,
                          mode_grads_and_losses)


def test_each_rank_draws_its_own_routing_and_draws_it_again_in_a_new_build():
    (rank0, builds0), (rank1, builds1) = run_ranks(forced_balance_routings, 2, 2, 2)
    assert (rank0, rank1) == (0, 1)
    for maps in (builds0, builds1):
        assert len(maps[0]) == 2  # both layers are MoE layers
        for first, again in zip(*maps):  # per router: a fresh build draws the same routings
            assert all(torch.equal(a, b) for a, b in zip(first, again))
        for first, second in maps[0]:  # a router's next forward draws anew
            assert not torch.equal(first, second)
        layer0, layer1 = maps[0]
        assert not torch.equal(layer0[0], layer1[0])  # each layer draws its own
    for mine, theirs in zip(builds0[0], builds1[0]):  # per layer, forward: the ranks differ
        for a, b in zip(mine, theirs):
            assert a.sum() == b.sum() and not torch.equal(a, b)


def test_forced_balance_routing_gives_the_same_bits_in_every_schedule(tmp_path):
    """The draw happens once per microbatch's router forward, in microbatch order, on every
    schedule: the overlap and delayed weight grads give the sequential bits."""
    modes = {name: MODES[name] for name in ("sequential", "overlap_wgrad")}
    results = run_ranks(mode_grads_and_losses, 2, 2, str(tmp_path), 3,
                        ["--moe-router-force-load-balancing"], modes, timeout_s=300)
    assert_modes_match_sequential(results, tmp_path, 3, modes)
