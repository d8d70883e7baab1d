"""Building a training run: every piece one run needs, made once from a validated config.

Owns `RunParts`: the data source (opened here unless given; the model's vocabulary is the
source's), the EP communicator, the model (or this pipeline stage of it, with its dispatch
strategy built once, `model.dispatch`), fp32 grad buffers, optimizer, lanes, span recorder,
fault injector, CUDA graph banks (--cuda-graph-impl local or full_iteration; by budget level
when they hold the dispatch, `graphs.banks`), the executor, every pipeline stage's plan (built
and checked together before the first step: `validate_pipeline`), the Triton compile watch,
the checkpointer and the step a resumed run continues after, and the overlap probe with the
(plan, lanes) of each schedule it switches between (`training.probe`). `close` releases what
holds device memory or streams.

The construction order is part of the run's contract: the collectives made while building
(parameter counts and layouts over the pipeline, the checkpoint's load) run in the same order on
every rank. What runs a step is `training.step`; what reports it, `training.metrics`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from epoverlap.config import RunConfig
from epoverlap.graphs.banks import GraphBanks, StepGraphs
from epoverlap.graphs.capture import (CudaGraphBackend, GraphRunner, graphed_modules,
                                      graphs_span_moe_layer)
from epoverlap.graphs.full_iteration import FullIterationGraph
from epoverlap.kernels import make_moe_ops
from epoverlap.model.budget import DispatchBudget
from epoverlap.model.transformer import MoEModel, count_parameters, model_dtype
from epoverlap.parallel.comm import ExpertComm, PipelineComm
from epoverlap.parallel.groups import ParallelGroups
from epoverlap.parallel.watch import host_list
from epoverlap.profiling.recorder import SpanRecorder
from epoverlap.schedule.executor import Executor, make_lanes
from epoverlap.schedule.pipeline import pipeline_plans, validate_pipeline
from epoverlap.schedule.plan import stage_layout
from epoverlap.schedule.wgrad import WeightGradQueue
from epoverlap.training.checkpoint import Checkpointer
from epoverlap.training.checkpoint_files import CheckpointRef
from epoverlap.training.compile_watch import CompileWatch
from epoverlap.training.console import warn_every_rank
from epoverlap.training.data import open_data_source
from epoverlap.training.faults import FaultInjector
from epoverlap.training.grads import GradBuffers
from epoverlap.training.optim import MixedPrecisionAdamW
from epoverlap.training.probe import SEQUENTIAL, OverlapProbe
from epoverlap.training.stop import StopRequest


class RunParts:
    """The built pieces of one run (see the module docstring). `plan` and `executor.lanes`
    are the schedule in use (the probe switches them); `optimizer` and `lanes` may be replaced
    by a caller (a benchmark's own optimizer forms, serial lanes) before the first step."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups,
                 log: Callable[[str], None] = print, data=None,
                 resume: Optional[CheckpointRef] = None, graph_backend=CudaGraphBackend):
        self.graph_backend = graph_backend
        cfg = cfg.for_world(groups.world_size)
        self.data = data if data is not None else open_data_source(cfg, groups.dp_size)
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
        self.probe, self.schedules = self._overlap_probe()
        self.stop: Optional[StopRequest] = None  # while the training loop runs (Trainer.train)

    # ----------------------------------------------------------------- model and state
    def _build_model(self) -> None:
        """Communicator, model, its parameter counts, grad buffers, optimizer."""
        cfg, groups = self.cfg, self.groups
        self.comm = ExpertComm(groups.ep, groups.ep_size, cfg.overlap.comm_mode,
                               counts_group=groups.ep_splits)
        self.wgrad_queue = WeightGradQueue(enabled=cfg.overlap.delay_wgrad_compute)
        self.model = MoEModel(cfg, self.comm, groups.ep_rank, make_moe_ops(self.backend),
                              dtype=model_dtype(cfg), device=self.device,
                              wgrad_queue=self.wgrad_queue, stage=groups.pp_rank,
                              pipe=self._pipeline_comm(),
                              one_node_moe_layers=self.one_node_moe_layers)
        self.params = self._whole_model_parameters()
        self.grads = GradBuffers(self.model, groups, fuse_grad_accumulation=not
                                 cfg.train.no_gradient_accumulation_fusion)
        self.optimizer = MixedPrecisionAdamW(self.model, cfg.train)

    def _pipeline_comm(self) -> Optional[PipelineComm]:
        cfg, groups = self.cfg, self.groups
        if groups.pp_size == 1:
            return None
        tokens = cfg.train.micro_batch_size * cfg.model.seq_length
        return PipelineComm(groups.pp, (tokens, cfg.model.hidden_size), model_dtype(cfg),
                            self.device)

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
        overlap = cfg.overlap.overlap_moe_expert_parallel_comm
        self.lanes = make_lanes(self.device, overlap, cfg.overlap.comm_stream_high_priority)
        self.recorder = SpanRecorder(self.device, self.groups.rank, self.groups.world_size)
        self.faults = FaultInjector(self.groups.rank)
        self.graphs = self._step_graphs()
        per_layer = self.graphs is not None and not self.graphs.full_iteration
        self.executor = Executor(self.faults.wrap_specs(self.model.node_specs()), self.lanes,
                                 self.wgrad_queue, self.recorder,
                                 **({"run_factory": self.graphs.banks} if per_layer else {}))
        self.stage_layouts, self.stage_plans = self.build_plans()
        self.plan = self.stage_plans[self.groups.pp_rank]
        if self.graphs is not None:  # the base budget's bank (banks are made lazily)
            self.graphs.banks.select(self.graphs.key(0))

    def build_plans(self, combined: Optional[bool] = None) -> tuple[list, list]:
        """Every stage's layout (its nodes' kinds, gathered over the pipeline) and plan; the
        plans checked together (`validate_pipeline`) before the first step. `combined`: the
        combined 1F1B or the sequential schedule (default: as configured)."""
        cfg, g = self.cfg, self.groups
        overlap = cfg.overlap
        combined = overlap.overlap_moe_expert_parallel_comm if combined is None else combined
        mine = stage_layout([(spec.layer, spec.kind) for spec in self.model.node_specs()])
        layouts = [mine]
        if g.pp_size > 1:
            layouts = [None] * g.pp_size
            g.pp.all_gather_object(layouts, mine)
        plan_name = cfg.plan_name if combined else SEQUENTIAL
        plans = pipeline_plans(layouts, cfg.train.num_microbatches, combined=combined,
                               delay_wgrad=overlap.delay_wgrad_compute,
                               early_release=plan_name == "combined_1f1b_early_release",
                               paired_ends=plan_name == "combined_1f1b_paired_ends")
        validate_pipeline(plans, layouts, cfg.train.num_microbatches, overlap.delay_wgrad_compute)
        return layouts, plans

    def loss_scale(self) -> float:
        return 1.0 / self.cfg.train.num_microbatches

    def router_generators(self) -> list[torch.Generator]:
        return [r.balancing_rng for r in self.model.routers() if r.balancing_rng is not None]

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
        probed = self.cfg.overlap.overlap_probe_steps > 0  # a bank per schedule
        banks = GraphBanks(make_bank, (len(budget.levels) if per_level else 1) * (1 + probed))
        graphs = StepGraphs(banks, graph_cfg.warmup_steps, per_level, full)
        if probed:
            graphs.schedule = self.cfg.plan_name  # the probe's first schedule
        return graphs

    def _bank_factory(self, full: bool, watch) -> Callable[[], object]:
        """What makes one bank: a full-iteration graph of the plan in use when it is made, or
        per-layer graphs of the model's nodes."""
        graph_cfg, generators = self.cfg.cuda_graph, self.router_generators()
        if full:
            def make_bank():
                return FullIterationGraph(self.executor, self.plan, self.loss_scale(),
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

    # ----------------------------------------------------------------- the overlap probe
    def _overlap_probe(self) -> tuple[Optional[OverlapProbe], dict]:
        """--overlap-probe-steps: the probe, and each schedule's (plan, lanes) it switches
        between (`training.probe`; one stage, eager or per-layer graphs: config validation
        sees to both; each schedule its own graphs: per-layer or full-iteration)."""
        cfg = self.cfg
        if cfg.overlap.overlap_probe_steps == 0:
            return None, {}
        _, (sequential_plan,) = self.build_plans(combined=False)
        if self.graphs is None:
            probe = OverlapProbe(cfg.overlap.overlap_probe_steps, self.start_step + 1,
                                 cfg.plan_name)
        else:  # the overlap's graphs are captured after the warm-up steps, then the
            # sequential schedule's in one untimed step (`training.probe`)
            probe = OverlapProbe(cfg.overlap.overlap_probe_steps,
                                 self.start_step + cfg.cuda_graph.warmup_steps, cfg.plan_name,
                                 prime=True)
        if probe.end > cfg.train.train_iters:  # a resumed run with fewer steps left
            self.log(f"overlap probe: steps {probe.start}-{probe.end} go past --train-iters="
                     f"{cfg.train.train_iters}: the schedules alternate to the end, no decision")
        return probe, {cfg.plan_name: (self.plan, self.lanes),
                       SEQUENTIAL: (sequential_plan, make_lanes(self.device, False))}

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        if self.graphs is not None:  # before any process group is destroyed
            self.graphs.release()
        for _, lanes in self.schedules.values():
            if lanes is not self.lanes:
                lanes.close()
        self.lanes.close()
        self.grads.close()
