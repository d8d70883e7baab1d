"""Schedule plans as data: round trips, golden plans, and the validator (pure CPU)."""

from __future__ import annotations

import pytest

from epoverlap.model.nodes import COMM, COMPUTE, NodeKind
from epoverlap.schedule.pipeline import build_plan
from epoverlap.schedule.plan import (Action, PlanError, Step, action_lane, combined_1f1b_plan,
                                     format_plan, node_kinds, parse_plan, plan_to_string,
                                     sequential_plan, validate_plan)

# Written here by hand, independently of the model's NodeSpecs (test_model_cpu checks those).
MOE = (NodeKind("attn", COMPUTE, True), NodeKind("dispatch", COMM), NodeKind("mlp", COMPUTE, True),
       NodeKind("combine", COMM))
DENSE = (NodeKind("attn", COMPUTE, True), NodeKind("mlp", COMPUTE, True))


@pytest.mark.parametrize("text", ["F3.attn.L2", "B2.dispatch.L5", "W2.mlp.L5", "F0.embed",
                                  "B1.loss"])
def test_action_round_trip(text):
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("text", ["X1.attn.L0", "F.attn", "F1.attn.2", "F1"])
def test_bad_action_strings_are_rejected(text):
    with pytest.raises(ValueError, match="not an action"):
        Action.parse(text)


def test_lanes_and_phases():
    kinds = node_kinds([MOE])
    assert action_lane(Action.parse("F1.dispatch.L0"), kinds) == "comm"
    assert action_lane(Action.parse("B1.combine.L0"), kinds) == "comm"
    assert action_lane(Action.parse("W1.mlp.L0"), kinds) == "compute"
    assert action_lane(Action.parse("B1.loss"), kinds) == "compute"
    assert Action.parse("W1.mlp.L0").phase == "wgrad"


def test_a_node_declared_comm_lands_on_the_comm_lane_whatever_its_name():
    layout = [(NodeKind("attn", COMPUTE, True), NodeKind("shuffle", COMM),
               NodeKind("mlp", COMPUTE, True))]
    plan = sequential_plan(layout, 1, delay_wgrad=True)
    validate_plan(plan, layout, 1, delay_wgrad=True)
    grid = format_plan(plan, layout).splitlines()
    assert any(line.rstrip().endswith("| F0.shuffle.L0") for line in grid)
    assert "W0.shuffle.L0" not in plan_to_string(plan)


def test_golden_sequential():
    plan = sequential_plan([MOE], 2)
    assert plan_to_string(plan) == (
        "F0.embed F0.attn.L0 F0.dispatch.L0 F0.mlp.L0 F0.combine.L0 F0.loss "
        "B0.loss B0.combine.L0 B0.mlp.L0 B0.dispatch.L0 B0.attn.L0 B0.embed "
        "F1.embed F1.attn.L0 F1.dispatch.L0 F1.mlp.L0 F1.combine.L0 F1.loss "
        "B1.loss B1.combine.L0 B1.mlp.L0 B1.dispatch.L0 B1.attn.L0 B1.embed")


def test_golden_combined_1f1b_with_delayed_wgrad():
    plan = combined_1f1b_plan([MOE, MOE], 2, delay_wgrad=True)
    assert plan_to_string(plan) == (
        # F0 alone
        "F0.embed F0.attn.L0 F0.dispatch.L0 F0.mlp.L0 F0.combine.L0 "
        "F0.attn.L1 F0.dispatch.L1 F0.mlp.L1 F0.combine.L1 F0.loss "
        # F1 paired with B0, layer 0 of F with layer 1 of B, in the overlap.md order
        "B0.loss F1.embed "
        "B0.combine.L1 F1.attn.L0 B0.mlp.L1 F1.dispatch.L0 W0.mlp.L1 B0.dispatch.L1 "
        "F1.mlp.L0 F1.combine.L0 B0.attn.L1 W0.attn.L1 "
        "B0.combine.L0 F1.attn.L1 B0.mlp.L0 F1.dispatch.L1 W0.mlp.L0 B0.dispatch.L0 "
        "F1.mlp.L1 F1.combine.L1 B0.attn.L0 W0.attn.L0 "
        "F1.loss B0.embed "
        # B1 alone
        "B1.loss B1.combine.L1 B1.mlp.L1 W1.mlp.L1 B1.dispatch.L1 B1.attn.L1 W1.attn.L1 "
        "B1.combine.L0 B1.mlp.L0 W1.mlp.L0 B1.dispatch.L0 B1.attn.L0 W1.attn.L0 B1.embed")


