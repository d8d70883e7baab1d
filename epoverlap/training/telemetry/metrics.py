"""Reporting a training run: what a step and a run tell the user and the logs.

Owns `StepResult` (one step's figures and its --log-json record: the loss and grad norm also
as float.hex, for bitwise comparison with `epoverlap-compare-losses`), `RunSummary` (the
end-of-run line), and `Reporter`: the per-step line on rank 0 (ending with the time left: the
steps left to --train-iters times the mean step time so far, `format_duration`), the
--log-json file (a resumed run keeps the records up to its checkpoint's step and appends), the
TensorBoard events of --tensorboard-dir (`training.telemetry.tensorboard`) and the W&B run of
--wandb-project (`training.telemetry.wandb_log`; each sink of scalars takes the step's JSON record,
`write(record)`, and `close()`), the validation line and fields of a step that evaluated
(`training.loop.evaluate`), the load-imbalance warning, the path tuner's lines (its decision's
table; the `tuned_path` field of the deciding step's record), the CUDA graph capture lines, the
compiled Triton variants line, the spans and torch.profiler traces of --profile-steps, the run's
description line, the unaligned-GEMM line and the run's summary. Rates are per GPU on CUDA and per
rank on CPU. Nothing here changes what a step computes.
"""

from __future__ import annotations

import json
import math
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from epoverlap.graphs.banks import SizeBanks
from epoverlap.model.flops import GEMM_ALIGNMENT, unaligned_gemm_dims
from epoverlap.model.transformer import model_dtype
from epoverlap.parallel.watch import host_list
from epoverlap.training.telemetry.console import warn_every_rank
from epoverlap.training.telemetry.tensorboard import TensorBoardLog
from epoverlap.training.tuning.tuner import PRIME, TIMED
from epoverlap.training.telemetry.wandb_log import WandbLog

if TYPE_CHECKING:
    from epoverlap.config import RunConfig
    from epoverlap.graphs.banks import StepGraphs
    from epoverlap.model.budget import DispatchBudget
    from epoverlap.parallel.groups import ParallelGroups
    from epoverlap.profiling.recorder import SpanRecorder
    from epoverlap.training.loop.compile_watch import CompileWatch
    from epoverlap.training.tuning.tuner import Tuner


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
    dispatch_wire: Optional[float] = None  # budget: rows sent / the dropless dispatch's rows
    deterministic: bool = False  # --deterministic-mode: bitwise comparisons with another run hold
    triton_variants: Optional[int] = None  # compiled Triton kernel variants so far (this rank)
    peak_reserved_gib: Optional[float] = None  # the caching allocator's peak (graph pools too)
    comm_ms: Optional[float] = None  # these three: steps with recorded spans only
    exposed_comm_ms: Optional[float] = None
    overlap_ratio: Optional[float] = None
    path: Optional[str] = None  # --tune: the path this step ran
    tuned_path: Optional[dict] = None  # --tune: the decision, at the step that made it
    megatron_tflops_per_gpu: Optional[float] = None  # by Megatron-LM's formula (no router)
    mfu: Optional[float] = None  # Megatron-LM TFLOP/s / dense bf16 peak: bf16 on a known GPU

    def to_json(self) -> dict:
        record = {k: v for k, v in self.__dict__.items()
                  if v is not None or k == "peak_mem_gib"}
        record["loss_hex"] = float.hex(self.loss)
        record["grad_norm_hex"] = float.hex(self.grad_norm)
        record["tokens_per_s"] = self.tokens / self.step_time_s
        if self.path is not None:  # its former key, written beside it for one release
            record["schedule"] = self.path
        return record


IMBALANCE_WARN_LIMIT = 4.0  # max/mean tokens per expert of the worst MoE layer
IMBALANCE_WARN_SHARE = 0.9  # of the most a top-k router can reach: E / k
IMBALANCE_WARN_STEPS = 20


