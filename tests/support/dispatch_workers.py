"""Per-rank bodies of the dispatch-mode tests (gloo; importable, so spawn can pickle them):
megatron-core's router and all-to-all dispatcher against ours, and training runs under the
capacity and budget modes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from epoverlap.config import parse_config
from epoverlap.model.linear import linear
from epoverlap.config.dispatch import DispatchMode
from epoverlap.model.budget import DispatchBudget
from epoverlap.model.dispatch import make_dispatcher
from epoverlap.model.moe import Router
from epoverlap.parallel.comm import ExpertComm, HostComms
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.loop.trainer import Trainer
from epoverlap.kernels import make_moe_ops
from benchmarks.harness.bench_peer import bind_missing_te_names

from gloo_workers import TINY
from run_paths import run_record, write_run_record

TOKENS, HIDDEN, EXPERTS, TOPK = 20, 16, 8, 2


def _megatron_modules():
    from megatron.core.transformer.moe import moe_utils
    bind_missing_te_names(moe_utils)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    return ProcessGroupCollection, token_dispatcher, TopKRouter, TransformerConfig


def _megatron_parts(rank, world_size, ep_group, moe):
    """megatron-core's TopKRouter and MoEAlltoAllTokenDispatcher for `moe`, on the CPU: its
    buffers that ask for the current CUDA device get the CPU (this process has no other use for
    torch.cuda), and its device-to-host staging on a side stream becomes plain host reads;
    everything else is its code."""
    pgc, token_dispatcher, top_k_router, transformer_config = _megatron_modules()
    torch.cuda.current_device = lambda: "cpu"
    singles = [dist.new_group([r], backend="gloo") for r in range(world_size)]
    mine = singles[rank]
    groups = pgc(tp=mine, ep=ep_group, tp_ep=ep_group, expt_tp=mine, expt_dp=mine, tp_cp=mine,
                 cp=mine, dp=mine, tp_dp_cp=mine)
    config = transformer_config(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, moe_expert_capacity_factor=moe.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=moe.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=moe.moe_token_drop_policy, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, add_bias_linear=False,
        use_cpu_initialization=True, moe_ffn_hidden_size=HIDDEN)
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # never used
    local = EXPERTS // world_size
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher(
        local, list(range(rank * local, (rank + 1) * local)), config, pg_collection=groups)
    dispatcher._maybe_dtoh_and_synchronize = _host_reads(dispatcher)
    return top_k_router(config, pg_collection=groups), dispatcher


def _host_reads(dispatcher):
    def read_on_host(point, tokens_per_expert=None):
        if not dispatcher.drop_and_pad and point == dispatcher.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(dispatcher, name)
                if isinstance(value, torch.Tensor):
                    setattr(dispatcher, name, value.tolist())
        return tokens_per_expert
    return read_on_host


def _megatron_layer(router, dispatcher, x_TH, logits_TE):
    """megatron-core: routing, dispatch, experts that scale by 2 and apply probs, combine."""
    probs_TE, routing_map_TE = router.routing(logits_TE.view(TOKENS, 1, EXPERTS))
    probs = probs_TE.detach().requires_grad_()
    rows, rows_probs = dispatcher.dispatch_preprocess(x_TH.view(TOKENS, 1, HIDDEN),
                                                      routing_map_TE, probs)
    rows, rows_probs = dispatcher.token_dispatch(rows, rows_probs)
    rows, per_expert, rows_probs = dispatcher.dispatch_postprocess(rows, rows_probs)
    expert_out = rows * rows_probs.unsqueeze(1) * 2.0
    out = dispatcher.combine_postprocess(dispatcher.token_combine(
        dispatcher.combine_preprocess(expert_out)))
    return (probs, routing_map_TE, rows, rows_probs, [int(c) for c in per_expert],
            out.view(TOKENS, HIDDEN))


def _our_layer(router, dispatcher, x_TH):
    probs_TE, routing_map_TE, counts_E = router(x_TH)
    probs = probs_TE.detach().requires_grad_()
    permuted, permuted_probs, row_id_map = dispatcher.preprocess(x_TH, probs, routing_map_TE)
    recv, recv_probs, meta = dispatcher.dispatch(permuted, permuted_probs, counts_E)
    rows, rows_probs, _ = dispatcher.sort_by_expert(recv, recv_probs, meta)
    expert_out = rows * rows_probs.unsqueeze(1) * 2.0
    out = dispatcher.combine(dispatcher.unsort(expert_out, meta), meta, row_id_map)
    per_expert = meta.tokens_per_local_expert or [int(c) for c in
                                                  meta.recv_counts_RL.sum(dim=0)]
    return probs, routing_map_TE, rows, rows_probs, per_expert, out


def megatron_dispatch_equivalence(rank, world_size, flag_sets):
    """For each flag set: ours and megatron-core's router + dispatcher with those flags, EP =
    world: routing, the rows each expert receives, the combined output, and the grads of tokens
    and probs. -> per flag set [ours, theirs]."""
    groups = init_distributed(world_size, "cpu", timeout_minutes=3)
    try:
        return [_both_layers(rank, world_size, groups, flags) for flags in flag_sets]
    finally:
        destroy_distributed(groups)


def _both_layers(rank, world_size, groups, flags):
    cfg = parse_config(["--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK),
                        "--hidden-size", str(HIDDEN)] + flags)
    ops = make_moe_ops("torch")
    mode = DispatchMode.of(cfg.moe)
    router = Router(cfg.moe, HIDDEN, 0, ops, seed=7, std=0.5, dtype=torch.float32,
                    device=torch.device("cpu"), aux_loss_scale=1.0, mode=mode,
                    data_rank=rank)
    ours = make_dispatcher(ExpertComm(groups.ep, world_size), EXPERTS, TOPK, ops,
                           groups.device, mode)
    their_router, theirs = _megatron_parts(rank, world_size, groups.ep_group, cfg.moe)
    x_TH = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank))
    results = []
    for run in (lambda x: _our_layer(router, ours, x),
                lambda x: _megatron_layer(their_router, theirs, x, linear(x, router.weight))):
        x = x_TH.clone().requires_grad_()
        probs, routing_map, rows, rows_probs, per_expert, out = run(x)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
        grad_x, grad_probs = torch.autograd.grad((out * weights).sum(), [x, probs])
        results.append([probs.detach(), routing_map, rows.detach(), rows_probs.detach(),
                        out.detach(), grad_x, grad_probs, per_expert])
    return results


def mode_runs(rank, world_size, ep, out_dir, steps, runs):
    """For each (name, flags): bits of one step's reduced grads, and `steps` steps' results
    (--log-json under out_dir/name.jsonl, the run's record beside it: `run_paths`)."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3)
    results = {}
    try:
        for name, flags in runs:
            log = str(Path(out_dir) / f"{name}.jsonl")
            cfg = parse_config(TINY + ["--expert-model-parallel-size", str(ep), "--train-iters",
                                       str(steps), "--log-json", log] + flags)
            trainer = Trainer(cfg, groups, log=lambda msg: None)
            write_run_record(trainer, out_dir, name)
            try:
                trainer.forward_backward(step=1)
                trainer.grads.reduce()
                grads = (trainer.grads.dense_flat.clone(), trainer.grads.expert_flat.clone())
                steps_done = trainer.train()
            finally:
                trainer.close()
            results[name] = (grads, [(r.loss, r.dropped_tokens, r.dispatch_reruns,
                                      r.dispatch_budget) for r in steps_done])
        return results
    finally:
        destroy_distributed(groups)


def graphed_training(rank, world_size, ep, steps, runs):
    """For each (name, flags): train `steps` steps with the CUDA-graph capture emulated on the
    CPU (`test_graphs_cpu.EmulatedGraphs`); -> per run the step results (loss, reruns, budget),
    the budget levels whose graph banks were captured, and the log lines (first the run's
    `config:` and `path:` lines, as the training command prints them: `run_paths`)."""
    from graph_emulation import EmulatedGraphs
    groups = init_distributed(ep, "cpu", timeout_minutes=3)
    results = {}
    try:
        for name, flags in runs:
            cfg = parse_config(TINY + ["--expert-model-parallel-size", str(ep), "--train-iters",
                                       str(steps), "--cuda-graph-warmup-steps", "1"] + flags)
            lines: list[str] = []
            trainer = Trainer(cfg, groups, log=lines.append, graph_backend=EmulatedGraphs)
            lines[:0] = run_record(trainer)
            try:
                steps_done = trainer.train()
                store = trainer.parts.graph_banks
                banks = (None if store is None else
                         sorted(k for k, b in store.banks.items() if b.captured))
            finally:
                trainer.close()
            results[name] = ([(r.loss, r.dispatch_reruns, r.dispatch_budget) for r in steps_done],
                             banks, lines)
        return results
    finally:
        destroy_distributed(groups)


def _scaled_expert_layer(router, dispatcher, x_TH, rank):
    """Routing, dispatch, experts that multiply each row by its prob, 2 and a weight per local
    expert, combine. -> (probs leaf, routing map, expert rows, their probs, rows per local
    expert, output, the expert weights)."""
    probs_TE, routing_map_TE, counts_E = router(x_TH)
    probs = probs_TE.detach().requires_grad_()
    permuted, permuted_probs, row_id_map = dispatcher.preprocess(x_TH, probs, routing_map_TE)
    exchange = dispatcher.start_split_exchange(counts_E, row_id_map)
    recv, recv_probs, meta = dispatcher.dispatch(permuted, permuted_probs, counts_E, exchange,
                                                 row_id_map)
    rows, rows_probs, local_map = dispatcher.sort_by_expert(recv, recv_probs, meta)
    per_expert = (meta.tokens_per_local_expert if meta.tokens_per_local_expert is not None
                  else meta.recv_counts_RL.sum(dim=0).tolist())  # the budget: rows past are 0
    local = dispatcher.num_local
    weights_L = (1.0 + rank * local + torch.arange(local, dtype=x_TH.dtype)).requires_grad_()
    padding = rows.shape[0] - sum(per_expert)
    scale_M = torch.cat([weights_L.repeat_interleave(torch.tensor(per_expert)),
                         weights_L.new_zeros(padding)])
    expert_out = rows * (rows_probs * scale_M * 2.0).unsqueeze(1)
    out = dispatcher.combine(dispatcher.unsort(expert_out, meta, local_map), meta, row_id_map)
    return probs, routing_map_TE, rows, rows_probs, per_expert, out, weights_L


def _router_and_tokens(flags: list, ops, rank: int):
    """The config of `flags` over this module's shape, its router, and this rank's tokens."""
    cfg = parse_config(["--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK),
                        "--hidden-size", str(HIDDEN)] + flags)
    router = Router(cfg.moe, HIDDEN, 0, ops, seed=7, std=0.5, dtype=torch.float32,
                    device=torch.device("cpu"), aux_loss_scale=1.0, mode=DispatchMode.of(cfg.moe),
                    data_rank=rank)
    return cfg, router, torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank))


