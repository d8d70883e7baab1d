"""The model and its nodes on one CPU process (EP=1): node-cut execution under every plan and
lane backend equals plain autograd bit for bit; deferred weight grads equal inline ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epoverlap.parallel.comm import ExpertComm
from epoverlap.config import parse_config
from epoverlap.model.dispatch import make_dispatcher
from epoverlap.model.linear import grouped_gemm, linear
from epoverlap.model.flops import training_flops_per_token
from epoverlap.model.transformer import MoEModel
from epoverlap.schedule.executor import Executor, SerialLanes, ThreadLanes
from epoverlap.schedule.pipeline import build_plan
from epoverlap.schedule.wgrad import WeightGradQueue
from epoverlap.kernels import make_moe_ops

SMALL = ["--num-layers", "3", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "16",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
         "--micro-batch-size", "2", "--num-microbatches", "3", "--moe-aux-loss-coeff", "0.01",
         "--moe-z-loss-coeff", "0.001", "--moe-shared-expert-intermediate-size", "16",
         "--moe-first-k-dense-replace", "1"]
MICROBATCHES = 3


def build(extra=(), delay=False):
    cfg = parse_config(SMALL + list(extra))
    queue = WeightGradQueue(enabled=delay)
    model = MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                     ExpertComm(None, 1), 0, make_moe_ops("torch"), dtype=torch.float32,
                     device=torch.device("cpu"), wgrad_queue=queue)
    return model, queue


def data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, 256, (2, 16), generator=gen),
             "labels": torch.randint(0, 256, (2, 16), generator=gen)}
            for _ in range(MICROBATCHES)]


def grads_of(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def plain_autograd_grads(extra=()):
    model, _ = build(extra)
    for mb in data():
        (model(mb["tokens"], mb["labels"]) / MICROBATCHES).backward()
    return grads_of(model)


def executor_grads(plan_name, lanes, delay, extra=()):
    model, queue = build(extra, delay)
    plan = build_plan(plan_name, model.layout(), MICROBATCHES, delay)
    losses = Executor(model.node_specs(), lanes, queue).run(plan, data(), 1 / MICROBATCHES)
    assert queue.pending_keys() == []
    return grads_of(model), losses


@pytest.mark.parametrize("plan_name, lanes, delay", [
    ("sequential", SerialLanes, False),
    ("sequential", SerialLanes, True),
    ("combined_1f1b", SerialLanes, False),
    ("combined_1f1b", ThreadLanes, False),
    ("combined_1f1b", ThreadLanes, True),
    ("combined_1f1b_early_release", ThreadLanes, True),
    ("combined_1f1b_paired_ends", ThreadLanes, False),
    ("combined_1f1b_paired_ends", ThreadLanes, True),
])
def test_node_execution_matches_plain_autograd_bitwise(plan_name, lanes, delay):
    reference = plain_autograd_grads()
    lane_backend = lanes()
    try:
        got, losses = executor_grads(plan_name, lane_backend, delay)
    finally:
        lane_backend.close()
    assert set(got) == set(reference)
    for name in reference:
        assert torch.equal(got[name], reference[name]), name
    assert all(torch.isfinite(loss) for loss in losses)


def _bound_dispatchers(specs) -> set:
    """The dispatchers the MoE nodes among `specs` are bound to."""
    return {spec.fn.keywords["dispatcher"] for spec in specs
            if "dispatcher" in getattr(spec.fn, "keywords", {})}


def test_nodes_by_another_dispatcher_bind_it_switch_nothing_and_keep_the_bits():
    """`node_specs(dispatch=...)` (the nodes of a tuner's path) binds every MoE node to the
    dispatcher it is given and changes nothing in the model: the nodes built next are the
    model's own. At EP 1 the once-per-rank dispatcher is the plain one: the same bits."""
    reference = plain_autograd_grads()
    model, queue = build()
    own = model.dispatcher
    other = make_dispatcher(ExpertComm(None, 1), 4, 2, model.ops, torch.device("cpu"),
                            dataclasses.replace(model.dispatch_mode, once_per_rank=True))
    specs = model.node_specs(dispatch=other)
    assert _bound_dispatchers(specs) == {other}
    assert _bound_dispatchers(model.node_specs()) == {own}
    assert all(layer.dispatcher is own for layer in model.transformer_layers() if layer.is_moe)
    plan = build_plan("combined_1f1b", model.layout(), MICROBATCHES)
    lanes = ThreadLanes()
    try:
        Executor(specs, lanes, queue).run(plan, data(), 1 / MICROBATCHES)
    finally:
        lanes.close()
    got = grads_of(model)
    assert all(torch.equal(got[name], reference[name]) for name in reference)


def test_every_parameter_gets_a_gradient():
    grads = plain_autograd_grads()
    model, _ = build()
    missing = [n for n, _ in model.named_parameters() if n not in grads]
    assert missing == []
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "router" not in n)


@pytest.mark.parametrize("extra", [
    ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
     "--moe-router-topk-scaling-factor", "2.5"],
    ["--moe-router-pre-softmax", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
    ["--moe-router-dtype", "fp32", "--moe-layer-freq", "1"],
])
def test_router_variants_run_and_stay_bitwise(extra):
    reference = plain_autograd_grads(extra)
    got, _ = executor_grads("combined_1f1b", SerialLanes(), True, extra)
    assert all(torch.equal(got[n], reference[n]) for n in reference)


