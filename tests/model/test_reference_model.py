"""epoverlap's executor against an independently written float64 model (tests/reference_model.py).

The bitwise overlap tests compare node-cut execution with plain autograd through the SAME node
callables, so a mistake in the model math passes both sides. Here the reference shares no code
with the model: loss and every parameter's grad of the sequential plan and of the combined
1F1B (worker-thread comm lane, delayed wgrad) must match it, on one process (EP=1) and over two
gloo ranks (EP=2, reduced grads against the union of both ranks' microbatches); and small
mutations of the model math must be caught.

Tolerance (fp32 model vs fp64 reference): the fp32 unit roundoff is u = 6e-8. Every value here
passes through a few hundred roundings (3 layers; reductions of length <= 256), so the
textbook bound on a grad tensor's relative error is n * u ~ 1e-5; measured (Frobenius norm of
the difference over that of the reference, per parameter) it is <= 5e-7 for both configs, both
plans, EP=1 and EP=2, and <= 1e-7 for the loss. GRAD_RTOL = 2e-5 and LOSS_RTOL = 2e-6 leave
20-40x margin over what is measured; every mutation tested moves some grad by >= 7e-2 (3500x
the tolerance; the test demands 100x). A routing decision that fp32 rounding could flip would
break this reasoning, so every test asserts that the reference's smallest top-k (and group)
score gap is >= MIN_ROUTING_MARGIN = 1e-5 (fp32 logits of size < 1 are exact to ~1e-7;
measured gaps: 4e-5 sigmoid, 4e-4 softmax).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_helpers import run_ranks
from epoverlap.config import parse_config
from epoverlap.model.linear import expert_offsets, grouped_gemm
from epoverlap.model.moe import GroupedSwiGLUExperts
from epoverlap.schedule.executor import Executor, SerialLanes, ThreadLanes
from epoverlap.schedule.pipeline import build_plan
from gloo_workers import TINY, reduced_grads_for_reference
from reference_model import ReferenceHyper, reference_loss_and_grads
from test_model_cpu import MICROBATCHES, SMALL, build, data, grads_of

GRAD_RTOL = 2e-5
LOSS_RTOL = 2e-6
MIN_ROUTING_MARGIN = 1e-5

SOFTMAX = []  # test_model_cpu.SMALL: dense layer 0, shared expert, aux loss, z-loss, softmax
SIGMOID_BIAS_GROUPS = ["--num-experts", "8", "--moe-router-score-function", "sigmoid",
                       "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2",
                       "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor",
                       "2.5"]
PADDED_VOCAB = ["--make-vocab-size-divisible-by", "96"]  # 256 -> 288 rows, 32 of padding
QK_NORM = ["--qk-layernorm"]  # Qwen3's query/key norms (weights off 1: perturb_state)
CONFIGS = {"softmax": SOFTMAX, "sigmoid_bias_groups": SIGMOID_BIAS_GROUPS,
           "padded_vocab": PADDED_VOCAB, "qk_norm": QK_NORM}
RUNS = {"sequential": ("sequential", SerialLanes, False),
        "combined_1f1b_threads_delayed_wgrad": ("combined_1f1b", ThreadLanes, True)}


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Tiny tensors: a second OpenMP thread only spins (seconds of CPU on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def perturb_state(model, seed=7):
    """Norm weights off 1 and a non-zero expert bias, so neither is a no-op the test misses."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
        for router in model.routers():
            if router.expert_bias is not None:
                router.expert_bias.copy_(0.02 * torch.randn(router.expert_bias.shape,
                                                            generator=gen))


def model_state(model) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    biases = {n: b.detach().clone() for n, b in model.named_buffers()
              if n.endswith("router.expert_bias") and b is not None}
    return params, biases


def one_step(extra, run, mutate=None):
    """Loss per microbatch and grads of one step of `run` (a RUNS entry) on one process."""
    plan_name, lanes_cls, delay = run
    model, queue = build(extra, delay)
    perturb_state(model)
    if mutate is not None:
        mutate(model)
    lanes = lanes_cls()
    try:
        plan = build_plan(plan_name, model.layout(), MICROBATCHES, delay)
        losses = Executor(model.node_specs(), lanes, queue).run(plan, data(), 1 / MICROBATCHES)
    finally:
        lanes.close()
    return model, [float(loss) for loss in losses], grads_of(model)


def reference_for(extra, aux_counts="megatron"):
    model, _ = build(extra)
    perturb_state(model)
    params, biases = model_state(model)
    hyper = ReferenceHyper.from_run_config(parse_config(SMALL + list(extra)), aux_counts)
    result = reference_loss_and_grads(params, [data()], hyper, biases)
    assert result.routing_margin >= MIN_ROUTING_MARGIN, result.routing_margin
    return result


def relative_errors(got: dict, reference: dict) -> dict:
    """name -> ||got - ref|| / ||ref|| (Frobenius, float64)."""
    assert set(got) == set(reference), set(got) ^ set(reference)
    errors = {}
    for name, ref in reference.items():
        diff = (got[name].to(torch.float64) - ref).norm()
        errors[name] = float(diff / ref.norm().clamp(min=1e-30))
    return errors


