"""One training run: `Trainer`, the facade that wires its three parts and runs the loop.

Owns the training loop (`Trainer.train`): for each step after the checkpoint's (a run built with
`resume` continues after it), run the step (`training.loop.step.StepRunner`), capture the CUDA graph
banks it recorded, count Triton compiles, evaluate when --eval-interval says so
(`training.loop.evaluate`), report it (`training.telemetry.metrics.Reporter`), save a checkpoint
when --save-interval says so and after the last step (`training.checkpoints.checkpoint`), collect
garbage between steps with --manual-gc (`training.loop.manual_gc`), and end with the spans, the
compile line and one summary line. What the run is made of is built once in
`training.loop.build.RunParts` (`trainer.parts`); `Trainer` hands the step, the evaluator and the
reporter the pieces each uses, names the pieces its callers read most (`cfg`, `groups`, `device`,
`model`, `grads`, `budget`, `start_step`), and exposes the step's entry points (`step`,
`forward_backward`, `run_microbatches`, `microbatches`, `overflow_level`).
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional

from epoverlap.config import RunConfig
from epoverlap.graphs.capture import CudaGraphBackend
from epoverlap.parallel.groups import ParallelGroups
from epoverlap.parallel.transport import gather_report, nccl_host_identity
from epoverlap.training.loop.build import RunParts
from epoverlap.training.checkpoints.checkpoint_files import CheckpointRef
from epoverlap.training.setup.environment import NCCL_LOG_FOR_REPORT
from epoverlap.training.loop.evaluate import Evaluator
from epoverlap.training.loop.manual_gc import ManualGC
from epoverlap.training.telemetry.metrics import Reporter, RunSummary, StepResult
from epoverlap.training.loop.step import StepRunner
from epoverlap.training.loop.stop import SIGNALS, StopRequest


class Trainer:
    """Everything one training run needs, built once from a validated config (`parts`), and
    the loop over its steps."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups,
                 log: Callable[[str], None] = print, data=None,
                 resume: Optional[CheckpointRef] = None,
                 graph_backend=CudaGraphBackend):
        """`data`: a source from `open_data_source` (opened here when None); the model's
        vocabulary is the source's. `graph_backend`: what captures CUDA graphs (the CPU tests
        pass an emulation)."""
        self.parts = p = RunParts(cfg, groups, log, data, resume, graph_backend)
        self.stopped_by: Optional[str] = None  # why train() ended before --train-iters
        self.stepper = StepRunner(p.cfg, p.groups, p.model, p.grads, p.optimizer, p.data,
                                  wgrad_queue=p.wgrad_queue, recorder=p.recorder,
                                  faults=p.faults, runs=p, tuner=p.tuner,
                                  tune_cache=p.tune_cache, start_step=p.start_step)
        self.evaluator = Evaluator(p.cfg, p.groups, p.model, p.data, self.stepper)
        self.reporter = Reporter(p.cfg, p.groups, p.log, data=p.data, params=p.params,
                                 backend=p.backend, recorder=p.recorder,
                                 compile_watch=p.compile_watch, budget=p.budget, tuner=p.tuner,
                                 start_step=p.start_step)

    # ----------------------------------------------------------------- the pieces read most
    @property
    def cfg(self) -> RunConfig:
        """The run's config, resolved (`auto` defaults chosen, the data's vocabulary)."""
        return self.parts.cfg

    @property
    def groups(self) -> ParallelGroups:
        return self.parts.groups

    @property
    def device(self):
        return self.parts.device

    @property
    def model(self):
        """The model, or this pipeline stage of it (`MoEModel`)."""
        return self.parts.model

    @property
    def grads(self):
        """The fp32 grad buffers (`GradBuffers`)."""
        return self.parts.grads

    @property
    def budget(self):
        """The budget dispatch's shared `DispatchBudget` (None in the other modes)."""
        return self.parts.budget

    @property
    def start_step(self) -> int:
        """The step a resumed run continues after (0 for a fresh run)."""
        return self.parts.start_step

    @property
    def per_device(self) -> str:
        """The unit of per-device rates: a GPU on CUDA, a rank (process) on CPU."""
        return self.reporter.per_device

    # ----------------------------------------------------------------- the step
    def step(self, step: int) -> StepResult:
        return self.stepper.step(step)

    def microbatches(self, step: int) -> list[dict]:
        return self.stepper.microbatches(step)

    def run_microbatches(self, step: int, inputs: Optional[list[dict]] = None):
        """Forward + backward of every microbatch, once (`StepRunner.run_microbatches`)."""
        return self.stepper.run_microbatches(step, inputs)

    def forward_backward(self, step: int):
        """`run_microbatches`, rerun while the budget dispatch overflowed -> (losses, reruns)."""
        return self.stepper.forward_backward(step)

    def overflow_level(self) -> Optional[int]:
        return self.stepper.overflow_level()

    # ----------------------------------------------------------------- the run
    def train(self) -> list[StepResult]:
        cfg, results = self.cfg, []
        if self.start_step >= cfg.train.train_iters:
            self.parts.log(f"checkpoint step {self.start_step} >= --train-iters="
                     f"{cfg.train.train_iters}: nothing left to train")
            return results
        self.reporter.open_sinks()
        torch_profiler = self.reporter.torch_profiler()
        self.stepper.stop = StopRequest(cfg.train.exit_duration_in_mins)
        self.groups.watch.stop_handler = self.stepper.stop.signal
        manual_gc = ManualGC(cfg.train.manual_gc, cfg.train.manual_gc_interval)
        try:
            manual_gc.start()
            for step in range(self.start_step + 1, cfg.train.train_iters + 1):
                self._train_step(step, results)
                manual_gc.after_step(step)
                if torch_profiler is not None:
                    torch_profiler.step()
                if self._stop_after(step):
                    break
        finally:
            manual_gc.stop()
            self.groups.watch.stop_handler = None
            self.reporter.close_sinks()
            if torch_profiler is not None:
                torch_profiler.stop()
        self.reporter.write_spans()
        self.reporter.report_compiles()
        if self.model.context is not None and self.model.context.dynamic:
            self.parts.log(self.model.context.report())
        if results:  # a resumed run may have had no step left to make
            self.parts.log(self.summarize(results).line(self.per_device))
        return results

    def _train_step(self, step: int, results: list[StepResult]) -> None:
        """One step of the loop, appended to `results`: the step, its graph captures,
        compiles, evaluation, report, checkpoint."""
        result = self.step(step)
        if step == self.start_step + 1 and self.cfg.parallel.transport_report(
                self.groups.device.type == "cuda"):
            self._report_transports()
        captured = self.stepper.capture_graphs(step)
        self.reporter.graphs_captured(step, captured, self.stepper.path_of(step).graphs)
        self.parts.compile_watch.after_step(step - self.start_step)
        result.triton_variants = self.parts.compile_watch.total()
        results.append(result)
        if not math.isfinite(result.loss):
            raise FloatingPointError(f"loss is {result.loss} at step {step}")
        tune_lines, result.tuned_path = self.stepper.pop_tune_report()
        evaluation = self.evaluator.maybe_run(step)
        self.reporter.step_done(result, results, tune_lines, evaluation)
        saving = self.parts.checkpointer.due(step)
        if saving:
            self.parts.checkpointer.save(step)
        if captured or evaluation is not None or saving:
            self.stepper.restart_clock()  # the next step's time leaves these out

    def _report_transports(self) -> None:
        """After the first step (every all-to-all peer connected): which transport NCCL chose
        between which ranks; with emulated hosts, fail unless hosts talk over the network."""
        report = gather_report(os.environ.get(NCCL_LOG_FOR_REPORT), nccl_host_identity())
        if report is None:
            self.parts.log("transport: not reported (NCCL_DEBUG was set by the environment: NCCL's "
                     "log is not this process's to read)")
            return
        for line in report.lines():
            self.parts.log(line)
        problems = report.problems()
        if problems and self.cfg.parallel.emulate_hosts > 1:
            raise RuntimeError("--emulate-hosts: emulated hosts must talk over NCCL's network "
                               "transport; " + "; ".join(problems))

    def _stop_after(self, step: int) -> bool:
        """Whether the run stops after `step` before --train-iters (`training.loop.stop`): every
        rank agreed on a signal or the time limit, or --exit-interval divides the step. Saves
        first where asked (--exit-signal-handler for a signal; any --save for the limits) and
        says in one line which step the last checkpoint holds."""
        interval = self.cfg.train.exit_interval
        reason = self.stepper.stop_reason or (
            "exit interval" if interval and step % interval == 0 else None)
        if reason is None or step == self.cfg.train.train_iters:
            return False
        self.stopped_by = reason
        save = (self.cfg.train.exit_signal_handler if reason in SIGNALS
                else bool(self.cfg.checkpoint.save))
        checkpointer = self.parts.checkpointer
        saved = checkpointer.last_saved
        if save and (saved is None or saved[0] != step):
            checkpointer.save(step)
            saved = checkpointer.last_saved
        holds = (f"the last checkpoint holds step {saved[0]} ({saved[1]})" if saved else
                 "no checkpoint holds this run (--save, and --exit-signal-handler for a "
                 "signal, save one)")
        self.parts.log(f"stopped by {reason} after step {step} of {self.cfg.train.train_iters}; "
                 f"{holds}")
        return True

    def summarize(self, results: list[StepResult]) -> RunSummary:
        """The run's figures, max over ranks (a collective: every rank calls it)."""
        return self.reporter.summarize(results)

    def describe(self) -> str:
        return self.reporter.describe()

    def unaligned_line(self) -> Optional[str]:
        """The start-up line on the model's unaligned GEMM dimensions (None: all aligned)."""
        return self.reporter.unaligned_line()

    def close(self) -> None:
        self.stepper.close()
        self.parts.close()

