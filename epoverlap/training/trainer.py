"""One training run: `Trainer` builds the model, grad buffers, optimizer, executor and plan
from a validated config and runs optimizer steps.

One step: the executor runs this rank's plan (sequential, or the combined 1F1B with
--overlap-moe-expert-parallel-comm; with pipeline stages, this stage's 1F1B or interleaved
1F1B plan, every stage's plan built and checked together at start) over all microbatches;
then, only after the last backward and weight-grad action, grads are reduced (inside the
stage), clipped by the whole model's norm, the expert biases updated from the all-reduced token
counts, and the optimizer steps. Rank 0 prints one line per step (ending
with the time left at the mean step time so far), with --log-json writes one JSON record per
step (the loss and grad norm also as float.hex, for bitwise comparison with
`epoverlap-compare-losses`),
and with --tensorboard-dir the same scalars as TensorBoard events (`training.tensorboard`).
Steps with recorded spans (--profile-steps) also report the first rank's comm, exposed comm
and overlap ratio (`profiling.overlap`).

MoE dispatch modes (`epoverlap.config.dispatch.DispatchMode`): with a capacity, every step reports
the routed (token, expert) pairs dropped over all ranks and MoE layers; with the budget
dispatch, after each forward-backward the most rows any dispatch wanted to send to one rank is
all-reduced (one host read per step, after the step) and, if it overflowed the budget's chunk,
the step's forward-backward is rerun from the same inputs, weights and router RNG state at the
smallest budget level that holds it (`forward_backward`); the reruns and the budget the step's
result came from are reported.

With --check-for-nan-in-loss-and-grad the local losses and grads are checked before the
reduction (`numerics`).

Checkpoints (`checkpoint`): a run built with `resume` continues after the checkpoint's step,
saves when --save-interval says so and after the last step; its --log-json keeps the records
up to the checkpoint's step and appends (records of the interrupted run after it are dropped).
One summary line ends the run (`RunSummary`). Rates are per GPU on CUDA and per rank on CPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from epoverlap.kernels import make_moe_ops

from epoverlap.config import RunConfig
from epoverlap.graphs.banks import GraphBanks, StepGraphs
from epoverlap.graphs.capture import (CudaGraphBackend, GraphRunner, graphed_modules,
                                      graphs_span_moe_layer)
from epoverlap.graphs.full_iteration import FullIterationGraph
from epoverlap.config.dispatch import DispatchMode
from epoverlap.model.transformer import (MoEModel, count_parameters, model_dtype,
                                         training_flops_per_token)
from epoverlap.parallel.comm import ExpertComm, PipelineComm
from epoverlap.parallel.groups import ParallelGroups
from epoverlap.parallel.watch import host_list
from epoverlap.profiling.overlap import step_metrics
from epoverlap.profiling.recorder import SpanRecorder
from epoverlap.schedule.executor import Executor, make_lanes
from epoverlap.schedule.pipeline import pipeline_plans, validate_pipeline
from epoverlap.schedule.plan import stage_layout
from epoverlap.schedule.wgrad import WeightGradQueue
from epoverlap.training.checkpoint import Checkpointer
from epoverlap.training.checkpoint_files import CheckpointRef
from epoverlap.training.compile_watch import CompileWatch
from epoverlap.training.data import open_data_source, step_batches
from epoverlap.training.faults import FaultInjector
from epoverlap.training.grads import GradBuffers
from epoverlap.training.numerics import check_finite
from epoverlap.training.optim import MixedPrecisionAdamW, lr_at
from epoverlap.training.probe import SEQUENTIAL, OverlapProbe
from epoverlap.training.tensorboard import TensorBoardLog


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    aux_loss: float
    load_imbalance: float
    step_time_s: float
    tokens: int
    peak_mem_gib: Optional[float]
    tflops_per_gpu: float
    dropped_tokens: Optional[int] = None  # capacity: routed pairs over capacity, all ranks/layers
    dropped_fraction: Optional[float] = None  # of all routed (token, expert) pairs
    dispatch_reruns: Optional[int] = None  # budget: reruns after an overflow
    dispatch_budget: Optional[float] = None  # budget: the budget the step's result came from
    deterministic: bool = False  # --deterministic-mode: bitwise comparisons with another run hold
    triton_variants: Optional[int] = None  # compiled Triton kernel variants so far (this rank)
    peak_reserved_gib: Optional[float] = None  # the caching allocator's peak (graph pools too)
    comm_ms: Optional[float] = None  # these three: steps with recorded spans only
    exposed_comm_ms: Optional[float] = None
    overlap_ratio: Optional[float] = None
    schedule: Optional[str] = None  # --overlap-probe-steps: the schedule this step ran

    def to_json(self) -> dict:
        record = {k: v for k, v in self.__dict__.items()
                  if v is not None or k == "peak_mem_gib"}
        record["loss_hex"] = float.hex(self.loss)
        record["grad_norm_hex"] = float.hex(self.grad_norm)
        record["tokens_per_s"] = self.tokens / self.step_time_s
        return record


IMBALANCE_WARN_LIMIT = 4.0  # max/mean tokens per expert of the worst MoE layer
IMBALANCE_WARN_STEPS = 20


def _warn_every_rank(message: str) -> None:
    print(f"epoverlap-train: warning: {message}", file=sys.stderr, flush=True)


def format_duration(seconds: float) -> str:
    """3725.2 -> '1h02m05s', 65 -> '1m05s', 7.46 -> '7.5s'."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _dispatch_note(r: StepResult) -> str:
    """' | dropped 12 (0.40%)' with a capacity; ' | reruns 1 (budget 2)' with a budget."""
    note = ""
    if r.dropped_tokens is not None:
        note += f" | dropped {r.dropped_tokens} ({100 * r.dropped_fraction:.2f}%)"
    if r.dispatch_reruns is not None:
        note += f" | reruns {r.dispatch_reruns} (budget {r.dispatch_budget:g})"
    return note