def assert_matches(losses, grads, result):
    for got, ref in zip(losses, result.ce_losses, strict=True):
        assert abs(got - ref) <= LOSS_RTOL * abs(ref), (losses, result.ce_losses)
    assert all(ref.norm() > 0 for ref in result.grads.values())
    errors = relative_errors(grads, result.grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, (worst, errors[worst])


_REFERENCES: dict = {}


def cached_reference(config: str, aux_counts="megatron"):
    key = (config, aux_counts)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_for(CONFIGS[config], aux_counts)
    return _REFERENCES[key]


# ----------------------------------------------------------------------------- EP=1
@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_executor_matches_the_independent_reference(config, run):
    _, losses, grads = one_step(CONFIGS[config], RUNS[run])
    assert_matches(losses, grads, cached_reference(config))


# ----------------------------------------------------------------------------- mutations
def _negate_rotary_sin(model):
    for layer in model.transformer_layers():
        rotary = layer.attention.ops.rotary
        layer.attention.ops = dataclasses.replace(
            layer.attention.ops, rotary=lambda x, cos, sin, rotary=rotary: rotary(x, cos, -sin))


def _drop_aux_loss_microbatch_scale(model):
    for router in model.routers():
        router.aux_loss_scale = 1.0


def _probs_on_expert_input(monkeypatch):
    def forward(self, x_MH, probs_M, counts_L, counts_host):
        offsets_L = expert_offsets(counts_L)
        h_M2F = grouped_gemm(x_MH * probs_M[:, None], self.fc1, offsets_L, counts_host,
                             self.queue)
        return grouped_gemm(self.ops.swiglu(h_M2F), self.fc2, offsets_L, counts_host,
                            self.queue)
    monkeypatch.setattr(GroupedSwiGLUExperts, "forward", forward)


MUTATIONS = {
    "rotary_sign": (_negate_rotary_sin, None),
    "aux_loss_scale_not_divided_by_microbatches": (_drop_aux_loss_microbatch_scale, None),
    "routing_prob_on_expert_input": (None, _probs_on_expert_input),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_mutated_model_passes_the_bitwise_check_but_not_the_reference(mutation, monkeypatch):
    on_model, globally = MUTATIONS[mutation]
    if globally is not None:
        globally(monkeypatch)
    model, losses, grads = one_step(SOFTMAX, RUNS["sequential"], on_model)
    # the bitwise contract (test_model_cpu): node execution == plain autograd, same callables
    plain, _ = build(SOFTMAX)
    plain.load_state_dict(model.state_dict())
    if on_model is not None:
        on_model(plain)
    for mb in data():
        (plain(mb["tokens"], mb["labels"]) / MICROBATCHES).backward()
    assert all(torch.equal(grads[n], g) for n, g in grads_of(plain).items())
    # the independent reference sees the mutation
    errors = relative_errors(grads, cached_reference("softmax").grads)
    assert max(errors.values()) > 100 * GRAD_RTOL, max(errors.values())


# ----------------------------------------------------------------------------- Megatron
def test_aux_loss_counts_follow_megatron_not_the_routed_experts():
    """epoverlap's Switch aux loss counts tokens as Megatron-core does since 0.13 (MR !3279 "Fix
    MoE Aux loss"; 0.16.1 too: compute_routing_scores_for_aux_loss): a plain top-k of the aux
    scores, ignoring group-limited routing and the expert bias, not the ACTUAL routing. With
    either of those on and the aux loss > 0 the two countings give different router grads
    (here the gate grads by ~100%); without them both agree
    (tests/kernels/test_megatron_signatures.py checks the reference against megatron-core)."""
    routed = cached_reference("sigmoid_bias_groups", "routed")
    megatron = cached_reference("sigmoid_bias_groups", "megatron")
    _, losses, grads = one_step(SIGMOID_BIAS_GROUPS, RUNS["sequential"])
    assert max(relative_errors(grads, megatron.grads).values()) <= GRAD_RTOL
    errors = relative_errors(grads, routed.grads)
    assert max(errors.values()) > 100 * GRAD_RTOL, errors
    assert max(errors, key=errors.get).endswith("router.weight")


# ----------------------------------------------------------------------------- EP=2, gloo
EP2_ARGV = ["--num-layers", "3", "--moe-first-k-dense-replace", "1", "--seq-length", "16",
            "--num-microbatches", "2", "--moe-shared-expert-intermediate-size", "16",
            "--moe-z-loss-coeff", "0.001", "--overlap-moe-expert-parallel-comm",
            "--delay-wgrad-compute"]


def test_ep2_overlap_reduced_grads_match_the_reference_of_both_ranks():
    """Default tier (2 gloo ranks, ~15 s): the bitwise tests compare schedules with each other;
    this is the multi-rank check against an independent reference."""
    ranks = run_ranks(reduced_grads_for_reference, 2, 2, EP2_ARGV, timeout_s=180)
    experts = set(ranks[0]["expert_names"])
    params, grads = {}, {}
    for name in ranks[0]["params"]:
        if name in experts:  # rank r holds global experts r*L .. r*L + L - 1
            params[name] = torch.cat([r["params"][name] for r in ranks])
            grads[name] = torch.cat([r["grads"][name] for r in ranks])
        else:
            assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
            assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
            params[name], grads[name] = ranks[0]["params"][name], ranks[0]["grads"][name]
    hyper = ReferenceHyper.from_run_config(parse_config(TINY + EP2_ARGV))
    result = reference_loss_and_grads(params, [r["inputs"] for r in ranks], hyper)
    assert result.routing_margin >= MIN_ROUTING_MARGIN, result.routing_margin
    assert_matches([loss for r in ranks for loss in r["losses"]], grads, result)
