"""--attention-dropout and --hidden-dropout on one CPU process (issue 47): the masks come from
each microbatch's seed, so node execution under every plan and lane backend equals plain
autograd bit for bit with dropout on; dropout drops (the loss moves, a mask keeps about 1 - p,
kept values are scaled by 1 / (1 - p)), repeats under the same seed, leaves torch's global RNG
as it found it, and is off in eval mode and at p = 0 (no seed input, no draw)."""

from __future__ import annotations

import pytest
import torch

from epoverlap.config import parse_config, validate_config
from epoverlap.errors import ConfigError
from epoverlap.model.dropout import (DROPOUT_SEED, MLP_OUT, dropout_inputs, hidden_dropout,
                                     microbatch_seed)
from epoverlap.model.transformer import MoEModel
from epoverlap.parallel.comm import ExpertComm
from epoverlap.schedule.executor import Executor, SerialLanes, ThreadLanes
from epoverlap.schedule.pipeline import build_plan
from epoverlap.schedule.wgrad import WeightGradQueue
from epoverlap.kernels import make_moe_ops

from test_model_cpu import MICROBATCHES, SMALL, grads_of  # this folder is on the path

DROPOUT = ["--attention-dropout", "0.2", "--hidden-dropout", "0.3"]


def build(extra=DROPOUT, delay=False, one_node=False):
    cfg = parse_config(SMALL + list(extra))
    queue = WeightGradQueue(enabled=delay)
    model = MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                     ExpertComm(None, 1), 0, make_moe_ops("torch"), dtype=torch.float32,
                     device=torch.device("cpu"), wgrad_queue=queue,
                     one_node_moe_layers=one_node)
    return cfg, model, queue


def data(cfg, step=1, seed=0):
    """Microbatches as StepRunner.microbatches makes them: tokens, labels, dropout seed."""
    gen = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, 256, (2, 16), generator=gen),
             "labels": torch.randint(0, 256, (2, 16), generator=gen),
             **dropout_inputs(cfg.model, cfg.train.seed, step, 0, mb)}
            for mb in range(MICROBATCHES)]


def plain_autograd(extra=DROPOUT, one_node=False):
    """Grads and losses of the model's plain forward, microbatch after microbatch."""
    cfg, model, _ = build(extra, one_node=one_node)
    losses = []
    for mb in data(cfg):
        loss = model(mb["tokens"], mb["labels"], mb.get(DROPOUT_SEED))
        (loss / MICROBATCHES).backward()
        losses.append(loss.detach())
    return grads_of(model), losses


def assert_same_bits(got: dict, reference: dict) -> None:
    assert set(got) == set(reference)
    for name in reference:
        assert torch.equal(got[name], reference[name]), name


@pytest.mark.parametrize("plan_name, lanes, delay", [
    ("sequential", SerialLanes, False),
    ("combined_1f1b", ThreadLanes, False),
    ("combined_1f1b", ThreadLanes, True),
    ("combined_1f1b_early_release", ThreadLanes, True),
    ("combined_1f1b_paired_ends", ThreadLanes, True),
])
def test_node_execution_with_dropout_matches_plain_autograd_bitwise(plan_name, lanes, delay):
    """Dense and MoE layers, a shared expert: attention, attention-output and MLP / combine
    dropout (the combine's on the comm thread) all draw the plain forward's masks."""
    reference, reference_losses = plain_autograd()
    cfg, model, queue = build(delay=delay)
    plan = build_plan(plan_name, model.layout(), MICROBATCHES, delay)
    lane_backend = lanes()
    try:
        losses = Executor(model.node_specs(), lane_backend, queue).run(plan, data(cfg),
                                                                        1 / MICROBATCHES)
    finally:
        lane_backend.close()
    assert_same_bits(grads_of(model), reference)
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses))


def test_one_node_moe_layer_draws_the_split_layers_masks():
    assert_same_bits(plain_autograd(one_node=True)[0], plain_autograd()[0])


def first_loss(extra=DROPOUT, step=1, train=True) -> torch.Tensor:
    cfg, model, _ = build(extra)
    model.train(train)
    mb = data(cfg, step)[0]
    with torch.no_grad():
        return model(mb["tokens"], mb["labels"], mb.get(DROPOUT_SEED))


