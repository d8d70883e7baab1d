"""Partial CUDA graphs, their plumbing checked on CPU (the capture itself is a GPU test).

`EmulatedGraphs` stands in for `torch.cuda.graph`: a captured graph is its capture body, and a
replay runs the body again. Everything else is the production path: the recording step, the
capture walk over the plan, the slot buffers shared by microbatches, the `_Replay` autograd
function inside a node, the weight-grad graph deferred to the plan's W action, the comm lane on
its own thread. A slot buffer overwritten while a microbatch still needs it changes the grads,
so bitwise equality with the eager run checks the liveness rules too.
"""

from __future__ import annotations

import pytest
import torch

from epoverlap.config import parse_config
from epoverlap.graphs import capture as capture_module
from epoverlap.graphs.capture import (GraphRunner, graphed_modules, graphed_ranges,
                                      microbatch_slots)
from epoverlap.model.nodes import Segment
from epoverlap.schedule.executor import Executor, SerialLanes, ThreadLanes
from epoverlap.schedule.pipeline import build_plan

from dist_helpers import one_process_model
from graph_emulation import EmulatedGraphs

MODEL = ["--num-layers", "3", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "16",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
         "--micro-batch-size", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff",
         "0.001", "--moe-shared-expert-intermediate-size", "16", "--moe-first-k-dense-replace",
         "1"]
MICROBATCHES = 4


def _data(seed):
    gen = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, 256, (2, 16), generator=gen),
             "labels": torch.randint(0, 256, (2, 16), generator=gen)}
            for _ in range(MICROBATCHES)]


def _build(delay):
    return one_process_model(parse_config(MODEL), "torch", torch.float32, "cpu", delay)


def _step(executor, plan, grads, model, seed):
    grads.zero()
    for router in model.routers():
        router.reset_step_stats()
    losses = executor.run(plan, _data(seed), 1 / MICROBATCHES)
    return torch.stack(losses), grads.dense_flat.clone(), grads.expert_flat.clone()


def _run(plan_name, lanes_cls, delay, modules, slots=None):
    """(eager result, graphed result) of the same step on two identical models."""
    results = []
    for graphed in (False, True):
        model, queue, grads = _build(delay)
        plan = build_plan(plan_name, model.layout(), MICROBATCHES, delay)
        lanes = lanes_cls()
        runner = None
        if graphed:
            runner = GraphRunner(model.node_specs(), graphed_modules(modules),
                                 device=torch.device("cpu"), queue=queue,
                                 backend_factory=EmulatedGraphs, check_inputs=True)
        kwargs = {"run_factory": runner} if runner else {}
        executor = Executor(model.node_specs(), lanes, queue, **kwargs)
        try:
            if runner is not None:
                runner.recording = True
                _step(executor, plan, grads, model, seed=1)
                runner.recording = False
                if slots is not None:  # a deliberately wrong slot assignment
                    original = capture_module.microbatch_slots
                    capture_module.microbatch_slots = lambda plan: slots
                    try:
                        runner.capture(plan)
                    finally:
                        capture_module.microbatch_slots = original
                else:
                    runner.capture(plan)
                assert runner.graph_count() > 0
            results.append(_step(executor, plan, grads, model, seed=2))
        finally:
            lanes.close()
            if runner is not None:
                runner.release()
    return results


def _assert_bitwise(eager, graphed):
    for a, b, what in zip(eager, graphed, ("losses", "dense grads", "expert grads")):
        assert torch.equal(a, b), what


ALL = ("attn", "moe_router", "moe_preprocess")


@pytest.mark.parametrize("plan_name, lanes_cls, delay, modules", [
    ("sequential", SerialLanes, False, ALL),
    ("combined_1f1b", ThreadLanes, False, ALL),
    ("combined_1f1b", ThreadLanes, True, ALL),
    ("combined_1f1b", ThreadLanes, True, ("attn",)),
    ("combined_1f1b", ThreadLanes, True, ("moe_router",)),
    ("combined_1f1b", SerialLanes, False, ("attn", "moe_router")),
    ("sequential", SerialLanes, True, ("moe_router", "moe_preprocess")),
])
def test_graphed_ranges_replay_bitwise_like_eager(plan_name, lanes_cls, delay, modules):
    eager, graphed = _run(plan_name, lanes_cls, delay, modules)
    _assert_bitwise(eager, graphed)


def test_whole_dense_layers_and_moe_pre_dispatch_segments_graphed_together():
    eager, graphed = _run("sequential", SerialLanes, False, ())
    _assert_bitwise(eager, graphed)