def _layer_and_grads(router, dispatcher, x_TH, rank) -> list:
    """`_scaled_expert_layer` and its backward: [probs, routing map, expert rows, their probs,
    output, token grads, prob grads, expert weight grads, rows per local expert]."""
    x = x_TH.clone().requires_grad_()
    probs, routing_map, rows, rows_probs, per_expert, out, weights = \
        _scaled_expert_layer(router, dispatcher, x, rank)
    grad_w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad((out * grad_w).sum(), [x, probs, weights])
    return [probs.detach(), routing_map, rows.detach(), rows_probs.detach(), out.detach(),
            *grads, per_expert]


def once_per_rank_equivalence(rank, world_size, flag_sets, backend):
    """For each flag set: the layer of `_scaled_expert_layer` with and without
    --moe-dispatch-once-per-rank, EP = world, kernels of `backend`. -> per flag set, per
    dispatch: [probs, routing map, expert rows, their probs, output, token grads, prob grads,
    expert weight grads, rows per local expert, the input splits of every all-to-all of
    hidden rows (forward dispatch and combine, then their backwards), x]. The weight of global
    expert e is e + 1."""
    groups = init_distributed(world_size, "cpu", timeout_minutes=3)
    try:
        ops = make_moe_ops(backend)
        results = []
        for flags in flag_sets:
            cfg, router, x_TH = _router_and_tokens(flags, ops, rank)
            per_dispatch = []
            for once in (False, True):
                mode = dataclasses.replace(DispatchMode.of(cfg.moe), once_per_rank=once)
                comm = ExpertComm(groups.ep, world_size)
                comm.trace = []
                topk = cfg.moe.moe_router_topk
                budget = None if mode.budget is None else DispatchBudget.for_dispatch(
                    mode.budget, world_size, TOKENS, topk, EXPERTS, once, groups.device)
                dispatcher = make_dispatcher(comm, EXPERTS, topk, ops, groups.device, mode,
                                             budget)
                results_of_layer = _layer_and_grads(router, dispatcher, x_TH, rank)
                payload = [splits[1] for splits in comm.trace if splits[2] == (HIDDEN,)]
                per_dispatch.append(results_of_layer + [payload, x_TH])
            results.append(per_dispatch)
        return results
    finally:
        destroy_distributed(groups)


