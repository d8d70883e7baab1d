"""One optimizer step of a built run (`training.loop.build.RunParts`).

Owns `StepRunner`, made from the run's pieces it uses and its built paths (`RunPaths`; each an
`training.loop.path.ExecutionPath`: plan, executor, lanes, weight-grad deferral, dispatcher,
CUDA graph banks). Each step runs one path, handed down as an argument: the flags' one, or the
one the tuner names for that step.

A step: the path's executor runs this rank's plan (sequential, or the combined 1F1B
with --overlap-moe-expert-parallel-comm; with pipeline stages, this stage's 1F1B or interleaved
1F1B plan) over all microbatches, by the CUDA graph bank of the budget level in use when there
are graphs; then, after the last backward and weight-grad action, grads are reduced (inside
the stage: the buckets the executor has not reduced beside the backward, --overlap-grad-reduce,
`training.optimizer.grads`), clipped by the whole model's norm, the expert biases updated from the
all-reduced token counts, and the optimizer steps. With --check-for-nan-in-loss-and-grad the
losses and grads are checked before the optimizer (`numerics`): the local grads, or with
--overlap-grad-reduce the reduced ones (a non-finite grad then shows on every rank of its
data-parallel group).

The step's agreed figures (grad norm, loss, aux loss, imbalance, stop reason, dropped pairs,
the budget's rows on the wire) come from one reduction and one host read
(`training.telemetry.step_stats`), after which the optimizer is queued. Steps that follow one
another are timed from the end of the one before, with no device sync between them: the host
queues the next step's batch copies, resets and graph replay while the device runs the
optimizer (a sync there left the device idle through them: 5-7 ms a step on one H200 at the
Mixtral-like shape). A step after anything else (a capture, an evaluation, a save, a profiled
step) is timed from a sync at its start (`restart_clock`).

MoE dispatch modes (`epoverlap.model.dispatch`): with the budget dispatch, after each
forward-backward the most rows any dispatch wanted to send to one rank is all-reduced (one host
read per step, after the step) and, if it overflowed the budget's block, the step's
forward-backward is rerun from the same inputs, weights and router RNG state at the smallest
budget level that holds it (`forward_backward`); the reruns and the budget the step's result
came from go into its `StepResult`.

With the path tuner (--tune) each step runs the path the tuner names for it
(`training.tuning.tuner`, `path_of`); its decision, when it comes, is kept for the report
(`tune_report`: the table's lines, and the `tuned_path` field of the step's JSON record), the losing paths'
graph banks are released, and rank 0 writes --tune-cache. A path whose graph capture fails on
some rank is dropped on every rank (`capture_graphs`); where the paths' graph banks do not
fit side by side, the tuner takes the paths in turn (`_check_banks_fit`). Steps with recorded
spans (--profile-steps) also measure the first rank's comm, exposed comm and overlap ratio
(`profiling.overlap`). Nothing here logs: `training.telemetry.metrics` reports.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional, Protocol

import torch
import torch.distributed as dist

from epoverlap.model.dropout import dropout_inputs
from epoverlap.model.flops import megatron_flops_per_token, training_flops_per_token
from epoverlap.parallel.watch import host_list
from epoverlap.profiling.overlap import step_metrics
from epoverlap.training.loop.build import loss_scale, router_generators
from epoverlap.training.setup.data import StepFeed
from epoverlap.training.telemetry.metrics import StepResult
from epoverlap.training.telemetry.mfu import device_peak_tflops, mfu
from epoverlap.training.optimizer.numerics import check_finite
from epoverlap.training.optimizer.grads import clip_factor
from epoverlap.training.optimizer.optim import lr_at
from epoverlap.training.telemetry.step_stats import StepStats, reduce_step_stats
from epoverlap.training.tuning.tune_cache import write_decision
from epoverlap.config.resolve import GRAPHS_FLAG
from epoverlap.training.tuning.tuner import TuneDecision, fits_beside

if TYPE_CHECKING:
    from epoverlap.config import RunConfig
    from epoverlap.model.transformer import MoEModel
    from epoverlap.parallel.groups import ParallelGroups
    from epoverlap.profiling.recorder import SpanRecorder
    from epoverlap.schedule.wgrad import WeightGradQueue
    from epoverlap.training.loop.path import ExecutionPath
    from epoverlap.training.loop.faults import FaultInjector
    from epoverlap.training.loop.stop import StopRequest
    from epoverlap.training.optimizer.grads import GradBuffers
    from epoverlap.training.tuning.tune_cache import CacheTarget
    from epoverlap.training.tuning.tuner import Tuner


class RunPaths(Protocol):
    """A run's built paths (`RunParts` is one): by name, the one the run starts on, and the
    way to go on without CUDA graphs (every path made again without them)."""

    paths: dict[str, ExecutionPath]
    path: ExecutionPath

    def drop_graphs(self) -> int:
        """Run on without CUDA graphs. -> pool bytes freed."""


class StepRunner:
    """Runs steps of one built run, on the pieces it is given; each step by the path
    `path_of` names for it (`runs`: the built paths)."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, model: MoEModel,
                 grads: GradBuffers, optimizer, data, *, wgrad_queue: WeightGradQueue,
                 recorder: SpanRecorder, faults: FaultInjector, runs: RunPaths,
                 tuner: Optional[Tuner] = None, tune_cache: Optional[CacheTarget] = None,
                 start_step: int = 0):
        """`optimizer`: steps with `step(lr, grad_scale)`; `data`: the run's source
        (`open_data_source`); `start_step`: the step a resumed run continues after."""
        self.cfg, self.groups, self.device = cfg, groups, groups.device
        self.model, self.budget = model, model.dispatch_budget
        self.grads, self.optimizer, self.data = grads, optimizer, data
        self.wgrad_queue, self.recorder, self.faults = wgrad_queue, recorder, faults
        self.runs, self.tuner, self.tune_cache = runs, tuner, tune_cache
        self.start_step = start_step
        self.stop: Optional[StopRequest] = None  # while the training loop runs (Trainer.train)
        self.tune_report: list[str] = []  # the tuner's lines, reported after their step
        self.tuned_path: Optional[dict] = None  # the decision's JSON record, for its step
        self._tune_record_due = tuner is not None and tuner.cached
        self.stop_reason: Optional[str] = None  # every rank's agreed reason to stop now
        self._last_demand: Optional[list] = None  # the budget's, of the last attempt
        self._feed: Optional[StepFeed] = None  # the steps' batches, one made ahead
        self._clock: Optional[float] = None  # when the step before ended (`restart_clock`)

    def close(self) -> None:
        """Ends the data feed's worker (the batch it was making ahead is dropped)."""
        if self._feed is not None:
            self._feed.close()
            self._feed = None

    # ----------------------------------------------------------------- the step
    def step(self, step: int) -> StepResult:
        self.groups.watch.step = step
        profiled = self._profiled(step)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # back to back, a step is timed from the end of the one before, with no sync between
        # (the host queues this step's start while the device runs that one's optimizer)
        start = self._clock if self._clock is not None and not profiled else self.sync_time()
        if profiled:
            self.recorder.begin_step(step)
        self.faults.begin_step(step)
        path = self._tune_path(step)
        losses, reruns = self.forward_backward(step, path)
        self.recorder.end_forward_backward()
        self.faults.after_backward(self.model)
        if self.cfg.train.check_for_nan_in_loss_and_grad:
            check_finite(step, losses, self.model, self.grads, self.groups)
        with self.recorder.part("grad_reduce"):
            self.grads.reduce()
        with self.recorder.part("grad_clip"):  # the norm and the step's figures: one read
            stats = reduce_step_stats(self.cfg, self.groups, self.model, self.stop, losses,
                                      self.grads.norm_squared())
        grad_norm = stats.grad_norm
        grad_scale = clip_factor(grad_norm, self.cfg.train.clip_grad)
        self.stop_reason = stats.stop_reason
        lr = lr_at(step, self.cfg.train)
        if not self.cfg.train.skip_optimizer_step:
            with self.recorder.part("optimizer"):
                self.optimizer.step(lr, grad_scale)  # the clip, applied as grads are read
        spans = self.recorder.end_step() if profiled else None
        end = self.sync_time() if profiled else time.perf_counter()
        elapsed, self._clock = end - start, None if profiled else end
        self._tune_record(step, elapsed)
        result = self._result(step, stats, lr, grad_norm, elapsed)
        result.path = path.name if self.tuner is not None else None
        self._add_dispatch_stats(result, stats, reruns)
        if spans is not None:
            overlap = step_metrics(spans).overlap
            result.comm_ms, result.exposed_comm_ms = overlap.comm_us / 1e3, \
                overlap.exposed_comm_us / 1e3
            result.overlap_ratio = overlap.overlap_ratio
        return result

    def _result(self, step, stats: StepStats, lr, grad_norm, elapsed) -> StepResult:
        t, m = self.cfg.train, self.cfg.model
        tokens = self.groups.dp_size * t.num_microbatches * self.cfg.microbatch_tokens
        on_gpu = self.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if on_gpu else None
        per_gpu = tokens / elapsed / 1e12 / self.groups.world_size
        tflops = training_flops_per_token(m, self.cfg.moe) * per_gpu
        megatron_tflops = megatron_flops_per_token(m, self.cfg.moe) * per_gpu
        return StepResult(step, stats.loss, lr, grad_norm, stats.aux_loss, stats.load_imbalance,
                          elapsed, tokens, peak, tflops, megatron_tflops_per_gpu=megatron_tflops,
                          mfu=mfu(megatron_tflops, device_peak_tflops(self.device, t.bf16)),
                          deterministic=t.deterministic_mode,
                          # graph pools are reserved, not allocated, while graphs replay
                          peak_reserved_gib=(torch.cuda.max_memory_reserved(self.device) / 2**30
                                             if on_gpu else None))

    def _add_dispatch_stats(self, result: StepResult, stats: StepStats, reruns: int) -> None:
        if self.model.dispatch_mode.drops_tokens:
            result.dropped_tokens, result.dropped_fraction = (stats.dropped_tokens,
                                                              stats.dropped_fraction)
        if self.budget is not None:
            result.dispatch_reruns, result.dispatch_budget = reruns, self.budget.factor
            result.dispatch_wire = stats.dispatch_wire

    def _profiled(self, step: int) -> bool:
        window = self.cfg.log.profile_range
        return window is not None and window[0] <= step <= window[1]

    def restart_clock(self) -> None:
        """Something other than a step ran since the last one (a capture, an evaluation, a
        save): the next step is timed from a sync at its start, not from that step's end."""
        self._clock = None

    def sync_time(self) -> float:
        """perf_counter() once the device has finished what was queued."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ----------------------------------------------------------------- forward-backward
    def microbatches(self, step: int) -> list[dict]:
        """The step's microbatch dicts: tokens, labels (whole sequences: under CP the model
        takes this rank's chunks; under dynamic CP the segment of this rank's group at the
        microbatch's size) and, with dropout, the dropout seed of the same (step, rank of the
        stage, microbatch) as the data (`model.dropout`)."""
        t, rank = self.cfg.train, self.groups.dp_rank  # every stage of a pipeline reads alike
        if self._feed is None:
            self.close()
            self._feed = StepFeed(self.data, self.groups.data_rank, t.num_microbatches,
                                  t.micro_batch_size, self.cfg.model.seq_length)
        batches = self._feed.batches(step)
        if self.model.documents is not None:  # before the device gets them (model.varlen)
            self.model.documents.check_batches(batches)
        context = self.model.context
        if context is not None and context.dynamic:  # this rank's segment (model.context)
            batches = [context.segments(tokens, labels) for tokens, labels in batches]
        return [{"tokens": self._to_device(tokens), "labels": self._to_device(labels),
                 **dropout_inputs(self.cfg.model, t.seed, step, rank, mb)}
                for mb, (tokens, labels) in enumerate(batches)]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A batch tensor on the device; to CUDA from pinned memory without blocking the host
        (a copy from pageable memory would wait for the step before's optimizer)."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.contiguous().pin_memory().to(self.device, non_blocking=True)

    def path_of(self, step: int) -> ExecutionPath:
        """The path step `step` runs: the tuner's for it, else the run's only one."""
        if self.tuner is None:
            return self.runs.path
        return self.runs.paths[self.tuner.path_for(step)]

    def run_microbatches(self, step: int, inputs: Optional[list[dict]] = None,
                         path: Optional[ExecutionPath] = None) -> list[torch.Tensor]:
        """Forward + backward of every microbatch by `path` (default: `path_of(step)`), once,
        at the budget level selected (no rerun: see `forward_backward`); grads land in the
        main_grad buffers."""
        path = path or self.path_of(step)
        path.engage()
        overwrite = self.wgrad_queue.first_write
        self.grads.zero(experts=not overwrite)
        for router in self.model.routers():
            router.reset_step_stats()
        if self.budget is not None:
            self.budget.reset_demand()
        inputs = self.microbatches(step) if inputs is None else inputs

        def run_eager(inputs: list[dict]) -> list[torch.Tensor]:
            return path.executor.run(path.plan, inputs, loss_scale(self.cfg))
        if path.graphs is not None:
            losses = path.graphs.run(inputs, run_eager)
        else:
            losses = run_eager(inputs)
        if overwrite:
            self.grads.zero_unwritten(self.wgrad_queue.written)
        return losses

    def forward_backward(self, step: int, path: Optional[ExecutionPath] = None
                         ) -> tuple[list[torch.Tensor], int]:
        """`run_microbatches` by `path` (default: `path_of(step)`), rerun while the budget
        dispatch overflowed (see the module docstring). -> (losses, reruns). A rerun starts
        from the same inputs, weights and router RNG state, so its result is the one a run at
        its budget level would give."""
        path = path or self.path_of(step)
        inputs = self.microbatches(step)
        budget = self.budget
        if budget is not None:
            self._refit_budget(budget, step, path)
            budget.reset_wire()
        start = budget.start_level() if budget is not None else 0
        result = self.until_it_fits(lambda level: self._attempt(step, inputs, level, path),
                                    start)
        if budget is not None:
            budget.remember(budget.level, self._last_demand, step)
        return result

    def _refit_budget(self, budget, step: int, path: ExecutionPath) -> None:
        """--moe-dispatch-budget-fit: where the fitted base budget changes before this step,
        the graphs sized by the old one are released (the next attempts record and capture
        anew), said in one line."""
        old = budget.levels[0]
        factor = budget.refit()
        if factor is None:
            return
        freed, graphs = "", path.graphs
        if graphs is not None and graphs.per_level:
            if any(bank.captured for bank in graphs.banks.banks.values()):
                freed = "; the CUDA graphs that hold the dispatch are recaptured"
            graphs.release()
        self.tune_report.append(f"dispatch budget: before step {step}, fitted to the demand, "
                                f"{old:g} -> {factor:g}{freed}")

    def until_it_fits(self, attempt, start: int = 0):
        """`attempt(level)` at budget level `start`, then again at the level `overflow_level`
        names, each time from the router generators' state before the first, until nothing
        overflowed (at once without the budget dispatch). -> (its last result, reruns)."""
        generators = router_generators(self.model)
        states = [g.get_state() for g in generators]
        result, reruns = attempt(start), 0
        while (level := self.overflow_level()) is not None:
            for generator, state in zip(generators, states):
                generator.set_state(state)
            result = attempt(level)
            reruns += 1
        return result, reruns

    def _attempt(self, step: int, inputs: list[dict], level: int,
                 path: ExecutionPath) -> list[torch.Tensor]:
        """One forward-backward by `path` at a budget level, by that level's graph bank if it
        has one."""
        self.select_budget_level(level)
        if path.graphs is None:
            return self.run_microbatches(step, inputs, path)
        # warmup counts from here; a fitted budget captures its base level only: a rerun above
        # it runs eagerly, since the base grows before the next step (its bank would be freed)
        capture = level == 0 or self.budget is None or self.budget.fit is None
        path.graphs.begin_attempt(step - self.start_step, level, capture)
        try:
            return self.run_microbatches(step, inputs, path)
        finally:
            path.graphs.end_attempt()

    def select_budget_level(self, level: int) -> None:
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
        self._last_demand = host_list(demand)
        return budget.rerun_level(self._last_demand)

    def capture_graphs(self, step: int) -> list:
        """Capture the graph banks step `step` recorded (the last warmup step records the base
        bank; a later rerun at a new budget level records that level's). -> [(level, bank)]."""
        path = self.path_of(step)
        if path.graphs is None:
            return []
        if self.tuner is None or self.tuner.decision is not None or not path.graphs.due:
            return self._capture_or_drop_graphs(path)
        captured, error = self._try_capture(path)  # while tuning, a failed capture drops it
        failed, short = self._ranks_failed(error)
        if short and GRAPHS_FLAG in self.cfg.defaulted:
            # out of memory: every path's graphs hold about as much, so none is dropped
            self._graphs_off(failed, error)
            return []
        self.capture_failed(failed, error, path)
        if error is None and captured:
            self._check_banks_fit(captured)
        return captured

    def _try_capture(self, path: ExecutionPath) -> tuple[list, Optional[BaseException]]:
        """Capture what this step recorded by `path`; a failure is returned, not raised (every
        rank learns of it from `_ranks_failed`), the router generators as they were before."""
        generators = router_generators(self.model)
        states = [g.get_state() for g in generators]
        try:
            return path.graphs.capture_due(path.plan, self.select_budget_level), None
        except Exception as failure:  # noqa: BLE001  (agreed over the ranks by the caller)
            for generator, state in zip(generators, states):
                generator.set_state(state)
            return [], failure

    def _ranks_failed(self, error: Optional[BaseException]) -> tuple[int, int]:
        """How many ranks' captures failed, and how many of those for want of memory (one
        all-reduce; captures happen at the same steps on every rank)."""
        count = torch.tensor([float(error is not None), float(_out_of_memory(error))],
                             device=self.device)
        self.groups.world.all_reduce(count)
        failed, short = host_list(count)
        return int(failed), int(short)

    def _capture_or_drop_graphs(self, path: ExecutionPath) -> list:
        """Capture what this step recorded by `path`. Where the graph scope was the auto
        default and the capture fails on some rank, the run goes on without graphs, saying so
        in one line; a scope the flags gave fails the run."""
        if GRAPHS_FLAG not in self.cfg.defaulted or not path.graphs.due:
            return path.graphs.capture_due(path.plan, self.select_budget_level)
        captured, error = self._try_capture(path)
        ranks, _ = self._ranks_failed(error)
        if not ranks:
            return captured
        self._graphs_off(ranks, error)
        return []

    def _graphs_off(self, ranks: int, error: Optional[BaseException]) -> None:
        """The auto graph scope's capture failed on `ranks` ranks: every bank released, the
        run goes on without graphs (every path, while tuning), said in one line."""
        self.wgrad_queue.clear()
        scope, freed = self.cfg.cuda_graph.impl, self.runs.drop_graphs()
        self.tune_report.append(
            f"CUDA graphs: the capture failed on {ranks} rank(s){_why(error)}; the run goes on "
            f"without graphs ({freed / 2**30:.3f} GiB released; the graph scope {scope} was "
            f"the auto default, {GRAPHS_FLAG} pins one)")

    def _check_banks_fit(self, captured: list) -> None:
        """After a capture while the tuner primes the paths: whether the paths not primed yet
        fit beside the banks held (`tuner.fits_beside`, every rank alike); if not, the tuner
        takes the paths in turn and every path's banks but the first's are released."""
        tuner = self.tuner
        others = sum(1 for name in tuner.names if name not in tuner.primed)
        if tuner.in_turn or tuner.decision is not None or not others:
            return
        bank_bytes = sum(bank.pool_bytes for _, bank in captured)
        free = self._free_device_bytes()
        fits = torch.tensor([float(fits_beside(bank_bytes, free, others))], device=self.device)
        self.groups.world.all_reduce(fits, op=dist.ReduceOp.MIN)
        if host_list(fits)[0]:
            return
        tuner.take_turns()
        for name in tuner.names[1:]:
            self.runs.paths[name].graphs.release_path()
        self.tune_report.append(
            f"tune: a path's CUDA graphs take {bank_bytes / 2**30:.1f} GiB, "
            f"{(free or 0) / 2**30:.1f} GiB are free: the paths are timed one after another, "
            "each holding its graphs in its turn")

    def _free_device_bytes(self) -> Optional[int]:
        """Free device memory (CUDA, the allocator's cache emptied first), else None."""
        if self.device.type != "cuda":
            return None
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    # ----------------------------------------------------------------- the path tuner
    def _tune_path(self, step: int) -> ExecutionPath:
        """The path this step runs (`path_of`); the tuner taking the paths in turn, only that
        path holds graphs."""
        path = self.path_of(step)
        if self.tuner is not None and self.tuner.in_turn and path.graphs is not None:
            for other in self.tuner.names:
                if other != path.name:
                    self.runs.paths[other].graphs.release_path()
        return path

    def _tune_record(self, step: int, elapsed: float) -> None:
        """Record the step's time; at the decision (or the first step of a cached one) keep
        its report, release the losers' graph banks and write the cache."""
        if self.tuner is None:
            return
        if self._tune_record_due:  # a decision from --tune-cache, reported at the first step
            self._tune_record_due = False
            self.tune_report += self.tuner.decision.table()
            self.tuned_path = self.tuner.decision.record()
            return

        def slowest(times: list[float]) -> list[float]:
            worst = torch.tensor(times, dtype=torch.float64, device=self.device)
            self.groups.world.all_reduce(worst, op=dist.ReduceOp.MAX)
            return host_list(worst)
        decision = self.tuner.record(step, elapsed, slowest)
        if decision is not None:
            self._decided(decision)

    def _decided(self, decision: TuneDecision) -> None:
        """The decision's table, the losers' banks released, the budget's fit left with the
        demand of the steps that ran the chosen path, the cache written (rank 0)."""
        self.tune_report += decision.table()
        self.tuned_path = decision.record()
        if self.budget is not None:
            self.budget.keep_steps(self.tuner.steps_of(decision.chosen))
        if self.runs.path.graphs is not None:
            freed = {name: self.runs.paths[name].graphs.release_path()
                     for name in self.tuner.losers()}
            self.tune_report.append(f"tune: the other paths' CUDA graphs released "
                                    f"({sum(freed.values()) / 2**30:.3f} GiB)")
        if self.tune_cache is not None:
            warning = write_decision(self.tune_cache.path, decision, self.tune_cache.fields)
            self.tune_report.append(warning or f"tune: decision written to "
                                               f"{self.tune_cache.path}")

    def capture_failed(self, ranks: int, error: Optional[BaseException],
                       path: ExecutionPath) -> None:
        """After a step's graph captures by `path` while the tuner decides: if `ranks` ranks
        failed (`_ranks_failed`, the same on every rank), the path is dropped on every rank and
        its banks released (the next step runs the path the tuner names then)."""
        if ranks == 0:
            return
        path.graphs.release_path()
        why = f"its CUDA graph capture failed on {ranks} rank(s){_why(error)}"
        self.wgrad_queue.clear()
        decision = self.tuner.drop(path.name, why)
        self.tune_report.append(f"tune: {path.name} dropped: {why}; the run goes on")
        if decision is not None:
            self._decided(decision)

    def pop_tune_report(self) -> tuple[list[str], Optional[dict]]:
        """The tuner's lines since the last call, and its decision's JSON record if it came."""
        report, self.tune_report = self.tune_report, []
        record, self.tuned_path = self.tuned_path, None
        return report, record


def _out_of_memory(error: Optional[BaseException]) -> bool:
    """Whether a capture failed for want of device memory (refused before it started, or
    torch's or CUDA's out-of-memory error midway)."""
    return error is not None and (isinstance(error, (MemoryError, torch.OutOfMemoryError))
                                  or "out of memory" in str(error))


def _why(error: Optional[BaseException]) -> str:
    """' (TypeName: its first line)' of this rank's own capture error, '' without one (rank 0
    prints the line)."""
    if error is None:
        return ""
    text = str(error).strip()
    return f" ({type(error).__name__}: {text.splitlines()[0][:200] if text else ''})"