def test_golden_early_release_moves_attention_backward_before_forward_mlp():
    plan = plan_to_string(build_plan("combined_1f1b_early_release", [MOE], 2))
    assert ("B0.combine.L0 F1.attn.L0 B0.mlp.L0 F1.dispatch.L0 B0.dispatch.L0 B0.attn.L0 "
            "F1.mlp.L0 F1.combine.L0") in plan


def test_golden_paired_ends_overlap_the_first_forward_and_the_last_backward():
    """Written from the design (two forwards: each dispatch read issued once the other
    microbatch has compute queued; two backwards: each all-to-all beside the other's compute
    and the weight grads), not from the builder."""
    plan = plan_to_string(build_plan("combined_1f1b_paired_ends", [MOE], 3, True))
    assert plan == (
        # F0 beside F1
        "F0.embed F1.embed F0.attn.L0 F1.attn.L0 F0.dispatch.L0 F0.mlp.L0 F1.dispatch.L0 "
        "F1.mlp.L0 F0.combine.L0 F1.combine.L0 F0.loss F1.loss "
        # F2 beside B0: the combined step
        "B0.loss F2.embed B0.combine.L0 F2.attn.L0 B0.mlp.L0 F2.dispatch.L0 W0.mlp.L0 "
        "B0.dispatch.L0 F2.mlp.L0 F2.combine.L0 B0.attn.L0 W0.attn.L0 F2.loss B0.embed "
        # B1 beside B2
        "B1.loss B2.loss B1.combine.L0 B2.combine.L0 B1.mlp.L0 B1.dispatch.L0 B2.mlp.L0 "
        "W1.mlp.L0 B2.dispatch.L0 W2.mlp.L0 B1.attn.L0 W1.attn.L0 B2.attn.L0 W2.attn.L0 "
        "B1.embed B2.embed")


def test_paired_ends_with_one_microbatch_is_forward_then_backward():
    assert build_plan("combined_1f1b_paired_ends", [MOE], 1) == sequential_plan([MOE], 1)


def test_paired_ends_interleave_an_unknown_layer_node_by_node():
    odd = [NodeKind("attn", COMPUTE, True), NodeKind("router_x", COMPUTE)]
    plan = build_plan("combined_1f1b_paired_ends", [odd], 2, True)
    validate_plan(plan, [odd], 2, True)
    assert plan_to_string(plan).startswith(
        "F0.embed F1.embed F0.attn.L0 F1.attn.L0 F0.router_x.L0 F1.router_x.L0")


def test_a_step_with_a_partner_has_one_direction():
    with pytest.raises(ValueError, match="one forward or one backward"):
        Step((0, 0), (1, 0), partner=(2, 0))
    assert Step((0, 0), partner=(1, 0)).label() == "F0+F1"
    assert Step(None, (2, 0), partner=(3, 0)).label(True) == "B2c0+B3c0"


def test_golden_printed_grid():
    grid = format_plan(parse_plan("F0.embed F0.attn.L0 F0.dispatch.L0"), [MOE])
    assert grid.splitlines()[2:] == [
        "      0 | F0.embed       |",
        "      1 | F0.attn.L0     |",
        "      2 |                | F0.dispatch.L0"]


@pytest.mark.parametrize("layout", [[MOE], [DENSE, MOE], [MOE, DENSE, MOE, MOE]])
@pytest.mark.parametrize("name", ["sequential", "combined_1f1b", "combined_1f1b_early_release",
                                  "combined_1f1b_paired_ends"])