def by_host_equivalence(rank, world_size, hosts, flag_sets, backend):
    """For each flag set: the layer of `_scaled_expert_layer` once per rank (flat) and by host
    (--moe-dispatch-hierarchy node over `hosts` hosts of world / hosts ranks), EP = world.
    -> per flag set, per dispatch: [probs, routing map, expert rows, their probs, output, token
    grads, prob grads, expert weight grads, rows per local expert, rows this rank sends to
    each host in the forward dispatch (flat: summed per host), x]."""
    per_host = world_size // hosts
    groups = init_distributed(world_size, "cpu", timeout_minutes=3, ep_per_host=per_host)
    try:
        ops = make_moe_ops(backend)
        results = []
        for flags in flag_sets:
            cfg, router, x_TH = _router_and_tokens(flags, ops, rank)
            per_dispatch = []
            for hierarchy in ("flat", "node"):
                mode = dataclasses.replace(DispatchMode.of(cfg.moe), once_per_rank=True,
                                           hierarchy=hierarchy)
                between = ExpertComm(groups.ep_rail, hosts)
                by_host = HostComms(between, ExpertComm(groups.ep_host, per_host),
                                    groups.ep_rank)
                comm = ExpertComm(groups.ep, world_size, by_host=by_host)
                comm.trace, between.trace = [], []
                dispatcher = make_dispatcher(comm, EXPERTS, cfg.moe.moe_router_topk, ops,
                                             groups.device, mode)
                results_of_layer = _layer_and_grads(router, dispatcher, x_TH, rank)
                trace = between.trace if hierarchy == "node" else comm.trace
                sent = [splits[1] for splits in trace if splits[2] == (HIDDEN,)][0]
                if hierarchy == "flat":
                    sent = [sum(sent[h * per_host:(h + 1) * per_host]) for h in range(hosts)]
                per_dispatch.append(results_of_layer + [sent, x_TH])
            results.append(per_dispatch)
        return results
    finally:
        destroy_distributed(groups)


