"""Building a training run: every piece one run needs, made once from a validated config.

Owns `RunParts`: the data source (opened here unless given; the model's vocabulary is the
source's), the EP communicator, the model (or this pipeline stage of it, with its dispatch
strategy built once, `model.dispatch`), fp32 grad buffers, optimizer, lanes, span recorder,
fault injector, CUDA graph banks (--cuda-graph-impl local or full_iteration; by budget level
when they hold the dispatch, `graphs.banks`), the executor, every pipeline stage's plan (built
and checked together before the first step: `validate_pipeline`), the Triton compile watch,
the checkpointer and the step a resumed run continues after, and the path tuner with each path
it switches between, built (`BuiltPath`: plan, lanes, weight-grad deferral; `training.tuning.tuner`,
the paths' list `config.tuning`). `close` releases what holds device memory or streams.

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
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from epoverlap.config import RunConfig, resolve_config
from epoverlap.config.aliases import deprecation_note
from epoverlap.config.dispatch import DispatchMode
from epoverlap.config.tuning import (PAIRED_ENDS, SEQUENTIAL, TunePath, candidate_paths,
                                     flags_path, may_tune, paths_within, probe_steps,
                                     steps_needed, timed_steps, tune_mode)
from epoverlap.graphs.banks import GraphBanks, StepGraphs
from epoverlap.graphs.capture import (CudaGraphBackend, GraphRunner, graphed_modules,
                                      graphs_span_moe_layer)
from epoverlap.graphs.full_iteration import FullIterationGraph
from epoverlap.kernels import make_moe_ops
from epoverlap.model.budget import DispatchBudget
from epoverlap.model.documents import Documents
from epoverlap.model.transformer import MoEModel, count_parameters, model_dtype
from epoverlap.parallel.comm import ContextComm, ExpertComm, HostComms, PipelineComm
from epoverlap.parallel.groups import ParallelGroups, add_host_groups
from epoverlap.parallel.host_memory import HostMemoryTransport, open_host_transport
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
from epoverlap.training.optimizer.grads import GradBuffers
from epoverlap.training.setup.memory import (ExpertGradPlacement, available_memory,
                                             estimate_memory, place_expert_grads)
from epoverlap.training.optimizer.optim import MixedPrecisionAdamW
from epoverlap.training.tuning.tune_cache import CacheTarget, agreed_cached_decision
from epoverlap.training.tuning.tuner import Tuner


@dataclass
class BuiltPath:
    """One path of the tuner, built: its plan (this stage's), the lanes it runs on and the
    executor of its nodes (the flags' one, or one over the nodes of its chunk count); its
    weight-grad deferral is `path.delay_wgrad`."""

    path: TunePath
    plan: list
    lanes: object
    executor: Executor


class RunParts:
    """The built pieces of one run (see the module docstring). `plan`, `executor`, its lanes and
    `wgrad_queue.enabled` are the path in use (the tuner switches them, `switch_path`); `lanes`
    may be replaced by a caller (serial lanes) before the first step. The step, the evaluator
    and the reporter are handed the pieces they use (`training.loop.trainer`)."""

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
        self._select_first_bank()

    # ----------------------------------------------------------------- model and state
    def _build_model(self) -> None:
        """Communicator, model, its parameter counts, grad buffers, optimizer."""
        cfg, groups = self.cfg, self.groups
        self.comm = ExpertComm(groups.ep, groups.ep_size, cfg.overlap.comm_mode,
                               counts_group=groups.ep_splits, by_host=_host_comms(cfg, groups),
                               transport=_host_transport(cfg, groups))
        self.expert_grads = self._place_expert_grads()
        self.wgrad_queue = WeightGradQueue(enabled=cfg.overlap.delay_wgrad_compute,
                                           **self.expert_grads.queue_options())
        self.model = MoEModel(cfg, self.comm, groups.ep_rank, make_moe_ops(self.backend),
                              dtype=model_dtype(cfg), device=self.device,
                              wgrad_queue=self.wgrad_queue, stage=groups.pp_rank,
                              pipe=self._pipeline_comm(),
                              one_node_moe_layers=self.one_node_moe_layers,
                              data_rank=groups.dp_rank,
                              cp_comm=(ContextComm(groups.cp, groups.cp_exchange)
                                       if groups.cp is not None else None),
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
        return Documents(self.data.eod, d.reset_position_ids, d.reset_attention_mask)

    def _pipeline_comm(self) -> Optional[PipelineComm]:
        cfg, groups = self.cfg, self.groups
        if groups.pp_size == 1:
            return None
        return PipelineComm(groups.pp, (cfg.microbatch_tokens, cfg.model.hidden_size),
                            model_dtype(cfg), self.device)

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
        """Lanes, recorder, faults, graphs, executor, every stage's plan."""
        cfg = self.cfg
        self.lanes = make_lanes(self.device, self._two_lanes(True),
                                cfg.overlap.comm_stream_high_priority)
        hold_us = cfg.overlap.local_copy_hold_us
        self.comm_hold = CommHold(hold_us, self.device) if hold_us else None
        self.recorder = SpanRecorder(self.device, self.groups.rank, self.groups.world_size,
                                     local_copy_hold_us=hold_us)
        self.faults = FaultInjector(self.groups.rank)
        self.graphs = self._step_graphs()
        self.executor = self._executor()
        self.stage_layouts, self.stage_plans = self.build_plans()
        self.plan = self.stage_plans[self.groups.pp_rank]

    def _executor(self, a2a_chunks: Optional[int] = None) -> Executor:
        """An executor over the model's nodes (MoE layers in `a2a_chunks` chunks; default:
        the flags'), on the run's lanes, queue, recorder and per-layer graphs; with
        --overlap-grad-reduce it reduces the grad buckets beside the backward."""
        per_layer = self.graphs is not None and not self.graphs.full_iteration
        beside = self.cfg.overlap.overlap_grad_reduce and self.groups.dp_size > 1
        return Executor(self.faults.wrap_specs(self.model.node_specs(a2a_chunks)), self.lanes,
                        self.wgrad_queue, self.recorder,
                        **({"run_factory": self.graphs.banks} if per_layer else {}),
                        grad_reduce=self.grads if beside else None, hold=self.comm_hold)

    def _select_first_bank(self) -> None:
        """The base budget's bank of the first path (banks are made lazily, a full-iteration
        one for the plan in use when it is made)."""
        if self.graphs is not None:
            self.graphs.banks.select(self.graphs.key(0))

    def build_plans(self, path: Optional[TunePath] = None) -> tuple[list, list]:
        """Every stage's layout (its nodes' kinds, gathered over the pipeline) and plan; the
        plans checked together (`validate_pipeline`) before the first step. `path`: a tuner's
        path (its plan and weight-grad deferral; default: the flags')."""
        cfg, g = self.cfg, self.groups
        path = path or flags_path(cfg)
        mine = stage_layout([(spec.layer, spec.kind)
                             for spec in self.model.node_specs(path.chunks)])
        layouts = [mine]
        if g.pp_size > 1:
            layouts = [None] * g.pp_size
            g.pp.all_gather_object(layouts, mine)
        plans = named_plans(path.plan, layouts, cfg.train.num_microbatches, path.delay_wgrad)
        validate_pipeline(plans, layouts, cfg.train.num_microbatches, path.delay_wgrad)
        return layouts, plans

    # ----------------------------------------------------------------- CUDA graphs
    def _step_graphs(self) -> Optional[StepGraphs]:
        """CUDA graphs of this run (--cuda-graph-impl local or full_iteration), in banks by
        budget level when they hold the dispatch (see `epoverlap.graphs.banks`)."""
        graph_cfg = self.cfg.cuda_graph
        if graph_cfg.impl not in ("local", "full_iteration"):
            return None
        full = graph_cfg.impl == "full_iteration"
        holds_dispatch = full or self.one_node_moe_layers
        make_bank = self._bank_factory(full, self._replay_watch(holds_dispatch))
        budget = self.model.dispatch_budget
        per_level = budget is not None and holds_dispatch
        # a bank per path the tuner may switch to (`_tuner` keys them by path)
        paths = len(candidate_paths(self.cfg)) if tune_mode(self.cfg) != "off" else 1
        banks = GraphBanks(make_bank, (budget.max_levels if per_level else 1) * paths)
        return StepGraphs(banks, graph_cfg.warmup_steps, per_level, full)

    def _bank_factory(self, full: bool, watch) -> Callable[[], object]:
        """What makes one bank: a full-iteration graph of the plan in use when it is made, or
        per-layer graphs of the model's nodes."""
        graph_cfg, generators = self.cfg.cuda_graph, router_generators(self.model)
        if full:
            def make_bank():
                return FullIterationGraph(self.executor, self.plan, loss_scale(self.cfg),
                                          device=self.device, generators=generators,
                                          backend_factory=self.graph_backend,
                                          replay_watch=watch)
        else:
            def make_bank():
                return GraphRunner(self.model.node_specs(), graphed_modules(graph_cfg.modules),
                                   device=self.device, queue=self.wgrad_queue,
                                   generators=generators, check_inputs=graph_cfg.check_inputs,
                                   backend_factory=self.graph_backend, replay_watch=watch)
        return make_bank

    def _replay_watch(self, holds_dispatch: bool):
        """What wraps each graph replay: the EP group's watch when the graphs hold the
        all-to-alls (captured collectives are issued by the replays, see `watch.collective`)."""
        if not holds_dispatch or self.groups.ep_size == 1:
            return contextlib.nullcontext
        return lambda: self.groups.ep.watched("all_to_all (CUDA graph replay)")

    # ----------------------------------------------------------------- the path tuner
    def _tuner(self) -> tuple[Optional[Tuner], dict[str, BuiltPath]]:
        """--tune: the tuner, and each path it switches between, built (`training.tuning.tuner`;
        one stage, eager or graphs each path replays its own of: config validation, and
        `config.tuning.may_tune` for auto, see to it). A decision from --tune-cache builds only
        the path it names."""
        cfg, probed = self.cfg, probe_steps(self.cfg)
        if probed and self.groups.is_first():
            warn_every_rank(deprecation_note(f"--overlap-probe-steps {probed}",
                                             f"--tune on --tune-steps {probed}")
                            + " (two paths: the overlap plan and sequential)")
        if not may_tune(cfg, self.device.type):
            return None, {}
        paths = self._paths_that_fit(candidate_paths(cfg))
        names = [path.name for path in paths]
        cached, self.tune_cache = agreed_cached_decision(self, names)
        if cached is None:
            paths = self._paths_within(paths)
            names = [path.name for path in paths]
            if not paths:
                return None, {}
        serial = self.lanes if self._two_lanes(False) else make_lanes(self.device, False)
        built = {path.name: self._built_path(path, serial if path.plan == SEQUENTIAL
                                             else self.lanes)
                 for path in paths if cached is None or path.name == cached.chosen}
        if serial is not self.lanes and not any(b.lanes is serial for b in built.values()):
            serial.close()
        first = self.start_step + (1 if self.graphs is None else
                                   max(cfg.cuda_graph.warmup_steps, 1))
        tuner = Tuner(names, timed_steps(cfg), first, prime=self.graphs is not None,
                      cached=cached)
        self.paths = built
        self.switch_path(tuner.schedule_for(self.start_step + 1))
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
        overlap plan, or any plan of chunked MoE layers (--moe-a2a-chunks: a chunk's
        all-to-all runs beside another chunk's experts inside one microbatch, the sequential
        schedule's too)."""
        o = self.cfg.overlap
        return ((overlap_plan and bool(o.overlap_moe_expert_parallel_comm))
                or o.moe_a2a_chunks > 1)

    def _built_path(self, path: TunePath, lanes) -> BuiltPath:
        """A path's plan and executor, over nodes of its chunk count and dispatch."""
        with self._nodes_of(path):
            return BuiltPath(path, self.build_plans(path)[1][0], lanes,
                             self._path_executor(path))

    def _path_executor(self, path: TunePath) -> Executor:
        """The flags' executor where the path runs the flags' nodes, else one of its own."""
        if path.chunks == self.cfg.overlap.moe_a2a_chunks and not path.once_per_rank:
            return self.executor
        return self._executor(path.chunks)

    @contextlib.contextmanager
    def _nodes_of(self, path: TunePath):
        """The model dispatching as `path` does (its nodes' inputs follow), then as before."""
        before = self.model.dispatcher is not None and self.model.dispatcher.once_per_rank
        self.model.use_dispatch(self._once_per_rank(path))
        try:
            yield
        finally:
            self.model.use_dispatch(before)

    def _once_per_rank(self, path: TunePath) -> bool:
        return path.once_per_rank or DispatchMode.of(self.cfg.moe).once_per_rank

    def drop_graphs(self) -> int:
        """Run on without CUDA graphs from the next step (a capture the run cannot hold): every
        bank released, each executor rebuilt without per-layer graphs. -> pool bytes freed."""
        freed = sum(bank.pool_bytes for bank in self.graphs.banks.banks.values()
                    if bank.captured)
        self.graphs.release()
        self.graphs = None
        lanes = self.executor.lanes
        with self._nodes_of(flags_path(self.cfg)):
            self.executor = self._executor()
        self.executor.lanes = lanes
        for built in self.paths.values():
            with self._nodes_of(built.path):
                built.executor = self._path_executor(built.path)
        if self.tuner is not None and self.tuner.chosen is not None:
            self.switch_path(self.tuner.chosen)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def switch_path(self, name: str) -> None:
        """Run the tuner's path `name` from here on: its plan, executor, lanes, weight-grad
        deferral, all-to-all transport and its own bank of CUDA graphs."""
        built = self.paths[name]
        self.plan, self.executor = built.plan, built.executor
        self.executor.lanes = built.lanes
        self.wgrad_queue.enabled = built.path.delay_wgrad
        self.model.use_dispatch(self._once_per_rank(built.path))
        self.comm.host_memory = built.path.host_memory and self.comm.transport is not None
        if self.graphs is not None:
            self.graphs.schedule = name

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
        if self.graphs is not None:  # before any process group is destroyed
            self.graphs.release()
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


def _host_transport(cfg: RunConfig, groups: ParallelGroups) -> Optional[HostMemoryTransport]:
    """The all-to-all through shared host memory (--moe-a2a-transport host_memory), made
    collectively over the EP group; None on the process group's own all-to-all."""
    p = cfg.parallel
    if p.moe_a2a_transport != "host_memory" or groups.ep_size == 1:
        return None
    return open_host_transport(groups.ep, groups.ep_rank, p.moe_a2a_host_slot_kib * 1024,
                               groups.device, groups.watch.timing.timeout_s)


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