@pytest.mark.parametrize("extra", [["--attention-dropout", "0.2"], ["--hidden-dropout", "0.2"]])
def test_dropout_changes_the_loss_and_the_same_seed_repeats_it(extra):
    plain, dropped = first_loss([]), first_loss(extra)
    assert not torch.equal(plain, dropped)
    assert torch.equal(first_loss(extra), dropped)
    assert not torch.equal(first_loss(extra, step=2), dropped)  # same tokens, new masks


def test_seeds_differ_by_step_rank_and_microbatch():
    seeds = {microbatch_seed(1234, step, rank, mb) for step in (1, 2) for rank in (0, 1)
             for mb in (0, 1)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert microbatch_seed(1234, 3, 1, 2) == microbatch_seed(1234, 3, 1, 2)
    assert microbatch_seed(1234, 3, 1, 2) != microbatch_seed(1235, 3, 1, 2)


def test_hidden_dropout_keeps_about_one_minus_p_and_scales_the_kept():
    x = torch.rand(256, 512) + 1.0  # no zeros of its own
    p = 0.3
    out = hidden_dropout(x, p, seed=7, layer=0, site=MLP_OUT)
    dropped = (out == 0).float().mean().item()
    assert abs(dropped - p) < 0.01, dropped  # 131072 draws: std 0.0013
    kept = out != 0
    assert torch.allclose(out[kept], x[kept] / (1 - p))
    assert torch.equal(hidden_dropout(x, p, seed=7, layer=0, site=MLP_OUT), out)
    assert not torch.equal(hidden_dropout(x, p, seed=7, layer=1, site=MLP_OUT), out)
    assert hidden_dropout(x, 0.0, seed=None, layer=0, site=MLP_OUT) is x


def test_eval_mode_has_no_dropout_and_needs_no_seed():
    plain = first_loss([])
    assert torch.equal(first_loss(train=False), plain)
    cfg, model, _ = build()
    model.eval()
    mb = data(cfg)[0]
    with torch.no_grad():
        assert torch.equal(model(mb["tokens"], mb["labels"]), plain)


def test_a_training_forward_with_dropout_needs_the_seed():
    cfg, model, _ = build()
    mb = data(cfg)[0]
    with pytest.raises(ValueError, match="dropout seed"):
        model(mb["tokens"], mb["labels"])


def test_dropout_leaves_the_global_rng_alone_and_the_backward_redraws_nothing():
    """The attention dropout reseeds the CPU generator for one SDPA call only; the backward
    uses what the forward saved, whatever the global RNG did in between."""
    def grads(disturb: bool) -> dict:
        cfg, model, _ = build()
        mb = data(cfg)[0]
        state = torch.get_rng_state()
        loss = model(mb["tokens"], mb["labels"], mb[DROPOUT_SEED])
        assert torch.equal(torch.get_rng_state(), state)
        if disturb:
            torch.rand(1000)
        loss.backward()
        return grads_of(model)
    assert_same_bits(grads(True), grads(False))


def test_zero_dropout_declares_no_seed_and_microbatches_carry_none():
    cfg, model, _ = build([])
    assert all(DROPOUT_SEED not in spec.inputs.values() for spec in model.node_specs())
    assert dropout_inputs(cfg.model, cfg.train.seed, 1, 0, 0) == {}
    cfg, model, _ = build()
    needing = {spec.key for spec in model.node_specs() if DROPOUT_SEED in spec.inputs}
    # layer 0 dense (attn, mlp); MoE layers: attn and combine, never dispatch or expert mlp
    assert needing == {(0, "attn"), (0, "mlp"), (1, "attn"), (1, "combine"), (2, "attn"),
                       (2, "combine")}


def test_config_accepts_dropout_and_refuses_it_with_cuda_graphs():
    validate_config(parse_config(SMALL + DROPOUT), 1, cuda_available=False)
    with pytest.raises(ConfigError, match="dropout inside CUDA graphs"):
        validate_config(parse_config(SMALL + DROPOUT + ["--cuda-graph-impl", "local",
                                                        "--cuda-graph-modules", "attn"]),
                        1,
                        cuda_available=True)