def imbalance_warn_limit(num_experts: Optional[int], topk: int) -> float:
    """The load imbalance at or above which a step counts toward the collapse warning: 4, or
    0.9 x E / k where that is lower (E / k, when k experts get every token, is the most a top-k
    router can reach: 4.00 at 8 experts top-2); no limit without experts."""
    if not num_experts:
        return math.inf
    return min(IMBALANCE_WARN_LIMIT, IMBALANCE_WARN_SHARE * num_experts / topk)


PPL_LOSS_CAP = 20.0  # Megatron-LM's: ppl = exp(min(20, loss))


@dataclass
class EvalResult:
    step: int
    loss: float  # mean over batches, microbatches and data-parallel ranks
    seconds: float
    batches: int  # global batches read
    reruns: int = 0  # budget dispatch: batches rerun after an overflow (this evaluation)

    @property
    def ppl(self) -> float:
        return math.exp(min(PPL_LOSS_CAP, self.loss))

    def line(self) -> str:
        return (f"validation at step {self.step} | loss {self.loss:.4f} | ppl {self.ppl:.2f} | "
                f"{self.seconds:.1f} s")

    def record(self) -> dict:
        """The fields the step's --log-json record (and so TensorBoard and W&B) gets."""
        return {"valid_loss": self.loss, "valid_loss_hex": float.hex(self.loss),
                "valid_ppl": self.ppl}


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
    """' | dropped 12 (0.40%)' with a capacity; ' | reruns 1 (budget 2) | a2a rows 1.250x
    exact' with a budget (the rows its fixed blocks sent other ranks over the dropless
    dispatch's)."""
    note = ""
    if r.dropped_tokens is not None:
        note += f" | dropped {r.dropped_tokens} ({100 * r.dropped_fraction:.2f}%)"
    if r.dispatch_reruns is not None:
        note += f" | reruns {r.dispatch_reruns} (budget {r.dispatch_budget:g})"
    if r.dispatch_wire is not None:
        note += f" | a2a rows {r.dispatch_wire:.3f}x exact"
    return note


def _captured_runners(bank) -> list:
    """[(what a capture line reports, its CP size or 0)]: under dynamic CP (`SizeBanks`) each
    runner captured just now, else the bank itself."""
    if not isinstance(bank, SizeBanks):
        return [(bank, 0)]
    return [(bank.runners[size], size) for size in bank.captured_now]


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
    megatron_tflops_per_gpu: Optional[float] = None  # time-weighted mean over the steps
    mfu: Optional[float] = None  # the same against the peak (training.telemetry.mfu)

    def line(self, per_device: str) -> str:
        memory = ("allocated" if self.on_gpu else "RSS") + ", max over ranks"
        text = (f"done: {self.steps} steps in {self.seconds:.1f} s | "
                f"{self.tokens / self.seconds:,.0f} tok/s | loss {self.first_loss:.4f} -> "
                f"{self.last_loss:.4f} | peak mem {self.peak_mem_gib:.2f} GiB{per_device} "
                f"({memory})")
        if self.megatron_tflops_per_gpu is not None:
            text += f" | {self.megatron_tflops_per_gpu:.3g} TFLOP/s (Megatron-LM formula)"
            if self.mfu is not None:
                text += f", MFU {100 * self.mfu:.1f}%"
        if self.exposed_comm_ms is not None:
            text += (f" | exposed comm {self.exposed_comm_ms:.2f} ms/step (profiled steps "
                     f"{self.profiled}, max over ranks)")
        if self.dropped_tokens is not None:
            text += f" | dropped {self.dropped_tokens} ({100 * self.dropped_fraction:.2f}%)"
        if self.dispatch_reruns is not None:
            text += f" | reruns {self.dispatch_reruns} (in {self.rerun_steps} steps)"
        return text

    def add_dispatch_stats(self, results: list[StepResult]) -> None:
        """Totals of the steps' dispatch figures (each step's are already over all ranks)."""
        if results[0].dropped_tokens is not None:
            self.dropped_tokens = sum(r.dropped_tokens for r in results)
            self.dropped_fraction = sum(r.dropped_fraction for r in results) / len(results)
        if results[0].dispatch_reruns is not None:
            self.dispatch_reruns = sum(r.dispatch_reruns for r in results)
            self.rerun_steps = sum(1 for r in results if r.dispatch_reruns)

    def add_flops(self, results: list[StepResult]) -> None:
        """The steps' Megatron-LM TFLOP/s and MFU, each weighted by its step's time (so the
        run's total FLOPs over its total time)."""
        seconds = sum(r.step_time_s for r in results)
        if results[0].megatron_tflops_per_gpu is not None:
            self.megatron_tflops_per_gpu = sum(r.megatron_tflops_per_gpu * r.step_time_s
                                               for r in results) / seconds
        if results[0].mfu is not None:
            self.mfu = sum(r.mfu * r.step_time_s for r in results) / seconds


