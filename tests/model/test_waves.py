"""--moe-a2a-waves K (issue 46): an MoE layer's all-to-alls in K waves of local experts.

Pure CPU: the expert groups; the cut into waves and its reverse are copies both ways (against
an index-by-index reference); the plans put the nodes of a layer in waves in the unsplit node's
place and validate; the executor's chains let wave i's nodes run beside wave i+1's inside a
microbatch and join them before the next node of no wave; the flag's errors. gloo (2 CPU
ranks, EP 2): training in waves gives the unsplit sequential schedule's grads and losses bit
for bit, sequential and overlapped, K dividing the local experts or not, dropless and
capacity."""

from __future__ import annotations

import pytest
import torch

from epoverlap.config import parse_config
from epoverlap.config.resolve import validate_config
from epoverlap.errors import ConfigError
from epoverlap.model.waves import expert_groups, join_waves, split_by_wave
from epoverlap.model.nodes import COMM, COMPUTE, NodeKind
from epoverlap.schedule.executor import Chains
from epoverlap.schedule.plan import (Action, combined_1f1b_paired_ends_plan, combined_1f1b_plan,
                                     sequential_plan, validate_plan)

from dist_helpers import run_ranks
from gloo_workers import (TINY, assert_modes_match_sequential, extreme_routing_training,
                          mode_grads_and_losses)
from run_paths import assert_paths_differ


def test_expert_groups_are_contiguous_and_near_equal():
    assert expert_groups(4, 2) == [(0, 2), (2, 4)]
    assert expert_groups(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert expert_groups(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert expert_groups(16, 1) == [(0, 16)]
    for bad in (0, 4):
        with pytest.raises(ValueError):
            expert_groups(3, bad)


def test_cutting_into_waves_and_back_copies_rows_and_grads():
    """Rows of 3 ranks x 2 waves, runs of sizes send[r][k] in (rank, wave) order: wave k
    holds rank 0's run k, rank 1's run k, ... (checked row by row); joining is the inverse;
    the grads flow back as the same copies (no sums: grads of ones stay ones)."""
    send_RK = [[2, 0], [1, 3], [0, 2]]
    rows = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    waves = split_by_wave(rows, send_RK)
    start, expected = 0, [[], []]
    for r in range(3):
        for k in range(2):
            expected[k] += list(range(start, start + send_RK[r][k]))
            start += send_RK[r][k]
    for k in range(2):
        assert torch.equal(waves[k], rows.detach()[expected[k]])
    assert torch.equal(join_waves(waves, send_RK), rows.detach())
    grads = [torch.full_like(c, float(k + 1)) for k, c in enumerate(waves)]
    torch.autograd.backward(waves, grads)
    assert torch.equal(rows.grad, join_waves(grads, send_RK))
    assert sorted(rows.grad[:, 0].tolist()) == [1.0] * 3 + [2.0] * 5


def _layer_in_waves(waves: int) -> tuple[NodeKind, ...]:
    kinds = [NodeKind("attn", COMPUTE, True)]
    kinds += [NodeKind(f"dispatch_w{k}", COMM, slot="dispatch", wave=k) for k in range(waves)]
    for k in range(waves):
        kinds += [NodeKind(f"mlp_w{k}", COMPUTE, True, slot="mlp", wave=k),
                  NodeKind(f"return_w{k}", COMM, slot="mlp", wave=k)]
    return tuple(kinds + [NodeKind("combine", COMM)])


@pytest.mark.parametrize("delay", [False, True])
def test_plans_run_wave_nodes_in_the_unsplit_nodes_places(delay):
    layout = [_layer_in_waves(3), _layer_in_waves(3)]
    for build in (sequential_plan, combined_1f1b_plan, combined_1f1b_paired_ends_plan):
        validate_plan(build(layout, 4, delay), layout, 4, delay)
    plan = [str(a) for a in combined_1f1b_plan(layout, 2, delay)]
    # F1's layer 0 beside B0's layer 1: B0's returns and experts (last wave first), then F1's
    # dispatches, B0's dispatch grads, F1's experts and returns, F1's combine
    pair = plan[plan.index("B0.combine.L1"):plan.index("F1.combine.L0") + 1]
    order = [a for a in pair if ".W" not in a and not a.startswith(("W",))]
    assert order == ["B0.combine.L1", "F1.attn.L0",
                     "B0.return_w2.L1", "B0.mlp_w2.L1", "B0.return_w1.L1", "B0.mlp_w1.L1",
                     "B0.return_w0.L1", "B0.mlp_w0.L1",
                     "F1.dispatch_w0.L0", "F1.dispatch_w1.L0", "F1.dispatch_w2.L0",
                     "B0.dispatch_w2.L1", "B0.dispatch_w1.L1", "B0.dispatch_w0.L1",
                     "F1.mlp_w0.L0", "F1.return_w0.L0", "F1.mlp_w1.L0", "F1.return_w1.L0",
                     "F1.mlp_w2.L0", "F1.return_w2.L0", "F1.combine.L0"]
    if delay:
        assert [a for a in pair if a.startswith("W")] == ["W0.mlp_w2.L1", "W0.mlp_w1.L1",
                                                          "W0.mlp_w0.L1"]
    assert str(Action.parse("W3.mlp_c12.L4")) == "W3.mlp_c12.L4"


def test_chains_let_waves_run_apart_and_join_them_after():
    """A node of wave c waits on the microbatch's chain the first time, then on the wave's
    own; the next node of no wave waits on the microbatch and every wave opened since."""
    chains = Chains()
    assert chains.step(0, None) == ([0], 0)  # attn
    assert chains.step(0, 0) == ([0], (0, 0))  # dispatch_w0: after attn
    assert chains.step(0, 1) == ([0], (0, 1))  # dispatch_w1: after attn, not after c0
    assert chains.step(1, None) == ([1], 1)  # another microbatch shares nothing
    assert chains.step(0, 0) == ([(0, 0)], (0, 0))  # mlp_w0: after dispatch_w0 only
    assert chains.step(0, 1) == ([(0, 1)], (0, 1))  # mlp_w1: after dispatch_w1 only
    assert chains.step(0, None) == ([0, (0, 0), (0, 1)], 0)  # combine: after all of them
    assert chains.step(0, 0) == ([0], (0, 0))  # the next layer's wave 0 starts afresh


@pytest.mark.parametrize("flags, message", [
    (["--moe-a2a-waves", "3"], "must be <= the 2 local experts"),
    (["--moe-a2a-waves", "0"], "must be >= 1"),
    (["--moe-a2a-waves", "2", "--moe-dispatch-budget", "1.5", "--cuda-graph-impl", "local",
      "--cuda-graph-modules", "moe"], "needs nodes no graph merges"),
    (["--moe-a2a-waves", "2", "--moe-expert-capacity-factor", "1.0",
      "--moe-pad-expert-input-to-capacity"], "not capacity_padded"),
    (["--moe-a2a-waves", "2", "--moe-dispatch-once-per-rank"], "once per rank"),
    (["--moe-a2a-waves", "2", "--expert-model-parallel-size", "1"],
     "--expert-model-parallel-size > 1"),
])
def test_a2a_waves_errors_name_the_flag(flags, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = TINY + ["--expert-model-parallel-size", "2", "--device", "cpu"] + flags
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(argv), 2, cuda_available=False)
    assert "--moe-a2a-waves" in str(err.value) and message in str(err.value)


SIX_EXPERTS = ["--num-experts", "6"]  # 3 local experts on each of 2 ranks
WAVES = {
    "sequential": ["--no-overlap-moe-expert-parallel-comm"],
    "seq_k3": ["--no-overlap-moe-expert-parallel-comm", "--moe-a2a-waves", "3"],
    "overlap_wgrad_k2": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
                         "--moe-a2a-waves", "2"],
}
WAVES_SLOW = {
    **WAVES,
    "seq_k2": ["--no-overlap-moe-expert-parallel-comm", "--moe-a2a-waves", "2"],
    "overlap_k3": ["--overlap-moe-expert-parallel-comm", "--moe-a2a-waves", "3"],
    "paired_ends_wgrad_k3": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
                             "--overlap-plan", "combined_1f1b_paired_ends",
                             "--moe-a2a-waves", "3"],
    "early_release_k2": ["--overlap-moe-expert-parallel-comm", "--overlap-plan",
                         "combined_1f1b_early_release", "--moe-a2a-waves", "2"],
}