@pytest.mark.parametrize("microbatches", [1, 2, 4])
@pytest.mark.parametrize("delay", [False, True])
def test_every_builder_makes_valid_plans(layout, name, microbatches, delay):
    plan = build_plan(name, layout, microbatches, delay)
    validate_plan(plan, layout, microbatches, delay)
    assert len(plan) == len(set(plan))


def _error(text, layout=(MOE,), microbatches=1, delay=False) -> PlanError:
    with pytest.raises(PlanError) as info:
        validate_plan(parse_plan(text), list(layout), microbatches, delay)
    return info.value


def test_validator_marks_the_bad_step():
    error = _error("F0.embed F0.attn.L0 F0.mlp.L0")
    assert error.step == 2
    assert "needs F0 of dispatch.L0 first" in str(error)
    marked = [line for line in str(error).splitlines() if line.startswith(">>")]
    assert len(marked) == 1 and "F0.mlp.L0" in marked[0] and "<--" in marked[0]


@pytest.mark.parametrize("text, reason", [
    ("F0.embed B0.loss", "backward before its forward"),
    ("F0.embed B0.embed", "needs B0 of attn.L0 first"),
    ("F0.embed F0.embed", "runs twice"),
    ("F0.embed F0.attn.L3", "unknown node attn in layer 3"),
    ("F1.embed", "microbatch 1 outside"),
    ("F0.embed F0.attn.L0 W0.attn.L0", "W action while weight-grad deferral is off"),
])
def test_validator_rejections(text, reason):
    assert reason in str(_error(text))


def test_validator_rejects_backward_out_of_order():
    seq = plan_to_string(sequential_plan([MOE], 1))
    swapped = seq.replace("B0.combine.L0 B0.mlp.L0", "B0.mlp.L0 B0.combine.L0")
    assert "needs B0 of combine.L0 first" in str(_error(swapped))


def test_validator_rejects_missing_and_misplaced_weight_grads():
    seq = plan_to_string(sequential_plan([MOE], 1, delay_wgrad=True))
    assert "W0.mlp.L0 never runs" in str(_error(seq.replace(" W0.mlp.L0", ""), delay=True))
    early = seq.replace(" W0.mlp.L0", "").replace("B0.mlp.L0", "W0.mlp.L0 B0.mlp.L0")
    assert "weight grad before its backward" in str(_error(early, delay=True))
    assert "no weight grads" in str(_error("F0.embed W0.dispatch.L0", delay=True))


def test_incomplete_plan_is_rejected():
    assert "B0.embed never runs" in str(_error(
        plan_to_string(sequential_plan([MOE], 1)).split(" B0.loss")[0]))


# A layer whose attention gathers K/V on the comm lane (context parallelism, allgather).
GATHERED = (NodeKind("qkv", COMPUTE, True), NodeKind("kv_gather", COMM),
            NodeKind("attn", COMPUTE, True)) + MOE[1:]


def _order(plan: list, *texts: str) -> list[int]:
    strings = [str(action) for action in plan]
    return [strings.index(text) for text in texts]


@pytest.mark.parametrize("early", [False, True])
def test_the_kv_gather_runs_beside_the_other_microbatch_s_compute(early):
    """In a pair, F.kv_gather is issued before B.mlp, which hides it, and F.attn after it;
    B.kv_gather comes after B.attn, with W.attn beside it before B.qkv."""
    plan = build_plan("combined_1f1b_early_release" if early else "combined_1f1b",
                      [GATHERED, GATHERED], 3, delay_wgrad=True)
    validate_plan(plan, [GATHERED, GATHERED], 3, delay_wgrad=True)
    order = _order(plan, "F1.qkv.L0", "F1.kv_gather.L0", "B0.mlp.L1", "F1.attn.L0")
    assert order == sorted(order), plan_to_string(plan)
    order = _order(plan, "B0.attn.L0", "B0.kv_gather.L0", "W0.attn.L0", "B0.qkv.L0",
                   "W0.qkv.L0")
    assert order == sorted(order), plan_to_string(plan)