class Reporter:
    """Every report of one run (see the module docstring), from the run's pieces it reads."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, log: Callable[[str], None], *,
                 data, params: dict, backend: str, recorder: SpanRecorder,
                 compile_watch: CompileWatch, budget: Optional[DispatchBudget] = None,
                 tuner: Optional[Tuner] = None, start_step: int = 0):
        """`data`: the run's source (its description); `params`: the whole model's parameter
        counts (`count_parameters`); `backend`: the kernels'; `start_step`: the step a resumed
        run continues after."""
        self.cfg, self.groups, self.device, self.log = cfg, groups, groups.device, log
        self.data, self.params, self.backend = data, params, backend
        self.recorder, self.compile_watch = recorder, compile_watch
        self.budget, self.tuner, self.start_step = budget, tuner, start_step
        self._imbalanced_steps = 0
        self._json = None
        self._sinks: list = []  # TensorBoard, W&B: each write(record), close()

    @property
    def per_device(self) -> str:
        """The unit of per-device rates: a GPU on CUDA, a rank (process) on CPU."""
        return "/GPU" if self.device.type == "cuda" else " per rank"

    # ----------------------------------------------------------------- sinks
    def open_sinks(self) -> None:
        """The --log-json file, the TensorBoard log and the W&B run (rank 0 only)."""
        self._json = self._open_json()
        self._sinks = [sink for sink in (self._open_tensorboard(), self._open_wandb())
                       if sink is not None]

    def close_sinks(self) -> None:
        """Close every sink, each even if another's close raised (the first error is
        raised after)."""
        sinks = [self._json, *self._sinks]
        self._json, self._sinks = None, []
        failure = None
        for sink in sinks:
            try:
                if sink is not None:
                    sink.close()
            except Exception as error:  # noqa: BLE001  (the others still close)
                failure = failure or error
        if failure is not None:
            raise failure

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

    def _open_tensorboard(self) -> Optional[TensorBoardLog]:
        directory = self.cfg.log.tensorboard_dir
        if directory is None or not self.groups.is_first():
            return None
        return TensorBoardLog(directory)

    def _open_wandb(self) -> Optional[WandbLog]:
        if self.cfg.log.wandb_project is None or not self.groups.is_first():
            return None
        return WandbLog(self.cfg)

    # ----------------------------------------------------------------- per step
    def step_done(self, r: StepResult, results: list[StepResult],
                  tune_lines: Sequence[str] = (), evaluation: Optional[EvalResult] = None
                  ) -> None:
        """The step's JSON record (with the validation fields of an evaluation after it),
        imbalance watch, TensorBoard and W&B scalars, line (every --log-interval steps and the
        last), the validation line, and the tuner's lines of this step (its decision's
        table, a dropped path)."""
        record = r.to_json()
        if evaluation is not None:
            record.update(evaluation.record())
        if self._json is not None:
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()
        self._watch_imbalance(r)
        for sink in self._sinks:
            sink.write(record)
        total = self.cfg.train.train_iters
        if self.groups.is_first() and (r.step % self.cfg.log.log_interval == 0 or r.step == total):
            self.log(self._step_line(r, results))
        if evaluation is not None and self.groups.is_first():
            self.log(evaluation.line())
        if self.groups.is_first():  # every rank decided alike
            for line in tune_lines:
                self.log(line)

    def _step_line(self, r: StepResult, results: list[StepResult]) -> str:
        tuner = self.tuner
        mem = f" | mem {r.peak_mem_gib:.2f} GiB" if r.peak_mem_gib is not None else ""
        mfu = f" | MFU {100 * r.mfu:.1f}%" if r.mfu is not None else ""
        comm = (f" | exposed comm {r.exposed_comm_ms:.2f} of {r.comm_ms:.2f} ms"
                if r.exposed_comm_ms is not None else "") + _dispatch_note(r)
        phase = tuner.phase_of(r.step) if tuner is not None else None
        if phase == TIMED:
            comm += f" | tune: {r.path}"
        elif phase == PRIME:
            comm += f" | tune: {r.path} (untimed: its CUDA graphs are captured)"
        return (f"step {r.step:4d}/{self.cfg.train.train_iters} | loss {r.loss:.4f} | "
                f"lr {r.lr:.2e} | grad norm {r.grad_norm:.3f} | aux {r.aux_loss:.4f} | "
                f"imbalance {r.load_imbalance:.2f} | {r.tokens / r.step_time_s:,.0f} tok/s"
                f" | {r.step_time_s * 1e3:.1f} ms | {r.tflops_per_gpu:.3g} TFLOP/s"
                f"{self.per_device}{mfu}{mem}{comm}{self._eta(r, results)}")

    def _eta(self, r: StepResult, results: list[StepResult]) -> str:
        """' | ETA 1m05s': the steps left after step `r` (to --train-iters, so also after a
        resume) times the mean time of this process's steps so far (first step left out once
        there are others: it carries one-time setup)."""
        left = self.cfg.train.train_iters - r.step
        if left <= 0:
            return ""
        timed = results[1:] or results
        return f" | ETA {format_duration(left * sum(r.step_time_s for r in timed) / len(timed))}"

    def _watch_imbalance(self, r: StepResult) -> None:
        """One warning when the worst layer's load imbalance stays at or above the limit
        (`imbalance_warn_limit`) for a while: the router has collapsed onto a few experts (and
        the EP ranks wait on one)."""
        moe = self.cfg.moe
        limit = imbalance_warn_limit(moe.num_experts, moe.moe_router_topk)
        window = IMBALANCE_WARN_STEPS
        self._imbalanced_steps = self._imbalanced_steps + 1 if r.load_imbalance >= limit else 0
        if self._imbalanced_steps == window and self.groups.is_first():
            warn_every_rank(f"load imbalance at or above {limit:.3g} for {window} steps (now "
                            f"{r.load_imbalance:.2f} at step {r.step}): the router sends most "
                            f"tokens to a few experts; raise --moe-aux-loss-coeff or use "
                            f"--moe-router-enable-expert-bias")

    def graphs_captured(self, step: int, captured: list, graphs: Optional[StepGraphs]) -> None:
        """The graph banks of `graphs` captured after `step`: count, time and memory of each,
        and of all banks when there are several."""
        for level, bank in captured:
            where = f" (budget {self.budget.levels[level]:g})" if graphs.per_level else ""
            for one, size in _captured_runners(bank):
                self.log(f"CUDA graphs{where}: {one.graph_count()} captured after step {step} "
                         f"in {one.capture_seconds:.2f} s; graph memory "
                         f"{one.pool_bytes / 2**30:.3f} GiB (of it static buffers "
                         f"{one.buffer_bytes() / 2**30:.3f} GiB)"
                         + (f"; CP size {size}" if size else ""))
        if captured and len(graphs.banks.banks) > 1:
            by = " and ".join(what for what, keyed in (
                ("budget level", graphs.per_level), ("path", self.tuner is not None))
                if keyed)
            self.log(f"CUDA graph banks by {by}: {graphs.banks.memory_report()}")

    # ----------------------------------------------------------------- end of run
    def report_compiles(self) -> None:
        """One line: compiled Triton kernel variants per rank, and how many came after warmup."""
        watch, world, rank = self.compile_watch, self.groups.world_size, self.groups.rank
        counts = torch.zeros(2, world, dtype=torch.int64, device=self.device)
        counts[0, rank] = watch.total() or 0
        counts[1, rank] = watch.late_compiles
        if world > 1:
            self.groups.world.all_reduce(counts)
        totals, lates = host_list(counts)
        late = sum(lates)
        if watch.total() is None and not any(totals):
            return
        self.log(f"Triton kernel variants compiled per rank: {totals}; after the "
                 f"{watch.warmup_steps} warmup steps: {late}")

    def summarize(self, results: list[StepResult]) -> RunSummary:
        """The run's figures; peak memory and exposed comm are the max over ranks (a
        collective: every rank calls it)."""
        on_gpu = self.device.type == "cuda"
        if on_gpu:
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
            last_loss=results[-1].loss, peak_mem_gib=peak, on_gpu=on_gpu,
            exposed_comm_ms=None if exposed < 0 else exposed,
            profiled=self.cfg.log.profile_steps)
        summary.add_dispatch_stats(results)
        summary.add_flops(results)
        return summary

    def torch_profiler(self):
        """The torch.profiler of --use-pytorch-profiler over the --profile-steps window, started
        (None without one, or when a resumed run starts after the window)."""
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

    def write_spans(self) -> None:
        if self.cfg.log.profile_dir and self.recorder.steps:
            path = self.recorder.write(self.cfg.log.profile_dir)
            if self.groups.is_first():
                self.log(f"spans written to {Path(path).parent} "
                         f"(view: epoverlap-timeline {self.cfg.log.profile_dir})")

    # ----------------------------------------------------------------- the run's description
    def describe(self) -> str:
        cfg, g = self.cfg, self.groups
        total = (self.params["dense"] + self.params["expert_global"]) / 1e6
        pipeline = ""
        if g.pp_size > 1:
            virtual = f" x {cfg.virtual_stages} virtual" if cfg.virtual_stages > 1 else ""
            pipeline = f"PP {g.pp_size}{virtual} x "
        return (f"epoverlap: world {g.world_size} ({g.backend}, {self.device.type}) = "
                f"{pipeline}{self._stage_text()} | "
                f"{cfg.model.num_layers} layers, hidden "
                f"{cfg.model.hidden_size}, {cfg.moe.num_experts or 0} experts top-"
                f"{cfg.moe.moe_router_topk} | {total:.1f}M params | plan {cfg.plan_name}"
                f"{' + delayed wgrad' if cfg.overlap.delay_wgrad_compute else ''}"
                f"{self._tune_text()} | kernels {self.backend} | "
                f"{model_dtype(cfg.train.bf16)} | data: {self.data.description}")

    def _stage_text(self) -> str:
        """A stage's ranks: 'DP 8 (EP 4 x EDP 2)', or under context parallelism 'CP 2 (p2p)
        x DP 4 (experts: EP 8 x EDP 1)' (DP the ranks reading different sequences)."""
        g = self.groups
        experts = f"EP {g.ep_size}{self._ep_budget_text()} x EDP {g.edp_size}"
        if g.cp_size == 1:
            return f"DP {g.dp_size} ({experts})"
        types = " ".join(sorted(set(self.cfg.cp_comm_types())))
        p = self.cfg.parallel
        if p.dynamic_context_parallel:  # 'CP 4 (p2p; dynamic from 1)'
            types += f"; dynamic from {p.min_dynamic_context_parallel_size}"
        return f"CP {g.cp_size} ({types}) x DP {g.data_size} (experts: {experts})"

    def unaligned_line(self) -> Optional[str]:
        """The start-up line naming the model's GEMM dimensions that are not multiples of
        GEMM_ALIGNMENT elements and the flags that set each (None when every one is)."""
        dims = unaligned_gemm_dims(self.cfg.model, self.cfg.moe)
        if not dims:
            return None
        named = "; ".join(f"{what} {size} ({flags})" for what, size, flags in dims)
        return (f"unaligned GEMMs: {named}: not multiples of {GEMM_ALIGNMENT} elements, so "
                "their tensor-core GEMMs run several times slower")

    def _tune_text(self) -> str:
        tuner = self.tuner
        return "" if tuner is None else tuner.describe()

    def _ep_budget_text(self) -> str:
        budget = self.groups.ep_budget
        return "" if budget is None or budget.is_default else f", NCCL {budget.describe()}"
