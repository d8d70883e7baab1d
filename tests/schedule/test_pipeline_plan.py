"""Pipeline schedules as data (pure CPU): 1F1B and interleaved steps per stage (golden), the
one-stage case equal to the existing plans, every combination valid and deadlock-free across
stages, the cross-stage check catching transfers out of order, and the per-rank grid."""

from __future__ import annotations

import pytest

from epoverlap.model.nodes import COMM, COMPUTE, RECV, SEND, NodeKind
from epoverlap.model.stages import describe_layers, stage_chunks, stage_layers
from epoverlap.config.sections import OVERLAP_PLANS
from epoverlap.schedule.pipeline import (PipelineError, build_plan, format_pipeline,
                                         format_steps, microbatch_groups, named_plans,
                                         pipeline_plans, pipeline_steps, simulate_pipeline,
                                         validate_pipeline)
from epoverlap.schedule.plan import (EMBED, LOSS, PLANS, Chunk, PlanForm, combined_1f1b_plan,
                                     combined_1f1b_paired_ends_plan, expand_steps,
                                     plan_to_string, sequential_plan, stage_layout)

# Written here by hand, independently of the model's NodeSpecs (test_model_cpu checks those).
MOE = (NodeKind("attn", COMPUTE, True), NodeKind("dispatch", COMM), NodeKind("mlp", COMPUTE, True),
       NodeKind("combine", COMM))
DENSE = (NodeKind("attn", COMPUTE, True), NodeKind("mlp", COMPUTE, True))
SEND_KIND = NodeKind("send", COMM, p2p=SEND)
RECV_KIND = NodeKind("recv", COMM, p2p=RECV)


def stage_layouts(stages: int, virtual: int, layers_per_chunk: int = 1, layer=MOE) -> list:
    """Every stage's chunks for a model of identical layers, as the model would declare them."""
    num_layers = stages * virtual * layers_per_chunk
    return [[Chunk(c.layers[0], tuple(layer for _ in c.layers),
                   EMBED if c.has_embedding else RECV_KIND, LOSS if c.has_loss else SEND_KIND)
             for c in stage_chunks(num_layers, stages, virtual, stage)]
            for stage in range(stages)]


def steps_text(stages, virtual, microbatches, combined) -> list[str]:
    return [format_steps(pipeline_steps(s, stages, virtual, microbatches, combined), virtual)
            for s in range(stages)]


def test_stage_chunks_follow_megatron_core_layout():
    assert [list(c.layers) for c in stage_chunks(8, 2, 2, 0)] == [[0, 1], [4, 5]]
    assert [list(c.layers) for c in stage_chunks(8, 2, 2, 1)] == [[2, 3], [6, 7]]
    first, last = stage_chunks(8, 2, 2, 0)[0], stage_chunks(8, 2, 2, 1)[1]
    assert first.has_embedding and first.next_stage == 1 and not first.has_loss
    assert last.has_loss and last.prev_stage == 0
    assert stage_chunks(8, 2, 2, 1)[0].next_stage == 0  # the ring: stage 1 feeds stage 0
    assert describe_layers(stage_layers(8, 2, 2, 0)) == "L0-1, L4-5"


@pytest.mark.parametrize("layout", [[MOE], [DENSE, MOE], [MOE, DENSE, MOE]])
@pytest.mark.parametrize("delay", [False, True])
def test_one_stage_pipeline_is_the_sequential_and_the_combined_plan(layout, delay):
    chunks = [Chunk(0, tuple(layout))]
    for microbatches in (1, 3):
        plain = pipeline_plans([chunks], microbatches, PLANS["sequential"], delay)[0]
        assert plain == sequential_plan(layout, microbatches, delay)
        combined = pipeline_plans([chunks], microbatches, PLANS["combined_1f1b"], delay)[0]
        assert combined == combined_1f1b_plan(layout, microbatches, delay)
        early = pipeline_plans([chunks], microbatches, PLANS["combined_1f1b_early_release"],
                               delay)[0]
        assert early == combined_1f1b_plan(layout, microbatches, delay, early_release=True)


ONE_STAGE_BUILDERS = {  # each registered plan's one-stage builder in `plan`
    "sequential": sequential_plan,
    "combined_1f1b": combined_1f1b_plan,
    "combined_1f1b_early_release": lambda *args: combined_1f1b_plan(*args, early_release=True),
    "combined_1f1b_paired_ends": combined_1f1b_paired_ends_plan,
}


@pytest.mark.parametrize("name", list(PLANS))
def test_a_plan_name_has_one_road_to_its_plans_and_one_stage_gets_its_builders_plan(name):
    """Training (`named_plans`) and the simulator (`build_plan`, `named_plans` of one stage)
    go from a name to its plans by one road, the registry `PLANS`; one stage of one chunk gets
    the plan of that plan's one-stage builder."""
    assert set(ONE_STAGE_BUILDERS) == set(PLANS)
    for layout in ([MOE], [DENSE, MOE]):
        for microbatches in (1, 2, 4):
            for delay in (False, True):
                assert (named_plans(name, [[Chunk(0, layout)]], microbatches, delay)[0]
                        == build_plan(name, layout, microbatches, delay)
                        == ONE_STAGE_BUILDERS[name](layout, microbatches, delay)), (layout, delay)


