"""Per-rank bodies of the gloo multi-process tests (importable, so spawn can pickle them)."""

from __future__ import annotations

from pathlib import Path

import torch

from epoverlap.parallel.comm import ExpertComm
from epoverlap.config import parse_config
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.model.dispatch import make_dispatcher
from epoverlap.training.loop.trainer import Trainer
from epoverlap.kernels import make_moe_ops

from run_paths import assert_schedules_differ, read_run_record, write_run_record

TINY = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "32",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
        "--micro-batch-size", "2", "--num-microbatches", "4", "--moe-aux-loss-coeff", "0.01",
        "--mock-data", "--deterministic-mode", "--distributed-timeout-minutes", "3",
        "--lr-warmup-iters", "2", "--log-interval", "1000"]

MODES = {
    "sequential": ["--no-overlap-moe-expert-parallel-comm"],
    "overlap": ["--overlap-moe-expert-parallel-comm"],
    "overlap_wgrad": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"],
    "early_release_wgrad": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
                            "--overlap-plan", "combined_1f1b_early_release"],
    "paired_ends_wgrad": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
                          "--overlap-plan", "combined_1f1b_paired_ends"],
    # steps 2-7 alternate the overlap and sequential schedules, then the faster runs on
    "probe_wgrad": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
                    "--overlap-probe-steps", "3"],
}


def _route_to_first_experts(router):
    """Make every token pick experts 0..k-1 (all on EP rank 0): other ranks receive nothing."""
    original = router._logits

    def biased(x_TH):
        logits = original(x_TH)
        bias = torch.zeros(logits.shape[1], dtype=logits.dtype)
        bias[: router.moe.moe_router_topk] = 100.0
        return logits + bias
    router._logits = biased


def dispatch_round_trip(rank, world_size, ep, topk, extreme):
    """Preprocess, dispatch, sort, identity experts, unsort, combine: returns k * input."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3)
    try:
        num_experts, tokens, hidden = 8, 13 + rank, 6
        gen = torch.Generator().manual_seed(100 + rank)
        x_TH = torch.randn(tokens, hidden, generator=gen)
        logits = torch.randn(tokens, num_experts, generator=gen)
        if extreme:
            logits[:, :topk] += 100.0
        ops = make_moe_ops("torch")
        probs, routing_map = ops.router_topk(logits, topk)
        dispatcher = make_dispatcher(ExpertComm(groups.ep, ep), num_experts, topk, ops,
                                     groups.device)
        permuted, permuted_probs, row_id_map = dispatcher.preprocess(x_TH, probs, routing_map)
        recv, recv_probs, meta = dispatcher.dispatch(permuted, permuted_probs,
                                                     routing_map.sum(0))
        sorted_rows, _, _ = dispatcher.sort_by_expert(recv, recv_probs, meta)
        out_TH = dispatcher.combine(dispatcher.unsort(sorted_rows, meta), meta, row_id_map)
        expected = torch.zeros_like(x_TH)
        for _ in range(topk):
            expected = expected + x_TH
        return torch.equal(out_TH, expected), int(recv.shape[0])
    finally:
        destroy_distributed(groups)


def _trainer(ep, argv):
    cfg = parse_config(TINY + ["--expert-model-parallel-size", str(ep)] + argv)
    return cfg


def mode_grads_and_losses(rank, world_size, ep, out_dir, steps, extra=(), modes=None, cp=1):
    """For each mode (`modes`, default `MODES`; one named "sequential"): bits of one step's
    reduced grads, a --log-json of `steps` steps and the run's record (`run_paths`) under
    `out_dir`. `extra`: flags every mode adds (dropout, say); `cp`: the CP size."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3, cp_size=cp)
    extra = list(extra) + ["--context-parallel-size", str(cp)]
    results = {}
    try:
        for mode, flags in (modes or MODES).items():
            log = str(Path(out_dir) / f"{mode}.jsonl")
            trainer = Trainer(_trainer(ep, flags + list(extra) + ["--train-iters", str(steps),
                                                                  "--log-json", log]), groups,
                              log=lambda msg: None)
            write_run_record(trainer, out_dir, mode)
            try:
                trainer.run_microbatches(step=1)
                trainer.grads.reduce()
                grads = (trainer.grads.dense_flat.clone(), trainer.grads.expert_flat.clone())
                trainer.train()
            finally:
                trainer.close()
            results[mode] = grads
        return results
    finally:
        destroy_distributed(groups)


def flat_adam_grads_and_losses(rank, world_size, ep, out_dir, steps, modes):
    """`mode_grads_and_losses` with the flat AdamW form (the GPU default) for the CPU's own."""
    from epoverlap.training.optimizer import optim
    optim.default_adam_impl = lambda device: "flat"
    return mode_grads_and_losses(rank, world_size, ep, out_dir, steps, modes=modes)