def _record_step(line: str) -> float:
    """The step of a --log-json line; infinity for a line cut off mid-write."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


@dataclass
class RunSummary:
    """The end-of-run line: steps, throughput, first and last loss, peak memory, the exposed
    communication of the profiled steps (when --profile-steps was given) and what the MoE
    dispatch did over the run (with a capacity: the routed pairs dropped; with a budget: the
    reruns and the steps that needed one)."""

    steps: int
    seconds: float
    tokens: int
    first_loss: float
    last_loss: float
    peak_mem_gib: float
    on_gpu: bool
    exposed_comm_ms: Optional[float] = None
    profiled: Optional[str] = None
    dropped_tokens: Optional[int] = None  # routed pairs over capacity, all steps
    dropped_fraction: Optional[float] = None  # of all routed pairs of the run
    dispatch_reruns: Optional[int] = None  # budget reruns, all steps
    rerun_steps: Optional[int] = None  # steps rerun at least once

    def line(self, per_device: str) -> str:
        memory = ("allocated" if self.on_gpu else "RSS") + ", max over ranks"
        text = (f"done: {self.steps} steps in {self.seconds:.1f} s | "
                f"{self.tokens / self.seconds:,.0f} tok/s | loss {self.first_loss:.4f} -> "
                f"{self.last_loss:.4f} | peak mem {self.peak_mem_gib:.2f} GiB{per_device} "
                f"({memory})")
        if self.exposed_comm_ms is not None:
            text += (f" | exposed comm {self.exposed_comm_ms:.2f} ms/step (profiled steps "
                     f"{self.profiled}, max over ranks)")
        if self.dropped_tokens is not None:
            text += f" | dropped {self.dropped_tokens} ({100 * self.dropped_fraction:.2f}%)"
        if self.dispatch_reruns is not None:
            text += f" | reruns {self.dispatch_reruns} (in {self.rerun_steps} steps)"
        return text

    def add_dispatch_stats(self, results: list["StepResult"]) -> None:
        """Totals of the steps' dispatch figures (each step's are already over all ranks)."""
        if results[0].dropped_tokens is not None:
            self.dropped_tokens = sum(r.dropped_tokens for r in results)
            self.dropped_fraction = sum(r.dropped_fraction for r in results) / len(results)
        if results[0].dispatch_reruns is not None:
            self.dispatch_reruns = sum(r.dispatch_reruns for r in results)
            self.rerun_steps = sum(1 for r in results if r.dispatch_reruns)


class Trainer:
    """Everything one training run needs, built once from a validated config."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups,
                 log: Callable[[str], None] = print, data=None,
                 resume: Optional[CheckpointRef] = None,
                 graph_backend=CudaGraphBackend):
        """`data`: a source from `open_data_source` (opened here when None); the model's
        vocabulary is the source's. `graph_backend`: what captures CUDA graphs (the CPU tests
        pass an emulation)."""
        self.graph_backend = graph_backend
        cfg = cfg.for_world(groups.world_size)
        self.data = data if data is not None else open_data_source(cfg, groups.dp_size)
        cfg = cfg.with_vocab_size(self.data.vocab_size)
        self.cfg, self.groups, self.log = cfg, groups, log
        self.device = groups.device
        backend = cfg.resolved_kernel_backend(self.device.type)
        self.comm = ExpertComm(groups.ep, groups.ep_size, cfg.overlap.comm_mode,
                               counts_group=groups.ep_splits)
        self.wgrad_queue = WeightGradQueue(enabled=cfg.overlap.delay_wgrad_compute)
        self.model = MoEModel(cfg, self.comm, groups.ep_rank, make_moe_ops(backend),
                              dtype=model_dtype(cfg), device=self.device,
                              wgrad_queue=self.wgrad_queue, stage=groups.pp_rank,
                              pipe=self._pipeline_comm(cfg, groups),
                              one_node_moe_layers=self._one_node_moe_layers())
        self.params = self._whole_model_parameters()
        self.grads = GradBuffers(self.model, groups, fuse_grad_accumulation=not
                                 cfg.train.no_gradient_accumulation_fusion)
        self.optimizer = MixedPrecisionAdamW(self.model, cfg.train)
        overlap = cfg.overlap.overlap_moe_expert_parallel_comm
        self.lanes = make_lanes(self.device, overlap, cfg.overlap.comm_stream_high_priority)
        self.recorder = SpanRecorder(self.device, groups.rank, groups.world_size)
        self.faults = FaultInjector(groups.rank)
        self.graphs = self._step_graphs()
        per_layer = self.graphs is not None and not self.graphs.full_iteration
        self.executor = Executor(self.faults.wrap_specs(self.model.node_specs()), self.lanes,
                                 self.wgrad_queue, self.recorder,
                                 **({"run_factory": self.graphs.banks} if per_layer else {}))
        self.stage_layouts, self.stage_plans = self._build_plans()
        self.plan = self.stage_plans[groups.pp_rank]
        if self.graphs is not None:  # the base budget's bank (banks are made lazily)
            self.graphs.banks.select(self.graphs.key(0))
        self.backend = backend
        self.dispatch_mode = DispatchMode.of(cfg.moe)
        self.budget = self.model.dispatch_budget
        self.compile_watch = CompileWatch(cfg.cuda_graph.warmup_steps, groups.rank,
                                          warn=_warn_every_rank)
        self._imbalanced_steps = 0
        self.checkpointer = Checkpointer(cfg, groups, self.model, self.optimizer, log)
        self.start_step = self.checkpointer.resume(resume)
        self.probe, self._schedules = self._overlap_probe()
        self._probe_decision: Optional[str] = None  # the probe's line, logged after its step's

    def _pipeline_comm(self, cfg: RunConfig, groups: ParallelGroups) -> Optional[PipelineComm]:
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

    def _build_plans(self, combined: Optional[bool] = None) -> tuple[list, list]:
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

    def _overlap_probe(self) -> tuple[Optional[OverlapProbe], dict]:
        """--overlap-probe-steps: the probe, and each schedule's (plan, lanes) it switches
        between (`training.probe`; one stage, eager or per-layer graphs: config validation
        sees to both; each schedule its own graphs: per-layer or full-iteration)."""
        cfg = self.cfg
        if cfg.overlap.overlap_probe_steps == 0:
            return None, {}
        _, (sequential_plan,) = self._build_plans(combined=False)
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

    def _probe_schedule(self, step: int) -> Optional[str]:
        """Switch the plan and lanes to the schedule the probe gives this step."""
        if self.probe is None:
            return None
        name = self.probe.schedule_for(step)
        self.plan, self.executor.lanes = self._schedules[name]
        if self.graphs is not None:
            self.graphs.schedule = name  # its own bank of graphs
        return name

    def _probe_record(self, step: int, elapsed: float) -> None:
        if self.probe is None:
            return

        def slowest(medians: list[float]) -> list[float]:
            times = torch.tensor(medians, dtype=torch.float64, device=self.device)
            self.groups.world.all_reduce(times, op=dist.ReduceOp.MAX)
            return host_list(times)
        self._probe_decision = self.probe.record(step, elapsed, slowest)
        if self._probe_decision is not None and self.graphs is not None:
            loser = self.probe.losing()
            freed = self.graphs.release_schedule(loser)
            self._probe_decision += (f"; the {loser} schedule's CUDA graphs released "
                                     f"({freed / 2**30:.3f} GiB)")

    def _step_graphs(self) -> Optional[StepGraphs]:
        """CUDA graphs of this run (--cuda-graph-impl local or full_iteration), in banks by
        budget level when they hold the dispatch (see `epoverlap.graphs.banks`)."""
        graph_cfg = self.cfg.cuda_graph
        if graph_cfg.impl not in ("local", "full_iteration"):
            return None
        full = graph_cfg.impl == "full_iteration"
        generators = self._router_generators()
        holds_dispatch = full or self._one_node_moe_layers()
        watch = self._replay_watch(holds_dispatch)
        if full:
            def make_bank():
                return FullIterationGraph(self.executor, self.plan, self._loss_scale(),
                                          device=self.device, generators=generators,
                                          backend_factory=self.graph_backend,
                                          replay_watch=watch)
        else:
            def make_bank():
                return GraphRunner(self.model.node_specs(), graphed_modules(graph_cfg.modules),
                                   device=self.device, queue=self.wgrad_queue,
                                   generators=generators, check_inputs=graph_cfg.check_inputs,
                                   backend_factory=self.graph_backend, replay_watch=watch)
        budget = self.model.dispatch_budget
        per_level = budget is not None and holds_dispatch
        probed = self.cfg.overlap.overlap_probe_steps > 0  # a bank per schedule
        banks = GraphBanks(make_bank, (len(budget.levels) if per_level else 1) * (1 + probed))
        graphs = StepGraphs(banks, graph_cfg.warmup_steps, per_level, full)
        if probed:
            graphs.schedule = self.cfg.plan_name  # the probe's first schedule
        return graphs

    def _replay_watch(self, holds_dispatch: bool):
        """What wraps each graph replay: the EP group's watch when the graphs hold the
        all-to-alls (captured collectives are issued by the replays, see `watch.collective`)."""
        if not holds_dispatch or self.groups.ep_size == 1:
            return contextlib.nullcontext
        return lambda: self.groups.ep.watched("all_to_all (CUDA graph replay)")

    def _one_node_moe_layers(self) -> bool:
        graph_cfg = self.cfg.cuda_graph
        return graphs_span_moe_layer(graph_cfg.impl, graph_cfg.modules)

    def _loss_scale(self) -> float:
        return 1.0 / self.cfg.train.num_microbatches

    def _after_step(self, step: int) -> None:
        """Capture the graph banks this step recorded (the last warmup step records the base
        bank; a later rerun at a new budget level records that level's)."""
        if self.graphs is None:
            return
        captured = self.graphs.capture_due(self.plan, self._select_budget_level)
        for level, bank in captured:
            where = (f" (budget {self.budget.levels[level]:g})" if self.graphs.per_level
                     else "")
            self.log(f"CUDA graphs{where}: {bank.graph_count()} captured after step {step} "
                     f"in {bank.capture_seconds:.2f} s; graph memory "
                     f"{bank.pool_bytes / 2**30:.3f} GiB (of it static buffers "
                     f"{bank.buffer_bytes() / 2**30:.3f} GiB)")
        if captured and len(self.graphs.banks.banks) > 1:
            by = " and ".join(what for what, keyed in (
                ("budget level", self.graphs.per_level), ("schedule", self.probe is not None))
                if keyed)
            self.log(f"CUDA graph banks by {by}: {self.graphs.banks.memory_report()}")

    @property
    def per_device(self) -> str:
        """The unit of per-device rates: a GPU on CUDA, a rank (process) on CPU."""
        return "/GPU" if self.device.type == "cuda" else " per rank"

    def describe(self) -> str:
        cfg, g = self.cfg, self.groups
        total = (self.params["dense"] + self.params["expert_global"]) / 1e6
        pipeline = ""
        if g.pp_size > 1:
            virtual = f" x {cfg.virtual_stages} virtual" if cfg.virtual_stages > 1 else ""
            pipeline = f"PP {g.pp_size}{virtual} x "
        return (f"epoverlap: world {g.world_size} ({g.backend}, {self.device.type}) = "
                f"{pipeline}DP {g.dp_size} (EP {g.ep_size}{self._ep_budget_text()} x EDP "
                f"{g.edp_size}) | "
                f"{cfg.model.num_layers} layers, hidden "
                f"{cfg.model.hidden_size}, {cfg.moe.num_experts or 0} experts top-"
                f"{cfg.moe.moe_router_topk} | {total:.1f}M params | plan {cfg.plan_name}"
                f"{' + delayed wgrad' if cfg.overlap.delay_wgrad_compute else ''}"
                f"{self._probe_text()} | kernels "
                f"{self.backend} | {model_dtype(cfg)} | data: {self.data.description}")

    def _probe_text(self) -> str:
        probe = self.probe
        if probe is None:
            return ""
        primed = ("" if probe.prime_step is None else
                  f", its CUDA graphs captured at step {probe.prime_step}")
        return f" (probed against sequential, steps {probe.start}-{probe.end}{primed})"

    def _ep_budget_text(self) -> str:
        budget = self.groups.ep_budget
        return "" if budget is None or budget.is_default else f", NCCL {budget.describe()}"

    def microbatches(self, step: int) -> list[dict]:
        t, rank = self.cfg.train, self.groups.dp_rank  # every stage of a pipeline reads alike
        return [{"tokens": tokens.to(self.device), "labels": labels.to(self.device)}
                for tokens, labels in step_batches(self.data, step, rank, t.num_microbatches,
                                                   t.micro_batch_size, self.cfg.model.seq_length)]

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def run_microbatches(self, step: int, inputs: Optional[list[dict]] = None
                         ) -> list[torch.Tensor]:
        """Forward + backward of every microbatch, once, at the budget level selected (no
        rerun: see `forward_backward`); grads land in the main_grad buffers."""
        self.grads.zero()
        for router in self.model.routers():
            router.reset_step_stats()
        if self.budget is not None:
            self.budget.reset_demand()
        inputs = self.microbatches(step) if inputs is None else inputs
        if self.graphs is not None:
            return self.graphs.run(inputs, self._run_eager)
        return self._run_eager(inputs)

    def _run_eager(self, inputs: list[dict]) -> list[torch.Tensor]:
        return self.executor.run(self.plan, inputs, self._loss_scale())

    def forward_backward(self, step: int) -> tuple[list[torch.Tensor], int]:
        """`run_microbatches`, rerun while the budget dispatch overflowed (see the module
        docstring). -> (losses, reruns). A rerun starts from the same inputs, weights and
        router RNG state, so its result is the one a run at its budget level would give."""
        inputs = self.microbatches(step)
        generators = self._router_generators()
        states = [g.get_state() for g in generators]
        losses = self._attempt(step, inputs, level=0)
        reruns = 0
        while (level := self.overflow_level()) is not None:
            for generator, state in zip(generators, states):
                generator.set_state(state)
            losses = self._attempt(step, inputs, level)
            reruns += 1
        return losses, reruns

    def _attempt(self, step: int, inputs: list[dict], level: int) -> list[torch.Tensor]:
        """One forward-backward at a budget level, by that level's graph bank if it has one."""
        self._select_budget_level(level)
        if self.graphs is None:
            return self.run_microbatches(step, inputs)
        self.graphs.begin_attempt(step - self.start_step, level)  # warmup counts from here
        try:
            return self.run_microbatches(step, inputs)
        finally:
            self.graphs.end_attempt()

    def _router_generators(self) -> list[torch.Generator]:
        return [r.balancing_rng for r in self.model.routers() if r.balancing_rng is not None]

    def _select_budget_level(self, level: int) -> None:
        if self.budget is not None:
            self.budget.level = level

    def overflow_level(self) -> Optional[int]:
        """After a forward-backward: the budget level to rerun at, None if nothing overflowed.
        One all-reduce (max over ranks) and one host read."""
        budget = self.budget
        if budget is None:
            return None
        demand = budget.demand()
        if self.groups.world_size > 1:
            self.groups.world.all_reduce(demand, op=dist.ReduceOp.MAX)
        return budget.rerun_level(host_list(demand))

    def _dropped_tokens(self) -> tuple[int, float]:
        """Routed (token, expert) pairs dropped over capacity this step, all ranks and MoE
        layers, and their share of all routed pairs."""
        routers = self.model.routers()
        dropped = sum((r.step_dropped for r in routers),
                      torch.zeros((), dtype=torch.int64, device=self.device))
        if self.groups.world_size > 1:
            self.groups.world.all_reduce(dropped)
        t, m = self.cfg.train, self.cfg.model
        routed = (self.groups.world_size * t.num_microbatches * t.micro_batch_size
                  * m.seq_length * self.cfg.moe.moe_router_topk * len(routers))
        return int(dropped), int(dropped) / routed

    def _reduce_stats(self, losses: list) -> tuple[float, float, float]:
        """Mean loss and aux loss over microbatches and data-parallel ranks; max expert
        imbalance. Each stage fills the slots of its layers (the last stage the loss), sums
        them over its DP group, then the stages' slots are gathered over the pipeline."""
        t, num_layers = self.cfg.train, self.cfg.model.num_layers
        routers = self.model.routers()
        stats = torch.zeros(1 + num_layers, device=self.device)  # loss, aux of each layer
        counts = torch.zeros(num_layers, self.cfg.moe.num_experts or 0, dtype=torch.int64,
                             device=self.device)
        if any(loss is not None for loss in losses):
            stats[0] = torch.stack(losses).sum().float()
        for router in routers:
            stats[1 + router.layer] = router.step_aux_loss.float()
            counts[router.layer] = router.step_counts
        self._sum_over_stages(stats)
        self._sum_over_stages(counts)
        scale = 1.0 / (t.num_microbatches * self.groups.dp_size)
        for router in routers:
            router.update_expert_bias(counts[router.layer])
        moe_layers = [layer for layer, is_moe in enumerate(self.cfg.moe_layer_pattern())
                      if is_moe]
        reads = [stats[0], stats[1:].sum()]  # one host read for all three figures
        if moe_layers:
            moe_counts = counts[moe_layers].float()
            per_layer = moe_counts.amax(dim=1) / moe_counts.mean(dim=1).clamp(min=1e-9)
            reads.append(per_layer.max())
        loss, aux, *imbalance = host_list(torch.stack(reads))
        return loss * scale, aux * scale, imbalance[0] if imbalance else 1.0

    def _sum_over_stages(self, slots: torch.Tensor) -> None:
        """In place: sum over the stage's DP group, then over the pipeline (where every slot
        is one stage's and the others add 0, so the sum is exact)."""
        g = self.groups
        if g.dp_size > 1:
            g.dp.all_reduce(slots)
        if g.pp_size > 1:
            g.pp.all_reduce(slots)

    def step(self, step: int) -> StepResult:
        self.groups.watch.step = step
        profiled = self._profiled(step)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = self._sync_time()
        if profiled:
            self.recorder.begin_step(step)
        self.faults.begin_step(step)
        schedule = self._probe_schedule(step)
        losses, reruns = self.forward_backward(step)
        spans = self.recorder.end_step() if profiled else None
        self.faults.after_backward(self.model)
        if self.cfg.train.check_for_nan_in_loss_and_grad:
            check_finite(step, losses, self.model, self.grads, self.groups)
        self.grads.reduce()
        grad_norm = self.grads.clip(self.cfg.train.clip_grad)
        loss, aux, imbalance = self._reduce_stats(losses)
        lr = lr_at(step, self.cfg.train)
        if not self.cfg.train.skip_optimizer_step:
            self.optimizer.step(lr)
        elapsed = self._sync_time() - start
        self._probe_record(step, elapsed)
        result = self._result(step, loss, lr, grad_norm, aux, imbalance, elapsed)
        result.schedule = schedule
        self._add_dispatch_stats(result, reruns)
        if spans is not None:
            overlap = step_metrics(spans).overlap
            result.comm_ms, result.exposed_comm_ms = overlap.comm_us / 1e3, \
                overlap.exposed_comm_us / 1e3
            result.overlap_ratio = overlap.overlap_ratio
        return result

    def _result(self, step, loss, lr, grad_norm, aux, imbalance, elapsed) -> StepResult:
        t, m = self.cfg.train, self.cfg.model
        tokens = self.groups.dp_size * t.num_microbatches * t.micro_batch_size * m.seq_length
        on_gpu = self.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if on_gpu else None
        tflops = training_flops_per_token(self.cfg) * tokens / elapsed / 1e12 / \
            self.groups.world_size
        return StepResult(step, loss, lr, grad_norm, aux, imbalance, elapsed, tokens, peak,
                          tflops, deterministic=self.cfg.train.deterministic_mode,
                          # graph pools are reserved, not allocated, while graphs replay
                          peak_reserved_gib=(torch.cuda.max_memory_reserved(self.device) / 2**30
                                             if on_gpu else None))

    def _add_dispatch_stats(self, result: StepResult, reruns: int) -> None:
        if self.dispatch_mode.drops_tokens:
            result.dropped_tokens, result.dropped_fraction = self._dropped_tokens()
        if self.budget is not None:
            result.dispatch_reruns, result.dispatch_budget = reruns, self.budget.factor

    def _profiled(self, step: int) -> bool:
        window = self.cfg.log.profile_range
        return window is not None and window[0] <= step <= window[1]

    def train(self) -> list[StepResult]:
        cfg, results = self.cfg, []
        if self.start_step >= cfg.train.train_iters:
            self.log(f"checkpoint step {self.start_step} >= --train-iters="
                     f"{cfg.train.train_iters}: nothing left to train")
            return results
        json_file = self._open_json()
        tensorboard = self._open_tensorboard()
        torch_profiler = self._torch_profiler()
        try:
            for step in range(self.start_step + 1, cfg.train.train_iters + 1):
                result = self.step(step)
                self._after_step(step)
                self.compile_watch.after_step(step - self.start_step)
                result.triton_variants = self.compile_watch.total()
                results.append(result)
                if not math.isfinite(result.loss):
                    raise FloatingPointError(f"loss is {result.loss} at step {step}")
                self._report(result, json_file, tensorboard, results)
                if self.checkpointer.due(step):
                    self.checkpointer.save(step)
                if torch_profiler is not None:
                    torch_profiler.step()
        finally:
            for sink in (json_file, tensorboard):
                if sink is not None:
                    sink.close()
            if torch_profiler is not None:
                torch_profiler.stop()
        self._write_spans()
        self._report_compiles()
        if results:  # a resumed run may have had no step left to make
            self.log(self.summarize(results).line(self.per_device))
        return results

    def _report_compiles(self) -> None:
        """One line: compiled Triton kernel variants per rank, and how many came after warmup."""
        world, rank = self.groups.world_size, self.groups.rank
        counts = torch.zeros(2, world, dtype=torch.int64, device=self.device)
        counts[0, rank] = self.compile_watch.total() or 0
        counts[1, rank] = self.compile_watch.late_compiles
        if world > 1:
            self.groups.world.all_reduce(counts)
        totals, lates = host_list(counts)
        late = sum(lates)
        if self.compile_watch.total() is None and not any(totals):
            return
        self.log(f"Triton kernel variants compiled per rank: {totals}; after the "
                 f"{self.compile_watch.warmup_steps} warmup steps: {late}")

    def _open_tensorboard(self) -> Optional[TensorBoardLog]:
        directory = self.cfg.log.tensorboard_dir
        if directory is None or not self.groups.is_first():
            return None
        return TensorBoardLog(directory)

    def summarize(self, results: list[StepResult]) -> "RunSummary":
        """The run's figures; peak memory and exposed comm are the max over ranks (a
        collective: every rank calls it)."""
        if self.device.type == "cuda":
            peak = max((r.peak_mem_gib for r in results), default=0.0)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        exposed = self.recorder.mean_exposed_comm_ms()
        figures = torch.tensor([peak, -1.0 if exposed is None else exposed],
                               dtype=torch.float64, device=self.device)
        if self.groups.world_size > 1:
            self.groups.world.all_reduce(figures, op=dist.ReduceOp.MAX)
        peak, exposed = host_list(figures)
        summary = RunSummary(
            steps=len(results), seconds=sum(r.step_time_s for r in results),
            tokens=sum(r.tokens for r in results), first_loss=results[0].loss,
            last_loss=results[-1].loss, peak_mem_gib=peak, on_gpu=self.device.type == "cuda",
            exposed_comm_ms=None if exposed < 0 else exposed,
            profiled=self.cfg.log.profile_steps)
        summary.add_dispatch_stats(results)
        return summary

    def _open_json(self):
        path = self.cfg.log.log_json
        if path is None or not self.groups.is_first():
            return None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if self.start_step == 0 or not Path(path).exists():
            return open(path, "w")
        kept = [line for line in Path(path).read_text().splitlines(keepends=True)
                if _record_step(line) <= self.start_step]
        Path(path).write_text("".join(kept))
        return open(path, "a")

    def _report(self, r: StepResult, json_file, tensorboard, results: list[StepResult]) -> None:
        record = r.to_json()
        if json_file is not None:
            json_file.write(json.dumps(record) + "\n")
            json_file.flush()
        self._watch_imbalance(r)

        if tensorboard is not None:
            tensorboard.write(record)
        total = self.cfg.train.train_iters
        if self.groups.is_first() and (r.step % self.cfg.log.log_interval == 0
                                       or r.step == total):
            mem = f" | mem {r.peak_mem_gib:.2f} GiB" if r.peak_mem_gib is not None else ""
            comm = (f" | exposed comm {r.exposed_comm_ms:.2f} of {r.comm_ms:.2f} ms"
                    if r.exposed_comm_ms is not None else "") + _dispatch_note(r)
            if self.probe is not None and self.probe.in_window(r.step):
                comm += f" | probe: {r.schedule}"
            elif self.probe is not None and r.step == self.probe.prime_step:
                comm += f" | probe: {r.schedule} (untimed: its CUDA graphs are captured)"
            self.log(f"step {r.step:4d}/{total} | loss {r.loss:.4f} | "
                     f"lr {r.lr:.2e} | grad norm {r.grad_norm:.3f} | aux {r.aux_loss:.4f} | "
                     f"imbalance {r.load_imbalance:.2f} | {r.tokens / r.step_time_s:,.0f} tok/s"
                     f" | {r.step_time_s * 1e3:.1f} ms | {r.tflops_per_gpu:.3g} TFLOP/s"
                     f"{self.per_device}{mem}{comm}{self._eta(results)}")
        if self._probe_decision is not None:  # every rank decided alike; rank 0 says it
            if self.groups.is_first():
                self.log(self._probe_decision)
            self._probe_decision = None

    def _eta(self, results: list[StepResult]) -> str:
        """' | ETA 1m05s': steps left times the mean step time so far (first step left out
        once there are others: it carries one-time setup)."""
        left = self.cfg.train.train_iters - len(results)
        if left <= 0:
            return ""
        timed = results[1:] or results
        return f" | ETA {format_duration(left * sum(r.step_time_s for r in timed) / len(timed))}"

    def _watch_imbalance(self, r: StepResult) -> None:
        """One warning when the worst layer's load imbalance stays above the limit for a while:
        the router has collapsed onto a few experts (and the EP ranks wait on one)."""
        limit, window = IMBALANCE_WARN_LIMIT, IMBALANCE_WARN_STEPS
        self._imbalanced_steps = self._imbalanced_steps + 1 if r.load_imbalance > limit else 0
        if self._imbalanced_steps == window and self.groups.is_first():
            _warn_every_rank(f"load imbalance above {limit:g} for {window} steps (now "
                             f"{r.load_imbalance:.2f} at step {r.step}): the router sends most "
                             f"tokens to a few experts; raise --moe-aux-loss-coeff or use "
                             f"--moe-router-enable-expert-bias")

    def _torch_profiler(self):
        window, log = self.cfg.log.profile_range, self.cfg.log
        if window is None or not log.use_pytorch_profiler or window[1] <= self.start_step:
            return None
        first = max(window[0], self.start_step + 1)  # a resumed run starts after start_step
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        out = Path(log.profile_dir) / f"torch-trace-rank{self.groups.rank:05d}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=first - self.start_step - 1, warmup=0,
                                             active=window[1] - first + 1, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(str(out)))
        profiler.start()
        return profiler

    def _write_spans(self) -> None:
        if self.cfg.log.profile_dir and self.recorder.steps:
            path = self.recorder.write(self.cfg.log.profile_dir)
            if self.groups.is_first():
                self.log(f"spans written to {Path(path).parent} "
                         f"(view: epoverlap-timeline {self.cfg.log.profile_dir})")

    def close(self) -> None:
        if self.graphs is not None:  # before any process group is destroyed
            self.graphs.release()
        for _, lanes in self._schedules.values():
            if lanes is not self.lanes:
                lanes.close()
        self.lanes.close()
        self.grads.close()
