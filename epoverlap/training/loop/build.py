"""Building a training run: every piece one run needs, made once from a validated config.

Owns `RunParts`: the data source (opened here unless given; the model's vocabulary is the
source's), the EP communicator, the model (or this pipeline stage of it, with its dispatch
strategy built once, `model.dispatch`), fp32 grad buffers, optimizer, lanes, span recorder,
fault injector, CUDA graph banks (--cuda-graph-impl local or full_iteration; by budget level
when they hold the dispatch, `graphs.banks`), the Triton compile watch, the checkpointer and
the step a resumed run continues after, and the run's execution paths (`paths`, each an
`training.loop.path.ExecutionPath`: plan, executor, lanes, weight-grad deferral, dispatcher,
graph banks), every one made by one builder (`build_path`): the flags' path, its every
pipeline stage's plan built and checked together before the first step (`validate_pipeline`),
or with the path tuner (`training.tuning.tuner`; the candidates' list `config.tuning`) the
tuner and one path per candidate. `close` releases what holds device memory or streams.

The construction order is part of the run's contract: the collectives made while building
(parameter counts and layouts over the pipeline, the checkpoint's load, the tuner's memory check
and cache read) run in the same order on every rank. What runs a step is `training.loop.step`; what
reports it, `training.telemetry.metrics`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from epoverlap.config import RunConfig, resolve_config
from epoverlap.config.aliases import deprecation_note
from epoverlap.config.dispatch import DispatchMode
from epoverlap.config.tuning import (PAIRED_ENDS, SEQUENTIAL, TunePath, candidate_paths,
                                     flags_path, may_tune, paths_within, probe_steps,
                                     steps_needed, timed_steps, tune_mode)
from epoverlap.graphs.banks import GraphBanks, SizeBanks, StepGraphs
from epoverlap.graphs.capture import (CudaGraphBackend, GraphRunner, graphed_modules,
                                      graphs_span_moe_layer)
from epoverlap.graphs.full_iteration import FullIterationGraph
from epoverlap.kernels import make_moe_ops
from epoverlap.model.budget import DispatchBudget
from epoverlap.model.context import dynamic_sizes
from epoverlap.model.dispatch import TokenDispatcher, make_dispatcher
from epoverlap.model.documents import Documents
from epoverlap.model.transformer import MoEModel, count_parameters, model_dtype
from epoverlap.parallel.comm import ContextComm, ExpertComm, HostComms, PipelineComm
from epoverlap.parallel.groups import ParallelGroups, add_host_groups, context_groups
from epoverlap.parallel.host_memory import CopyEngineTransport, open_host_transport
from epoverlap.parallel.peer_memory import open_peer_transport
from epoverlap.parallel.transport import ranks_per_host
from epoverlap.parallel.watch import host_list
from epoverlap.profiling.recorder import SpanRecorder
from epoverlap.schedule.executor import CommHold, Executor, make_lanes
from epoverlap.schedule.pipeline import named_plans, validate_pipeline
from epoverlap.schedule.plan import stage_layout
from epoverlap.schedule.wgrad import WeightGradQueue
from epoverlap.training.checkpoints.checkpoint import Checkpointer
from epoverlap.training.checkpoints.checkpoint_files import CheckpointRef
from epoverlap.training.loop.compile_watch import CompileWatch
from epoverlap.training.telemetry.console import warn_every_rank
from epoverlap.training.setup.data import open_data_source
from epoverlap.training.loop.faults import FaultInjector
from epoverlap.training.loop.path import ExecutionPath
from epoverlap.training.optimizer.grads import GradBuffers
from epoverlap.training.setup.memory import (ExpertGradPlacement, available_memory,
                                             estimate_memory, place_expert_grads)
from epoverlap.training.optimizer.optim import MixedPrecisionAdamW
from epoverlap.training.tuning.tune_cache import CacheTarget, agreed_cached_decision
from epoverlap.training.tuning.tuner import Tuner


class RunParts:
    """The built pieces of one run (see the module docstring). `paths`: every path built, by
    name; `path`: the one the run starts on (the only one without the tuner), whose lanes a
    caller may replace (serial lanes) before the first step. The step, the evaluator and the
    reporter are handed the pieces they use (`training.loop.trainer`)."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups,
                 log: Callable[[str], None] = print, data=None,
                 resume: Optional[CheckpointRef] = None, graph_backend=CudaGraphBackend):
        self.graph_backend = graph_backend
        cfg = resolve_config(cfg, groups.world_size, groups.device.type == "cuda")
        self.data = data if data is not None else open_data_source(cfg, groups.data_size)
        cfg = cfg.with_vocab_size(self.data.vocab_size)
        self.cfg, self.groups, self.log = cfg, groups, log
        self.device = groups.device
        self.backend = cfg.resolved_kernel_backend(self.device.type)
        self._build_model()
        self._build_step_machinery()
        self.compile_watch = CompileWatch(cfg.cuda_graph.warmup_steps, groups.rank,
                                          warn=warn_every_rank)
        self.checkpointer = Checkpointer(cfg, groups, self.model, self.optimizer, log)
        self.start_step = self.checkpointer.resume(resume)
        self.tune_cache: Optional[CacheTarget] = None  # rank 0's --tune-cache file and key
        self.tuner, self.paths = self._tuner()
        self.path = self.paths[self.tuner.path_for(self.start_step + 1)
                               if self.tuner is not None
                               else self.flags_path.name]
        if self.path.graphs is not None:  # the first path's base bank (made lazily)
            self.path.graphs.select(0)

    # ----------------------------------------------------------------- model and state
    def _build_model(self) -> None:
        """Communicator, model, its parameter counts, grad buffers, optimizer."""
        cfg, groups = self.cfg, self.groups
        self.comm = ExpertComm(groups.ep, groups.ep_size, cfg.overlap.comm_mode,
                               counts_group=groups.ep_splits, by_host=_host_comms(cfg, groups),
                               transport=_copy_transport(cfg, groups))
        self.expert_grads = self._place_expert_grads()
        self.wgrad_queue = WeightGradQueue(enabled=cfg.overlap.delay_wgrad_compute,
                                           **self.expert_grads.queue_options())
        self.model = MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                              self.comm, groups.ep_rank, make_moe_ops(self.backend),
                              dtype=model_dtype(cfg.train.bf16), device=self.device,
                              wgrad_queue=self.wgrad_queue, stage=groups.pp_rank,
                              pipe=self._pipeline_comm(),
                              one_node_moe_layers=self.one_node_moe_layers,
                              data_rank=groups.dp_rank,
                              cp_comm=_context_comm(cfg, groups),
                              documents=self._documents())
        self.params = self._whole_model_parameters()
        self.grads = GradBuffers(self.model, groups, fuse_grad_accumulation=not
                                 cfg.train.no_gradient_accumulation_fusion)
        self.optimizer = MixedPrecisionAdamW(self.model, cfg.train)

    def _place_expert_grads(self) -> ExpertGradPlacement:
        """Where the experts' weight grads go: paired over microbatches where the memory
        estimate leaves room under this rank's budget (`setup.memory.place_expert_grads`, the
        one place that decides); the choice is logged once."""
        budget, where = available_memory(self.device.type, self.groups.local_rank,
                                         int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        placement = place_expert_grads(self.cfg, self.groups.world_size, budget, where)
        self._log_first(placement.line)
        return placement

    def _documents(self) -> Optional[Documents]:
        """The packed samples' rules, with the data's end-of-document id (None without
        --reset-position-ids or --reset-attention-mask)."""
        d = self.cfg.data
        if not d.reads_documents:
            return None
        return Documents(self.data.eod, d.reset_position_ids, d.reset_attention_mask,
                         d.max_documents_per_sample)

    def _pipeline_comm(self) -> Optional[PipelineComm]:
        cfg, groups = self.cfg, self.groups
        if groups.pp_size == 1:
            return None
        return PipelineComm(groups.pp, (cfg.microbatch_tokens, cfg.model.hidden_size),
                            model_dtype(cfg.train.bf16), self.device)

    def _whole_model_parameters(self) -> dict:
        """count_parameters of the whole model: this stage's, summed over the pipeline."""
        mine = count_parameters(self.model, self.groups.ep_size)
        if self.groups.pp_size == 1:
            return mine
        counts = torch.tensor(list(mine.values()), device=self.device)
        self.groups.pp.all_reduce(counts)
        return dict(zip(mine, host_list(counts)))

    @property
    def one_node_moe_layers(self) -> bool:
        graph_cfg = self.cfg.cuda_graph
        return graphs_span_moe_layer(graph_cfg.impl, graph_cfg.modules)

    @property
    def budget(self) -> Optional[DispatchBudget]:
        """The budget dispatch's shared budget (None in the other modes)."""
        return self.model.dispatch_budget

    # ----------------------------------------------------------------- what runs a step
    def _build_step_machinery(self) -> None:
        """Lanes, recorder, faults, the graph banks, the flags' path (built first: every
        stage's plan checked over the pipeline before the checkpoint's load; with the tuner,
        its candidates replace it)."""
        cfg = self.cfg
        self.lanes = make_lanes(self.device, self._two_lanes(True),
                                cfg.overlap.comm_stream_high_priority)
        hold_us = cfg.overlap.local_copy_hold_us
        self.comm_hold = CommHold(hold_us, self.device) if hold_us else None
        self.recorder = SpanRecorder(self.device, self.groups.rank, self.groups.world_size,
                                     local_copy_hold_us=hold_us)
        self.faults = FaultInjector(self.groups.rank)
        self.graph_banks = self._graph_banks()
        self.flags_path = self.build_path(flags_path(cfg), self.lanes)

    # ----------------------------------------------------------------- a path, built
    def build_path(self, spec: TunePath, lanes, keyed: bool = False) -> ExecutionPath:
        """The one builder of a path (`training.loop.path`): its dispatcher, its nodes (the
        model's, of its waves and dispatch), its executor on `lanes` (with
        --overlap-grad-reduce reducing the grad buckets beside the backward), this stage's
        plan, its graph banks (`keyed`: by its name, where the tuner has several paths)."""
        dispatcher = self._dispatcher(spec)
        specs = self.model.node_specs(spec.waves, dispatcher)
        per_layer = self.graph_banks is not None and self.cfg.cuda_graph.impl == "local"
        beside = self.cfg.overlap.overlap_grad_reduce and self.groups.dp_size > 1
        executor = Executor(self.faults.wrap_specs(specs), lanes, self.wgrad_queue,
                            self.recorder,
                            **({"run_factory": self.graph_banks} if per_layer else {}),
                            grad_reduce=self.grads if beside else None, hold=self.comm_hold)
        plan = self.build_plans(spec, specs)[1][self.groups.pp_rank]
        graphs = self._path_graphs(spec.name if keyed else None, executor, plan, specs)
        return ExecutionPath(spec, plan, executor, dispatcher, graphs, self.wgrad_queue)

    def _dispatcher(self, spec: TunePath) -> Optional[TokenDispatcher]:
        """A path's dispatcher: the model's own where the path dispatches as the flags do,
        else one of its own: once per rank (the `+once` path; no budget: it needs none), or on
        the process group where the flags' go through host memory (`+group`)."""
        model = self.model
        flags = model.dispatch_mode
        once = spec.once_per_rank or flags.once_per_rank
        on_group = not spec.copy_engine and self.comm.transport is not None
        if model.dispatcher is None or (once == flags.once_per_rank and not on_group):
            return model.dispatcher
        return make_dispatcher(self.comm.on_process_group() if on_group else self.comm,
                               self.cfg.moe.num_experts, self.cfg.moe.moe_router_topk,
                               model.ops, self.device,
                               dataclasses.replace(flags, once_per_rank=once),
                               model.dispatch_budget if once == flags.once_per_rank else None)

    def build_plans(self, path: TunePath, specs: list) -> tuple[list, list]:
        """Every stage's layout (its nodes' kinds, gathered over the pipeline) and plan named
        `path.plan` (the registry `schedule.plan.PLANS`, through `named_plans`), with its
        weight-grad deferral; the plans checked together (`validate_pipeline`) before the
        first step."""
        cfg, g = self.cfg, self.groups
        mine = stage_layout([(spec.layer, spec.kind) for spec in specs])
        layouts = [mine]
        if g.pp_size > 1:
            layouts = [None] * g.pp_size
            g.pp.all_gather_object(layouts, mine)
        plans = named_plans(path.plan, layouts, cfg.train.num_microbatches, path.delay_wgrad)
        validate_pipeline(plans, layouts, cfg.train.num_microbatches, path.delay_wgrad)
        return layouts, plans

    # ----------------------------------------------------------------- CUDA graphs
    def _graph_banks(self) -> Optional[GraphBanks]:
        """The run's CUDA graph banks (--cuda-graph-impl local or full_iteration), every path's
        (see `epoverlap.graphs.banks`); None without graphs."""
        if self.cfg.cuda_graph.impl not in ("local", "full_iteration"):
            return None
        # a bank per budget level and per path the tuner may run (`_tuner` keys them by path)
        paths = len(candidate_paths(self.cfg)) if tune_mode(self.cfg) != "off" else 1
        return GraphBanks(None, self._levels_per_path() * paths)

    @property
    def _graphs_hold_dispatch(self) -> bool:
        return self.cfg.cuda_graph.impl == "full_iteration" or self.one_node_moe_layers

    def _levels_per_path(self) -> int:
        """A path's banks: one per budget level when they hold the budget dispatch, else one."""
        budget = self.model.dispatch_budget
        return budget.max_levels if budget is not None and self._graphs_hold_dispatch else 1

    def _path_graphs(self, key: Optional[str], executor: Executor, plan: list,
                     specs: list) -> Optional[StepGraphs]:
        """A path's side of the graph banks, by budget level when they hold the dispatch."""
        if self.graph_banks is None:
            return None
        graph_cfg = self.cfg.cuda_graph
        full = graph_cfg.impl == "full_iteration"
        make_bank = self._bank_factory(full, self._replay_watch(self._graphs_hold_dispatch),
                                       executor, plan, specs)
        per_level = self.model.dispatch_budget is not None and self._graphs_hold_dispatch
        return StepGraphs(self.graph_banks, graph_cfg.warmup_steps, per_level, full, key,
                          make_bank)

    def _bank_factory(self, full: bool, watch, executor: Executor, plan: list,
                      specs: list) -> Callable[[], object]:
        """What makes one bank of a path: a full-iteration graph of its plan, or per-layer
        graphs of its nodes (under dynamic CP a runner per CP size, `SizeBanks`)."""
        graph_cfg, generators = self.cfg.cuda_graph, router_generators(self.model)
        if full:
            def make_bank():
                return FullIterationGraph(executor, plan, loss_scale(self.cfg),
                                          device=self.device, generators=generators,
                                          backend_factory=self.graph_backend,
                                          replay_watch=watch)
            return make_bank

        def make_runner(size: Optional[int] = None):
            return GraphRunner(specs, graphed_modules(graph_cfg.modules),
                               device=self.device, queue=self.wgrad_queue,
                               generators=generators, check_inputs=graph_cfg.check_inputs,
                               backend_factory=self.graph_backend,
                               replay_watch=self._with_context_watch(watch, size))
        context = self.model.context
        if context is not None and context.dynamic:
            return lambda: SizeBanks(make_runner, context.sizes, context.local_tokens)
        return make_runner

    def _replay_watch(self, holds_dispatch: bool):
        """What wraps each graph replay: the EP group's watch when the graphs hold the
        all-to-alls (captured collectives are issued by the replays, see `watch.collective`)."""
        if not holds_dispatch or self.groups.ep_size == 1:
            return contextlib.nullcontext
        return lambda: self.groups.ep.watched("all_to_all (CUDA graph replay)")

    def _with_context_watch(self, watch, size: Optional[int]):
        """`watch`, and the CP group's where per-layer graphs may hold its exchanges (the ring,
        the K/V gather inside the attention, the aux loss's counts): the group of `size`
        under dynamic CP (None: the run's CP size; size 1 holds none)."""
        context = self.model.context
        if context is None or size == 1:
            return watch
        group = context.comm.sizes[size or context.comm.size].group

        @contextlib.contextmanager
        def both():
            with watch(), group.watched("K/V exchange (CUDA graph replay)"):
                yield
        return both

    # ----------------------------------------------------------------- the path tuner
    def _tuner(self) -> tuple[Optional[Tuner], dict[str, ExecutionPath]]:
        """--tune: the tuner, and each path it chooses between, built (`training.tuning.tuner`;
        one stage, eager or graphs each path replays its own of: config validation, and
        `config.tuning.may_tune` for auto, see to it). A decision from --tune-cache builds only
        the path it names. Without the tuner: None and the flags' path."""
        alone = {self.flags_path.name: self.flags_path}
        cfg, probed = self.cfg, probe_steps(self.cfg)
        if probed and self.groups.is_first():
            warn_every_rank(deprecation_note(f"--overlap-probe-steps {probed}",
                                             f"--tune on --tune-steps {probed}")
                            + " (two paths: the overlap plan and sequential)")
        if not may_tune(cfg, self.device.type):
            return None, alone
        paths = self._paths_that_fit(candidate_paths(cfg))
        names = [path.name for path in paths]
        cached, self.tune_cache = agreed_cached_decision(self, names)
        if cached is None:
            paths = self._paths_within(paths)
            names = [path.name for path in paths]
            if not paths:
                return None, alone
        serial = self.lanes if self._two_lanes(False) else make_lanes(self.device, False)
        built = {path.name: self.build_path(path, serial if path.plan == SEQUENTIAL
                                            else self.lanes, keyed=True)
                 for path in paths if cached is None or path.name == cached.chosen}
        if serial is not self.lanes and not any(b.lanes is serial for b in built.values()):
            serial.close()
        first = self.start_step + (1 if self.graph_banks is None else
                                   max(cfg.cuda_graph.warmup_steps, 1))
        tuner = Tuner(names, timed_steps(cfg), first, prime=self.graph_banks is not None,
                      cached=cached)
        return tuner, built

    def _paths_within(self, paths: list[TunePath]) -> list[TunePath]:
        """The paths the run's steps leave time to tune (`paths_within`), saying what it
        leaves out; a decision among fewer paths than the job has is not cached (a longer
        run of the same key times them all)."""
        cfg = self.cfg
        steps_left = cfg.train.train_iters - self.start_step
        within = paths_within(cfg, paths, steps_left)
        needed = steps_needed(cfg, len(paths))
        if not within:
            if len(paths) > 1 or tune_mode(cfg) == "on":  # (auto, nothing to choose: silent)
                self._log_first(f"tune: not tuned ({len(paths)} path(s); {needed} steps "
                                f"needed, {steps_left} left): {cfg.plan_name} as the flags say")
            return []
        if len(within) < len(paths):
            left_out = ", ".join(p.name for p in paths if p not in within)
            self._log_first(f"tune: {steps_left} steps left, {needed} needed for all "
                            f"{len(paths)} paths: timing {len(within)}, leaving out {left_out}"
                            " (not cached)")
            self.tune_cache = None
        return within

    def _two_lanes(self, overlap_plan: bool) -> bool:
        """Whether a plan runs on two lanes (a comm stream or thread beside compute): an
        overlap plan, or any plan of MoE layers in waves (--moe-a2a-waves: a wave's
        all-to-all runs beside another wave's experts inside one microbatch, the sequential
        schedule's too)."""
        o = self.cfg.overlap
        return ((overlap_plan and bool(o.overlap_moe_expert_parallel_comm))
                or o.moe_a2a_waves > 1)

    def drop_graphs(self) -> int:
        """Run on without CUDA graphs from the next step (a capture the run cannot hold): every
        bank released, each path made again without graphs (`ExecutionPath.without_graphs`).
        -> pool bytes freed."""
        freed = sum(bank.pool_bytes for bank in self.graph_banks.banks.values()
                    if bank.captured)
        self.graph_banks.release()
        self.graph_banks = None
        self.paths = {name: path.without_graphs() for name, path in self.paths.items()}
        self.path = self.paths[self.path.name]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def _paths_that_fit(self, paths: list[TunePath]) -> list[TunePath]:
        """`paths` without the paired-ends plan where its memory estimate (one microbatch's
        activations more) does not fit on some rank (agreed over every rank) and the flags
        did not ask for it (then `check_memory` already passed it)."""
        cfg = self.cfg
        if cfg.plan_name == PAIRED_ENDS or not any(p.plan == PAIRED_ENDS for p in paths):
            return paths
        trial = dataclasses.replace(cfg, overlap=dataclasses.replace(
            cfg.overlap, overlap_plan=PAIRED_ENDS))
        needs = estimate_memory(trial, self.groups.world_size,
                                paired=self.wgrad_queue.pair_microbatches).total
        budget, where = available_memory(self.device.type, self.groups.local_rank,
                                         int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        fits = torch.tensor([float(budget is None or needs <= budget)], device=self.device)
        self.groups.world.all_reduce(fits, op=dist.ReduceOp.MIN)
        if host_list(fits)[0] == 1.0:
            return paths
        self._log_first(f"tune: {PAIRED_ENDS} left out: its memory estimate, "
                        f"{needs / 2**30:.1f} GiB per rank, does not fit on every rank "
                        f"({where})")
        return [path for path in paths if path.plan != PAIRED_ENDS]

    def _log_first(self, line: str) -> None:
        if self.groups.is_first():
            self.log(line)

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        if self.graph_banks is not None:  # before any process group is destroyed
            self.graph_banks.release()
        for lanes in {id(b.lanes): b.lanes for b in self.paths.values()}.values():
            if lanes is not self.lanes:
                lanes.close()
        self.lanes.close()
        self.grads.close()
        self.comm.close()


def loss_scale(cfg: RunConfig) -> float:
    """What each microbatch's loss is scaled by: the step's loss is their mean."""
    return 1.0 / cfg.train.num_microbatches


def router_generators(model: MoEModel) -> list[torch.Generator]:
    """The routers' force-balancing generators (a rerun or an evaluation restores them)."""
    return [r.balancing_rng for r in model.routers() if r.balancing_rng is not None]


_COPY_TRANSPORTS = {"host_memory": open_host_transport, "peer_memory": open_peer_transport}


def _copy_transport(cfg: RunConfig, groups: ParallelGroups) -> Optional[CopyEngineTransport]:
    """The all-to-all on copy engines, through shared host memory or peer memory
    (--moe-a2a-transport host_memory, peer_memory), made collectively over the EP group; None
    on the process group's own all-to-all."""
    p = cfg.parallel
    if p.moe_a2a_transport not in _COPY_TRANSPORTS or groups.ep_size == 1:
        return None
    return _COPY_TRANSPORTS[p.moe_a2a_transport](
        groups.ep, groups.ep_rank, p.moe_a2a_host_slot_kib * 1024, groups.device,
        groups.watch.timing.timeout_s)


def _host_comms(cfg: RunConfig, groups: ParallelGroups) -> Optional[HostComms]:
    """The hierarchical dispatch's communicators (--moe-dispatch-hierarchy node), their groups
    made here unless the process groups came with them."""
    if not DispatchMode.of(cfg.moe).by_host:
        return None
    if groups.ep_rail is None:
        add_host_groups(groups, ranks_per_host(groups.world_size, cfg.parallel.emulate_hosts),
                        datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    mode = cfg.overlap.comm_mode  # local_copy: each stage's all-to-alls local copies too
    return HostComms(ExpertComm(groups.ep_rail, groups.ep_rail.size, mode),
                     ExpertComm(groups.ep_host, groups.ep_host.size, mode), groups.ep_rank)


def _context_comm(cfg: RunConfig, groups: ParallelGroups) -> Optional[ContextComm]:
    """The CP group's communicator (None without CP); under --dynamic-context-parallel with
    those of the smaller sizes, their groups made here (`model.context`)."""
    if groups.cp is None:
        return None
    p, sizes = cfg.parallel, {}
    if p.dynamic_context_parallel:
        smaller = dynamic_sizes(groups.cp_size, p.min_dynamic_context_parallel_size)[:-1]
        made = context_groups(groups, smaller,
                              datetime.timedelta(minutes=p.distributed_timeout_minutes))
        sizes = {size: ContextComm(group) for size, group in made.items()}
    return ContextComm(groups.cp, groups.cp_exchange, sizes)