def ep_losses(rank, world_size, ep, steps):
    """Losses of a few steps with expert parallel size `ep` (same global model and data)."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3)
    try:
        trainer = Trainer(_trainer(ep, ["--train-iters", str(steps)]), groups,
                          log=lambda msg: None)
        try:
            return [r.loss for r in trainer.train()]
        finally:
            trainer.close()
    finally:
        destroy_distributed(groups)


def extreme_routing_training(rank, world_size, ep, flags):
    """Train with every token routed to EP rank 0's experts; returns losses and rows received."""
    groups = init_distributed(ep, "cpu", timeout_minutes=2)
    try:
        trainer = Trainer(_trainer(ep, flags + ["--train-iters", "2"]), groups,
                          log=lambda msg: None)
        for router in trainer.model.routers():
            _route_to_first_experts(router)
        try:
            results = trainer.train()
            counts = trainer.model.routers()[0].step_counts.tolist()
            return [r.loss for r in results], counts
        finally:
            trainer.close()
    finally:
        destroy_distributed(groups)


def reduced_grads_for_reference(rank, world_size, ep, argv):
    """One step's microbatches, parameters, loss per microbatch and reduced `main_grad`s of this
    rank (test_reference_model compares them with a float64 reference of the whole world)."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3)
    try:
        trainer = Trainer(_trainer(ep, argv), groups, log=lambda msg: None)
        try:
            inputs = trainer.microbatches(step=1)
            losses = trainer.run_microbatches(step=1, inputs=inputs)
            trainer.grads.reduce()
            named = dict(trainer.model.named_parameters())
            return {"inputs": inputs, "losses": [float(loss) for loss in losses],
                    "params": {n: p.detach().clone() for n, p in named.items()},
                    "grads": {n: p.main_grad.clone() for n, p in named.items()},
                    "expert_names": sorted(n for n, p in named.items()
                                           if getattr(p, "is_expert", False))}
        finally:
            trainer.close()
    finally:
        destroy_distributed(groups)


def groups_with_a_cta_budget(rank, world_size):
    """A gloo world: the groups of an empty budget (what every CPU run passes) carry an
    all-to-all as before; a real budget is refused before any group is created."""
    from epoverlap.parallel.groups import NcclCtaBudget, expert_parallel_groups
    groups = init_distributed(world_size, "cpu", timeout_minutes=3, ep_budget=NcclCtaBudget())
    try:
        send = torch.arange(world_size, dtype=torch.float32) + 10 * rank
        recv = torch.empty_like(send)
        groups.ep.all_to_all_single(recv, send)
        try:
            expert_parallel_groups(world_size, groups.device, watch=groups.watch,
                                   ep_budget=NcclCtaBudget(max_ctas=4))
            refusal = None
        except ValueError as error:
            refusal = str(error)
        return recv.tolist(), groups.backend, refusal
    finally:
        destroy_distributed(groups)


def assert_modes_match_sequential(results: list, log_dir, steps: int, modes=None,
                                  differs=None) -> None:
    """What `mode_grads_and_losses` gave on every rank: each mode's reduced grads the
    sequential mode's bits, and its --log-json's losses and grad norms too, every step. Each
    mode's run differs from the sequential one where it claims to: `differs` maps a mode to
    its check of the two run records (`run_paths`); the rest differ in schedule."""
    from epoverlap.cli.compare_losses import compare_loss_logs
    modes = modes or MODES
    sequential = read_run_record(log_dir, "sequential")
    assert "schedule sequential" in sequential[1], sequential
    for mode in modes:
        if mode != "sequential":
            (differs or {}).get(mode, assert_schedules_differ)(
                read_run_record(log_dir, mode), sequential)
    for rank, per_mode in enumerate(results):
        dense_ref, expert_ref = per_mode["sequential"]
        assert dense_ref.abs().sum() > 0 and expert_ref.abs().sum() > 0
        for mode in modes:
            dense, expert = per_mode[mode]
            assert torch.equal(dense.view(torch.int32), dense_ref.view(torch.int32)), (rank, mode)
            assert torch.equal(expert.view(torch.int32), expert_ref.view(torch.int32)), \
                (rank, mode)
    for mode in modes:
        comparison = compare_loss_logs(Path(log_dir) / "sequential.jsonl",
                                       Path(log_dir) / f"{mode}.jsonl")
        assert comparison.identical, comparison.message
        assert comparison.steps_compared == comparison.grad_norms_compared == steps



def forced_balance_routings(rank, world_size, ep, builds):
    """With --moe-router-force-load-balancing: each router's routing maps of its first two
    forwards, from each of `builds` fresh trainers (the draw reads no token: zeros stand in)."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3)
    try:
        per_build = []
        for _ in range(builds):
            trainer = Trainer(_trainer(ep, ["--moe-router-force-load-balancing"]), groups,
                              log=lambda msg: None)
            try:
                tokens_TH = torch.zeros(64, trainer.cfg.model.hidden_size)
                per_build.append([[router(tokens_TH)[1] for _ in range(2)]
                                  for router in trainer.model.routers()])
            finally:
                trainer.close()
        return groups.dp_rank, per_build
    finally:
        destroy_distributed(groups)