def test_expert_bias_update_moves_toward_balance():
    model, _ = build(["--moe-router-score-function", "sigmoid",
                      "--moe-router-enable-expert-bias"])
    router = model.routers()[0]
    router.update_expert_bias(torch.tensor([10, 0, 5, 5]))
    rate = router.moe.moe_router_bias_update_rate
    assert torch.allclose(router.expert_bias, torch.tensor([-rate, rate, 0.0, 0.0]))


@pytest.mark.parametrize("extra", [[], ["--moe-router-score-function", "sigmoid"],
                                   ["--moe-router-pre-softmax"]])
def test_router_op_aux_loss_equals_the_separate_ops(extra):
    """The router's aux loss computed inside the router op (`SwitchAuxLoss`) and by the
    separate autograd ops (`aux_loss_in_op` False): the same logged loss and grads; and with
    the aux loss off, different grads (the loss's grad really reaches the gate)."""
    results = []
    for in_op, coeff in ((True, "0.01"), (False, "0.01"), (True, "0")):
        model, _ = build(extra + ["--moe-aux-loss-coeff", coeff])
        for router in model.routers():
            router.aux_loss_in_op = in_op
        for mb in data():
            (model(mb["tokens"], mb["labels"]) / MICROBATCHES).backward()
        results.append(([float(r.step_aux_loss) for r in model.routers()], grads_of(model)))
    (fused_aux, fused), (separate_aux, separate), (_, no_aux) = results
    assert fused_aux == pytest.approx(separate_aux, rel=1e-6) and min(fused_aux) > 0
    for name in fused:
        torch.testing.assert_close(fused[name], separate[name], rtol=1e-5, atol=1e-7)
    gate = next(name for name in fused if "router" in name)
    assert not torch.allclose(fused[gate], no_aux[gate])


def test_wgrad_queue_defers_and_reports_leftovers():
    queue = WeightGradQueue(enabled=True)
    weight = torch.nn.Parameter(torch.randn(3, 4))
    x = torch.randn(5, 4, requires_grad=True)
    with queue.collecting("k"):
        linear(x, weight, queue).sum().backward()
    assert weight.grad is None and queue.pending_keys() == ["k"]
    with pytest.raises(RuntimeError, match="left in the queue"):
        queue.check_empty()
    assert queue.run("k") == 1
    assert torch.allclose(weight.grad, torch.ones(5, 3).t() @ x.detach())
    queue.check_empty()


def test_wgrad_queue_nests_collection_and_rejects_the_same_key_twice():
    queue = WeightGradQueue(enabled=True)
    with queue.collecting("a"):
        assert queue.defer(lambda: None)
        with queue.collecting("b"):
            assert queue.defer(lambda: None) and queue.defer(lambda: None)
        assert queue.defer(lambda: None)  # back to "a"
        with pytest.raises(RuntimeError, match="already collecting"):
            with queue.collecting("a"):
                pass
    assert not queue.defer(lambda: None)
    assert queue.run("b") == 2 and queue.run("a") == 2


@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 8], [8, 0, 0], [2, 3, 3]])
def test_grouped_gemm_matches_a_loop_including_empty_experts(counts):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(3, 16, 8))
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    out = grouped_gemm(x, weight, offsets, counts)
    ref = torch.cat([p @ weight[e] for e, p in enumerate(torch.split(x, counts))])
    assert torch.allclose(out, ref, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = weight.detach().clone().requires_grad_()
    torch.cat([p @ w_ref[e] for e, p in enumerate(torch.split(x_ref, counts))]).backward(grad)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)
    assert torch.allclose(weight.grad, w_ref.grad, atol=1e-5)


@pytest.mark.parametrize("width_in, width_out", [(16, 1), (1, 16), (3, 8), (16, 8)])
def test_grouped_gemm_runs_any_expert_width_forward_and_backward(width_in, width_out):
    """torch's CPU `_grouped_mm` refuses a leading dimension that is not a multiple of 16 bytes
    (a width-1 operand has two unit strides: --moe-ffn-hidden-size 1, found by the fuzz); the
    loop runs there instead, forward and both grads."""
    counts = [3, 0, 5]
    x = torch.randn(sum(counts), width_in, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(3, width_in, width_out))
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    out = grouped_gemm(x, weight, offsets, counts)
    ref = torch.cat([p @ weight[e] for e, p in enumerate(torch.split(x, counts))])
    assert torch.allclose(out, ref, atol=1e-5)
    out.backward(torch.ones_like(out))
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


def test_flops_formula_counts_active_experts_only():
    cfg = parse_config(SMALL)
    more_experts = parse_config(SMALL + ["--num-experts", "8"])
    delta = (training_flops_per_token(more_experts.model, more_experts.moe)
             - training_flops_per_token(cfg.model, cfg.moe))
    assert delta == 3 * 2 * 32 * 4 * 2  # only the router grows: 4 more experts, 2 MoE layers
