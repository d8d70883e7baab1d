"""Graphs over a sync-free dispatch, their plumbing checked on CPU with the emulated backend of
`test_graphs_cpu` (a replay re-runs the capture body): the whole MoE layer as one graphed node
(`moe`, `attn moe`, the whole layer) and one graph over the whole iteration, each bitwise equal
to the eager run; the one-node layer itself equal to the four-node one."""

from __future__ import annotations

import contextlib

import pytest
import torch

from epoverlap.config import parse_config
from epoverlap.graphs.banks import GraphBanks
from epoverlap.graphs.capture import GraphRunner, graphed_modules, graphs_span_moe_layer
from epoverlap.graphs.full_iteration import FullIterationGraph
from epoverlap.schedule.executor import Executor, SerialLanes, ThreadLanes
from epoverlap.schedule.pipeline import build_plan

from dist_helpers import one_process_model
from graph_emulation import EmulatedGraphs
from test_graphs_cpu import MICROBATCHES, MODEL, _assert_bitwise, _data

@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """These models are tiny: a second OpenMP thread buys nothing and, on a loaded 2-core
    machine, its spin-waits make the module ~30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


BUDGET = ["--moe-dispatch-budget", "1.0"]
PADDED = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]


def _build(flags, one_node=False, delay=False):
    return one_process_model(parse_config(MODEL + flags), "torch", torch.float32, "cpu", delay,
                             one_node)


def _step(run, grads, model, seed):
    grads.zero()
    for router in model.routers():
        router.reset_step_stats()
    losses = run(_data(seed))
    return torch.stack(losses), grads.dense_flat.clone(), grads.expert_flat.clone()


def _eager(flags, one_node, plan_name="sequential", lanes_cls=SerialLanes, delay=False):
    model, queue, grads = _build(flags, one_node, delay)
    plan = build_plan(plan_name, model.layout(), MICROBATCHES, delay)
    lanes = lanes_cls()
    try:
        executor = Executor(model.node_specs(), lanes, queue)
        return _step(lambda data: executor.run(plan, data, 1 / MICROBATCHES), grads, model, 2)
    finally:
        lanes.close()


class CountingWatch:
    """A `replay_watch`: counts the replays made inside it."""

    def __init__(self):
        self.replays = 0

    @contextlib.contextmanager
    def __call__(self):
        self.replays += 1
        yield


def _graphed_layers(flags, modules, watch=contextlib.nullcontext):
    """Per-layer graphs of `modules` over one-node MoE layers: record, capture, replay."""
    model, queue, grads = _build(flags, one_node=graphs_span_moe_layer("local", modules))
    plan = build_plan("sequential", model.layout(), MICROBATCHES)
    runner = GraphRunner(model.node_specs(), graphed_modules(modules),
                         device=torch.device("cpu"), queue=queue,
                         backend_factory=EmulatedGraphs, check_inputs=True, replay_watch=watch)
    executor = Executor(model.node_specs(), SerialLanes(), queue, run_factory=runner)

    def run(data):
        return executor.run(plan, data, 1 / MICROBATCHES)
    try:
        runner.recording = True
        _step(run, grads, model, 1)
        runner.recording = False
        runner.capture(plan)
        return runner, _step(run, grads, model, 2)
    finally:
        runner.release()


@pytest.mark.parametrize("flags", [BUDGET, PADDED], ids=["budget", "padded"])
def test_one_node_moe_layer_equals_the_four_node_layer(flags):
    _assert_bitwise(_eager(flags, one_node=False), _eager(flags, one_node=True))


@pytest.mark.parametrize("flags", [BUDGET, PADDED], ids=["budget", "padded"])
@pytest.mark.parametrize("modules", [(), ("moe",), ("attn", "moe")],
                         ids=["whole-layer", "moe", "attn-moe"])
def test_graphs_over_the_whole_moe_layer_replay_bitwise_like_eager(flags, modules):
    runner, graphed = _graphed_layers(flags, modules)
    _assert_bitwise(_eager(flags, one_node=False), graphed)
    moe_ranges = {key: ranges for key, ranges in runner.ranges.items() if key[1] == "moe_layer"}
    assert moe_ranges, "the MoE layers are one node"
    first = 0 if "attn" in modules or not modules else 1  # `moe` alone leaves attn eager
    assert all(ranges == [(first, 6)] for ranges in moe_ranges.values())


@pytest.mark.parametrize("plan_name, lanes_cls, delay", [
    ("sequential", SerialLanes, False),
    ("combined_1f1b", ThreadLanes, False),
    ("combined_1f1b", ThreadLanes, True),
], ids=["sequential", "overlap", "overlap-wgrad"])
@pytest.mark.parametrize("flags", [BUDGET, PADDED], ids=["budget", "padded"])
def test_full_iteration_graph_replays_bitwise_like_eager(flags, plan_name, lanes_cls, delay):
    model, queue, grads = _build(flags, delay=delay)
    plan = build_plan(plan_name, model.layout(), MICROBATCHES, delay)
    lanes = lanes_cls()
    try:
        executor = Executor(model.node_specs(), lanes, queue)
        graph = FullIterationGraph(executor, plan, 1 / MICROBATCHES,
                                   device=torch.device("cpu"), backend_factory=EmulatedGraphs)
        graph.recording = True
        _step(graph.run, grads, model, 1)
        graph.recording = False
        graph.capture(plan)
        assert graph.captured and graph.graph_count() == 1
        graphed = _step(graph.run, grads, model, 2)
        graph.release()
    finally:
        lanes.close()
    _assert_bitwise(_eager(flags, False, plan_name, lanes_cls, delay), graphed)


def test_every_replay_runs_inside_the_replay_watch():
    """The trainer passes the EP group's `Group.watched` as `replay_watch` when graphs hold the
    dispatch: the liveness watch tracks what a replay issues (captured calls are not tracked)."""
    layers = CountingWatch()
    runner, _ = _graphed_layers(BUDGET, (), layers)
    ranges = sum(len(r) for r in runner.ranges.values())  # 2 one-node MoE layers, attn + mlp
    assert ranges == 4 and layers.replays == 2 * ranges * MICROBATCHES  # forward, backward
    model, queue, grads = _build(BUDGET)
    plan = build_plan("sequential", model.layout(), MICROBATCHES)
    full = CountingWatch()
    graph = FullIterationGraph(Executor(model.node_specs(), SerialLanes(), queue), plan,
                               1 / MICROBATCHES, device=torch.device("cpu"),
                               backend_factory=EmulatedGraphs, replay_watch=full)
    graph.recording = True
    _step(graph.run, grads, model, 1)
    graph.recording = False
    graph.capture()
    assert full.replays == 0
    _step(graph.run, grads, model, 2)
    assert full.replays == 1


def test_full_iteration_graph_refuses_inputs_of_another_shape():
    model, queue, grads = _build(BUDGET)
    plan = build_plan("sequential", model.layout(), MICROBATCHES)
    graph = FullIterationGraph(Executor(model.node_specs(), SerialLanes(), queue), plan,
                               1 / MICROBATCHES, device=torch.device("cpu"),
                               backend_factory=EmulatedGraphs)
    graph.recording = True
    _step(graph.run, grads, model, 1)
    graph.recording = False
    graph.capture()
    short = [{k: v[:, :8] for k, v in mb.items()} for mb in _data(3)]
    with pytest.raises(RuntimeError, match="captured for"):
        graph.run(short)


def test_graph_banks_are_bounded_and_select_by_key():
    made = []
    banks = GraphBanks(lambda: made.append(object()) or made[-1], max_banks=2)
    first = banks.select(0)
    assert banks.select(1) is not first and banks.select(0) is first and banks.active is first
    with pytest.raises(RuntimeError, match="the bound is 2"):
        banks.select(2)
    assert len(made) == 2