WAVES_DIFFER = {name: lambda a, b: assert_paths_differ(a, b, "dispatch")
                 for name in ("seq_k2", "seq_k3")}  # the same schedule, in waves


def test_waves_training_is_bitwise_the_unsplit_sequential(tmp_path):
    results = run_ranks(mode_grads_and_losses, 2, 2, str(tmp_path), 3, SIX_EXPERTS, WAVES,
                        timeout_s=300)
    assert_modes_match_sequential(results, tmp_path, 3, WAVES, WAVES_DIFFER)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    [],
    ["--moe-expert-capacity-factor", "1.0"],
    ["--moe-shared-expert-intermediate-size", "16", "--hidden-dropout", "0.1",
     "--moe-first-k-dense-replace", "1", "--num-layers", "3"],
], ids=["dropless", "capacity", "shared_dropout_dense"])
def test_waves_training_is_bitwise_in_every_schedule(tmp_path, extra):
    results = run_ranks(mode_grads_and_losses, 2, 2, str(tmp_path), 6, SIX_EXPERTS + extra,
                        WAVES_SLOW, timeout_s=600)
    assert_modes_match_sequential(results, tmp_path, 6, WAVES_SLOW, WAVES_DIFFER)


def test_a_wave_with_nothing_to_send_anywhere_trains_like_unsplit():
    """Every token routed to EP rank 0's experts: rank 1's waves of experts receive nothing
    from anyone (all-to-alls of zero rows both ways); the losses are the unsplit run's."""
    overlap = ["--overlap-moe-expert-parallel-comm"]
    in_waves = run_ranks(extreme_routing_training, 2, 2, overlap + ["--moe-a2a-waves", "2"])
    plain = run_ranks(extreme_routing_training, 2, 2, overlap)
    assert in_waves[0][1] == plain[0][1] and in_waves[0][1][2:] == [0, 0]
    assert [float.hex(x) for x in in_waves[0][0]] == [float.hex(x) for x in plain[0][0]]