def _by_host_comm(groups, hosts: int, world_size: int) -> ExpertComm:
    """The EP comm of the world with its stages between and inside `hosts` hosts."""
    per_host = world_size // hosts
    by_host = HostComms(ExpertComm(groups.ep_rail, hosts), ExpertComm(groups.ep_host, per_host),
                        groups.ep_rank)
    return ExpertComm(groups.ep, world_size, by_host=by_host)


def by_host_budget_equivalence(rank, world_size, hosts, flag_sets, budget_factor, backend):
    """For each flag set: the layer of `_scaled_expert_layer` by host, dropless and with the
    budget `budget_factor` (`ByHostBudget`); the budget's layer reruns as the trainer does (its
    demand max over ranks, `rerun_level`) until it fits. -> per flag set: (dropless results,
    budget results, the budget levels run, the three block sizes at the first level, the
    demand of the first run)."""
    groups = init_distributed(world_size, "cpu", timeout_minutes=3, ep_per_host=world_size // hosts)
    try:
        ops = make_moe_ops(backend)
        results = []
        for flags in flag_sets:
            cfg, router, x_TH = _router_and_tokens(flags, ops, rank)
            topk = cfg.moe.moe_router_topk
            mode = dataclasses.replace(DispatchMode.of(cfg.moe), hierarchy="node")
            dropless = make_dispatcher(_by_host_comm(groups, hosts, world_size), EXPERTS, topk,
                                       ops, groups.device, mode)
            want = _layer_and_grads(router, dropless, x_TH, rank)
            mode = dataclasses.replace(mode, budget=budget_factor)
            budget = DispatchBudget.for_dispatch(budget_factor, world_size, TOKENS, topk,
                                                 EXPERTS, True, groups.device, hosts=hosts)
            dispatcher = make_dispatcher(_by_host_comm(groups, hosts, world_size), EXPERTS,
                                         topk, ops, groups.device, mode, budget)
            sizes = (budget.block_rows, budget.within_rows, budget.expert_rows)
            levels, first_demand = [], None
            while True:
                budget.reset_demand()
                got = _layer_and_grads(router, dispatcher, x_TH, rank)
                levels.append(budget.level)
                demand = budget.demand()
                dist.all_reduce(demand, op=dist.ReduceOp.MAX)
                first_demand = first_demand or demand.tolist()
                level = budget.rerun_level(demand.tolist())
                if level is None:
                    break
                budget.level = level
            results.append((want, got, levels, sizes, first_demand))
        return results
    finally:
        destroy_distributed(groups)
