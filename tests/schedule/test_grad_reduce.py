"""When the gradient buckets' reduces are issued (--overlap-grad-reduce): plan data, and a
failed reduce on the CPU comm thread surfacing (pure CPU)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from epoverlap.model.nodes import COMM, COMPUTE, NodeKind, SEND
from epoverlap.schedule.executor import ThreadLanes
from epoverlap.schedule.grad_reduce import ReduceBucket, reduce_points
from epoverlap.schedule.pipeline import build_plan, pipeline_plans
from epoverlap.schedule.plan import PLANS, Chunk, action_lane, node_kinds, sequential_plan
from epoverlap.training.optimizer.grads import bucket_layout

MOE = (NodeKind("attn", COMPUTE, True), NodeKind("dispatch", COMM),
       NodeKind("mlp", COMPUTE, True), NodeKind("combine", COMM))
LAYERS = 3
BUCKETS = ([ReduceBucket("loss", None, "loss")]
           + [ReduceBucket(f"L{layer}{part}", layer) for layer in reversed(range(LAYERS))
              for part in (".expert", "")]
           + [ReduceBucket("embed", None, "embed")])


def _issued(plan, kinds, buckets=BUCKETS) -> list[tuple[int, str]]:
    """(plan index after which, bucket name) of every reduce, in issue order."""
    points = reduce_points(plan, kinds, buckets)
    return [(index, buckets[b].name) for index in sorted(points) for b in points[index]]


def _last_writer(plan, bucket: ReduceBucket) -> int:
    return max(i for i, a in enumerate(plan) if a.kind != "F"
               and ((a.layer, None) if a.layer is not None else (None, a.node)) == bucket.owner)


@pytest.mark.parametrize("name, delay_wgrad", [  # delayed weight grads need the overlap
    ("sequential", False), ("combined_1f1b", False), ("combined_1f1b", True),
    ("combined_1f1b_paired_ends", False), ("combined_1f1b_paired_ends", True)])
def test_each_bucket_goes_after_its_last_writer_in_bucket_order(name, delay_wgrad):
    layout = [MOE] * LAYERS
    plan = build_plan(name, layout, 4, delay_wgrad)
    kinds = node_kinds(layout)
    issued = _issued(plan, kinds)
    assert [bucket for _, bucket in issued] == [b.name for b in BUCKETS]  # every one, in order
    by_name = {b.name: b for b in BUCKETS}
    for index, bucket in issued:
        last = _last_writer(plan, by_name[bucket])
        assert index >= last
        # only comm actions between the last writer and the reduce (module docstring), unless
        # it waits for the bucket before it
        between = plan[last + 1:index + 1]
        assert all(action_lane(a, kinds) == COMM for a in between) or \
            issued[[b for _, b in issued].index(bucket) - 1][0] == index
    # the overlap: every layer's buckets before the step's last backward action
    last_backward = max(i for i, a in enumerate(plan) if a.kind != "F")
    assert all(index < last_backward for index, bucket in issued if bucket != "embed")


def test_a_reduce_waits_for_the_delayed_weight_grads_of_its_layer():
    layout = [MOE] * LAYERS
    plan = build_plan("combined_1f1b", layout, 2, True)
    issued = {bucket: index for index, bucket in _issued(plan, node_kinds(layout))}
    last_wgrad = max(i for i, a in enumerate(plan) if a.kind == "W" and a.layer == 1)
    assert issued["L1"] >= last_wgrad and issued["L1.expert"] >= last_wgrad


def test_reduces_skip_past_the_comm_actions_right_after_the_last_writer():
    """A reduce is not put in front of the chain's next all-to-all (the comm lane is a FIFO)."""
    layout = [MOE] * LAYERS
    plan = sequential_plan(layout, 2)
    issued = {bucket: index for index, bucket in _issued(plan, node_kinds(layout))}
    assert str(plan[issued["loss"]]) == "B1.combine.L2"  # after B1.loss, behind the combine
    assert str(plan[issued["L2"]]) == "B1.combine.L1"


def test_pipeline_stages_reduce_their_own_layers_and_send_the_grad_back_first():
    stages = [[Chunk(0, (MOE,), tail=NodeKind("send", COMM, p2p=SEND))],
              [Chunk(1, (MOE,), head=NodeKind("recv", COMM, p2p="recv"))]]
    plans = pipeline_plans(stages, 4, PLANS["combined_1f1b"], delay_wgrad=True)
    last_stage = [ReduceBucket("loss", None, "loss"), ReduceBucket("L1", 1)]
    kinds = node_kinds(stages[1])
    issued = _issued(plans[1], kinds, last_stage)
    assert [b for _, b in issued] == ["loss", "L1"]
    index = {b: i for i, b in issued}["L1"]
    assert str(plans[1][index]) == "B3.recv.L1"  # the grad goes back before the reduce
    assert index == len(plans[1]) - 1


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Parameter(torch.zeros(5, 2))
        self.layers = nn.ModuleDict({str(i): nn.Linear(2, 2, bias=False) for i in range(2)})
        self.layers["1"].experts = nn.Parameter(torch.zeros(3, 2))
        self.layers["1"].experts.is_expert = True
        self.head = nn.Parameter(torch.zeros(5, 2))


def test_buckets_are_the_owners_slices_of_the_flat_buffers_in_backward_order():
    named = list(_Tiny().named_parameters())
    layout = bucket_layout(named)
    assert [(b.name, expert, span) for b, expert, span in layout] == [
        ("head", False, (10, 20)), ("L1.expert", True, (0, 6)), ("L1", False, (24, 28)),
        ("L0", False, (20, 24)), ("embedding", False, (0, 10))]
    assert [b.owner for b, _, _ in layout] == [(None, "loss"), (1, None), (1, None), (0, None),
                                               (None, "embed")]
    dense = sum(end - start for _, expert, (start, end) in layout if not expert)
    assert dense == sum(p.numel() for n, p in named if not getattr(p, "is_expert", False))


def test_a_failed_reduce_on_the_comm_thread_is_raised_by_drain_after_later_comm_tasks():
    lanes = ThreadLanes()
    try:
        lanes.begin()

        def fails(wait):
            raise RuntimeError("reduce failed")
        lanes.submit_after_compute(fails)
        time.sleep(0.05)  # it has failed before the next comm task is submitted
        lanes.submit(COMM, 0, lambda wait: None, chain=True)
        with pytest.raises(RuntimeError, match="reduce failed"):
            lanes.drain()
    finally:
        lanes.close()