def test_one_slot_shared_by_live_microbatches_corrupts_the_grads():
    """The check above can fail: with every microbatch in slot 0, the combined 1F1B overwrites
    the buffers of a microbatch whose backward has not run yet (here autograd's version check
    sees it; on a GPU the replay would read the wrong microbatch's values silently)."""
    try:
        eager, graphed = _run("combined_1f1b", SerialLanes, False, ALL,
                              slots={mb: 0 for mb in range(MICROBATCHES)})
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
        return
    assert not all(torch.equal(a, b) for a, b in zip(eager, graphed))


def test_microbatch_slots_follow_liveness():
    layout = _build(False)[0].layout()
    assert set(microbatch_slots(build_plan("sequential", layout, 4)).values()) == {0}
    slots = microbatch_slots(build_plan("combined_1f1b", layout, 4, True))
    assert slots == {0: 0, 1: 1, 2: 0, 3: 1}


def test_graphed_ranges_are_maximal_runs_of_listed_segments():
    segments = [Segment(n, None, (), ()) for n in ("attn", "moe_router", "moe_preprocess")]
    assert graphed_ranges(segments, {"attn", "moe_router"}) == [(0, 2)]
    assert graphed_ranges(segments, {"moe_router", "moe_preprocess"}) == [(1, 3)]
    assert graphed_ranges(segments, {"attn", "moe_preprocess"}) == [(0, 1), (2, 3)]
    assert graphed_ranges(segments, set()) == []


def test_recorded_signature_keeps_range_internal_values_inside():
    model, queue, grads = _build(False)
    runner = GraphRunner(model.node_specs(), {"attn", "moe_router"}, device=torch.device("cpu"),
                         queue=queue, backend_factory=EmulatedGraphs)
    runner.recording = True
    plan = build_plan("sequential", model.layout(), MICROBATCHES)
    _step(Executor(model.node_specs(), SerialLanes(), queue, run_factory=runner), plan, grads,
          model, seed=1)
    moe_layer = runner.signatures[(1, "attn", 0)]
    assert list(moe_layer.inputs) == ["hidden"]
    # the permute's copy of the normed tokens, probs and routing_map feed the eager
    # preprocess; the router's and shared expert's copies stay inside; the rest are outputs
    assert set(moe_layer.outputs) == {"residual", "normed_permute", "probs", "routing_map",
                                      "expert_counts", "shared_out"}
    assert not moe_layer.outputs["expert_counts"].requires_grad
    assert set(runner.signatures[(0, "attn", 0)].outputs) == {"residual", "normed"}


def test_check_inputs_names_the_node_microbatch_and_input():
    model, queue, grads = _build(False)
    runner = GraphRunner(model.node_specs(), {"attn"}, device=torch.device("cpu"), queue=queue,
                         backend_factory=EmulatedGraphs, check_inputs=True)
    plan = build_plan("sequential", model.layout(), MICROBATCHES)
    executor = Executor(model.node_specs(), SerialLanes(), queue, run_factory=runner)
    runner.recording = True
    _step(executor, plan, grads, model, seed=1)
    runner.recording = False
    runner.capture(plan)
    spec = next(s for s in model.node_specs() if s.key == (1, "attn"))
    with pytest.raises(RuntimeError, match=r"attn.L1 attn microbatch 2 forward.*'hidden'"):
        runner(spec, 2)(hidden=torch.zeros(3, 32, requires_grad=True))


class _StubRunner:
    """A runner that records which microbatches it served and captures when recorded."""

    def __init__(self, size):
        self.size, self.served = size, []
        self.recording, self.captured, self.recorded = False, False, False

    def __call__(self, spec, microbatch):
        self.served.append(microbatch)
        return spec

    def capture(self, plan):
        self.captured = True


def test_size_banks_route_each_microbatch_to_its_sizes_runner_and_capture_each_size():
    """Dynamic CP's bank (`SizeBanks`): a microbatch's nodes go to the runner of the size its
    tokens' length gives (S / CP = 8 here: 8 tokens size 1, 16 size 2), never another's; a
    runner is captured once a step recorded it, the others wait."""
    from epoverlap.graphs.banks import SizeBanks
    bank = SizeBanks(_StubRunner, (1, 2), local_tokens=8)
    lengths = [8, 16, 16, 8]
    bank.route([{"tokens": torch.zeros(2, n, dtype=torch.long)} for n in lengths])
    for microbatch in range(len(lengths)):
        bank("spec", microbatch)
    assert bank.runners[1].served == [0, 3] and bank.runners[2].served == [1, 2]
    bank.recording = True
    assert bank.runners[1].recording and bank.runners[2].recording
    bank.runners[2].recorded = True
    bank.capture(plan=[])
    assert bank.captured_now == (2,) and not bank.captured
    bank.runners[1].recorded = True
    bank.capture(plan=[])
    assert bank.captured_now == (1,) and bank.captured
    bank.recording = True
    assert not bank.recording  # captured runners record no more