def test_the_registry_names_every_plan_the_flags_name_and_only_those():
    assert set(PLANS) == {"sequential", *OVERLAP_PLANS}
    for build in (lambda: named_plans("zigzag", [[Chunk(0, MOE)]], 2),
                  lambda: build_plan("zigzag", [MOE], 2)):
        with pytest.raises(ValueError, match="plan 'zigzag': allowed sequential, combined_1f1b"):
            build()


def test_golden_1f1b_steps():
    assert steps_text(2, 1, 4, False) == ["F0 F1+B0 F2+B1 F3+B2 B3",
                                          "F0+B0 F1+B1 F2+B2 F3+B3"]
    assert steps_text(4, 1, 6, False) == ["F0 F1 F2 F3+B0 F4+B1 F5+B2 B3 B4 B5",
                                          "F0 F1 F2+B0 F3+B1 F4+B2 F5+B3 B4 B5",
                                          "F0 F1+B0 F2+B1 F3+B2 F4+B3 F5+B4 B5",
                                          "F0+B0 F1+B1 F2+B2 F3+B3 F4+B4 F5+B5"]


def test_golden_combined_1f1b_steps_have_one_more_warmup_forward():
    """With the EP overlap every stage runs one more forward first, so that no step pairs a
    forward and a backward of the same microbatch (the last stage's would depend)."""
    assert steps_text(2, 1, 4, True) == ["F0 F1 F2+B0 F3+B1 B2 B3",
                                         "F0 F1+B0 F2+B1 F3+B2 B3"]
    assert steps_text(4, 1, 4, True) == ["F0 F1 F2 F3 B0 B1 B2 B3",
                                         "F0 F1 F2 F3+B0 B1 B2 B3",
                                         "F0 F1 F2+B0 F3+B1 B2 B3",
                                         "F0 F1+B0 F2+B1 F3+B2 B3"]


def test_golden_interleaved_steps():
    assert steps_text(2, 2, 4, False) == [
        "F0c0 F1c0 F0c1 F1c1 F2c0+B0c1 F3c0+B1c1 F2c1+B0c0 F3c1+B1c0 B2c1 B3c1 B2c0 B3c0",
        "F0c0 F1c0 F0c1+B0c1 F1c1+B1c1 F2c0+B0c0 F3c0+B1c0 F2c1+B2c1 F3c1+B3c1 B2c0 B3c0"]
    assert steps_text(4, 2, 8, False)[0] == (
        "F0c0 F1c0 F2c0 F3c0 F0c1 F1c1 F2c1 F3c1 F4c0 F5c0 F6c0+B0c1 F7c0+B1c1 F4c1+B2c1 "
        "F5c1+B3c1 F6c1+B0c0 F7c1+B1c0 B2c0 B3c0 B4c1 B5c1 B6c1 B7c1 B4c0 B5c0 B6c0 B7c0")
    assert steps_text(4, 2, 8, True)[3] == (
        "F0c0 F1c0 F2c0 F3c0 F0c1 F1c1+B0c1 F2c1+B1c1 F3c1+B2c1 F4c0+B3c1 F5c0+B0c0 F6c0+B1c0 "
        "F7c0+B2c0 F4c1+B3c0 F5c1+B4c1 F6c1+B5c1 F7c1+B6c1 B7c1 B4c0 B5c0 B6c0 B7c0")


def test_microbatch_groups_take_the_remainder_first():
    assert [list(g) for g in microbatch_groups(4, 2)] == [[0, 1], [2, 3]]
    assert [list(g) for g in microbatch_groups(7, 2)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(g) for g in microbatch_groups(3, 2)] == [[0, 1, 2]]


@pytest.mark.parametrize("stages, virtual", [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (2, 3),
                                             (4, 2)])
@pytest.mark.parametrize("combined, delay", [(False, False), (True, False), (True, True)])
def test_every_microbatch_count_from_p_gives_valid_deadlock_free_plans(stages, virtual,
                                                                       combined, delay):
    layouts = stage_layouts(stages, virtual)
    for microbatches in range(stages, 2 * stages + 2):
        plans = pipeline_plans(layouts, microbatches, PlanForm(combined), delay)
        simulation = validate_pipeline(plans, layouts, microbatches, delay)
        assert not simulation.stuck
        for stage, plan in enumerate(plans):
            assert len(plan) == len(set(plan))
            steps = pipeline_steps(stage, stages, virtual, microbatches, combined)
            pairs = [s for s in steps if s.forward and s.backward]
            if combined:  # each pair of a combined step is independent
                assert all(s.forward[0] != s.backward[0] for s in pairs)


def test_steps_expanded_as_they_are_deadlock_in_an_interleaved_warmup():
    """Every stage ends its first forwards with a send: the ring of transfers waits on
    itself unless receives move up (order_transfers); the grid marks the stuck stages."""
    layouts = stage_layouts(2, 2)
    raw = [expand_steps(pipeline_steps(s, 2, 2, 2, False), layouts[s], False) for s in (0, 1)]
    simulation = simulate_pipeline(raw, layouts)
    assert set(simulation.stuck) == {0, 1}
    with pytest.raises(PipelineError) as info:
        validate_pipeline(raw, layouts, 2)
    text = str(info.value)
    assert text.startswith("pipeline deadlock at tick")
    assert "stage 0 sends act of mb 1 after L0 to stage 1, which runs F0.send.L1" in text
    assert sum(">> " in line for line in text.splitlines()) == 1  # one row, both stages


def test_cross_stage_check_rejects_transfers_in_mismatched_order():
    layouts = stage_layouts(2, 1)
    plans = pipeline_plans(layouts, 2, PLANS["sequential"])
    first = next(i for i, a in enumerate(plans[1]) if str(a) == "F0.recv.L1")
    second = next(i for i, a in enumerate(plans[1]) if str(a) == "F1.recv.L1")
    broken = list(plans[1])
    broken[first], broken[second] = broken[second], broken[first]
    with pytest.raises(PipelineError, match="stage 1"):
        validate_pipeline([plans[0], broken], layouts, 2)


def test_a_stage_plan_that_breaks_a_dependency_names_the_stage():
    layouts = stage_layouts(2, 1)
    plans = pipeline_plans(layouts, 2, PLANS["sequential"])
    with pytest.raises(PipelineError, match=r"^stage 0: invalid plan.*never runs"):
        validate_pipeline([plans[0][:-1], plans[1]], layouts, 2)


def test_golden_per_rank_grid():
    layouts = stage_layouts(2, 1, layer=DENSE)
    plans = pipeline_plans(layouts, 2, PLANS["sequential"])
    assert plan_to_string(plans[1]) == (
        "F0.recv.L1 F0.attn.L1 F0.mlp.L1 F0.loss B0.loss B0.mlp.L1 B0.attn.L1 F1.recv.L1 "
        "B0.recv.L1 F1.attn.L1 F1.mlp.L1 F1.loss B1.loss B1.mlp.L1 B1.attn.L1 B1.recv.L1")
    grid = format_pipeline(plans, layouts).splitlines()
    assert grid[0] == "   tick | stage 0      | stage 1"
    assert [line.rstrip() for line in grid[2:9]] == [
        "      0 | F0.embed     | .",
        "      1 | F0.attn.L0   | .",
        "      2 | F0.mlp.L0    | .",
        "      3 | [F0.send.L0] | [F0.recv.L1]",
        "      4 | F1.embed     | F0.attn.L1",
        "      5 | F1.attn.L0   | F0.mlp.L1",
        "      6 | F1.mlp.L0    | F0.loss"]
    assert [line.rstrip() for line in grid[12:14]] == [
        "     10 | [F1.send.L0] | [F1.recv.L1]",  # stage 1 took F1 before sending B0's grad
        "     11 | [B0.send.L0] | [B0.recv.L1]"]
    assert len(grid) == 2 + 22 and grid[-1] == "     21 | B1.embed     | ."


def test_stage_layout_reads_chunks_from_node_kinds_in_forward_order():
    nodes = ([(0, RECV_KIND)] + [(0, kind) for kind in MOE] + [(1, kind) for kind in DENSE]
             + [(1, SEND_KIND)] + [(4, RECV_KIND)] + [(4, kind) for kind in DENSE]
             + [(None, LOSS)])
    assert stage_layout(nodes) == [Chunk(0, (MOE, DENSE), RECV_KIND, SEND_KIND),
                                   Chunk(4, (DENSE,), RECV_KIND, LOSS)]
    assert stage_layout([(None, EMBED), (0, DENSE[0]), (0, DENSE[1]), (None, LOSS)]) == \
        [Chunk(0, (DENSE,))]


def test_pipeline_benchmark_runs_and_analytic_bubbles():
    """benchmarks/harness/bench_pipeline.py (run on GPUs by test_pipeline_gpu): its runs and the formula."""
    from benchmarks.harness import bench_pipeline as bench
    assert bench.analytic_bubble(2, 1, 4) == pytest.approx(1 / 5)
    assert bench.analytic_bubble(4, 2, 8) == pytest.approx(3 / 19)
    assert bench.analytic_bubble(1, 1, 8) == 0
    args = bench.parse_args(["--gpus", "2", "--microbatches", "4,8", "--virtual", "1,2", "--",
                             "--seed", "3"])
    runs = bench.scenarios(args)
    assert [r["name"] for r in runs][:2] == ["pp2_v1_m4_off", "pp2_v1_m4_ovl"]
    assert runs[-1]["name"] == "ep2_m8_ovl" and "--seed" in runs[-1]["flags"]
    assert "--num-virtual-stages-per-pipeline-rank" in runs[4]["flags"]
