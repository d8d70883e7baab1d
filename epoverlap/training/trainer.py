"""One training run: `Trainer` builds the model, grad buffers, optimizer, executor and plan
from a validated config and runs optimizer steps.

One step: the executor runs the plan (sequential, or the combined 1F1B with
--overlap-moe-expert-parallel-comm) over all microbatches; then, only after the last backward
and weight-grad action, grads are reduced, clipped, the expert biases updated from the
all-reduced token counts, and the optimizer steps. Rank 0 prints one line per step and, with
--log-json, writes one JSON record per step (the loss also as float.hex, for bitwise
comparison with `epoverlap-compare-losses`), and one summary line at the end (`RunSummary`).
Rates are per GPU on CUDA and per rank on CPU.
"""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from epoverlap_kernels import make_moe_ops

from epoverlap.config import RunConfig
from epoverlap.model.transformer import (MoEModel, count_parameters, model_dtype,
                                         training_flops_per_token)
from epoverlap.parallel.comm import ExpertComm
from epoverlap.parallel.groups import ParallelGroups
from epoverlap.profiling.recorder import SpanRecorder
from epoverlap.schedule.executor import Executor, make_lanes
from epoverlap.schedule.plan import build_plan, validate_plan
from epoverlap.schedule.wgrad import WeightGradQueue
from epoverlap.training.data import make_data_source
from epoverlap.training.grads import GradBuffers
from epoverlap.training.optim import MixedPrecisionAdamW, lr_at


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

    def to_json(self) -> dict:
        record = dict(self.__dict__)
        record["loss_hex"] = float.hex(self.loss)
        record["tokens_per_s"] = self.tokens / self.step_time_s
        return record


@dataclass
class RunSummary:
    """The end-of-run line: steps, throughput, first and last loss, peak memory, and the
    exposed communication of the profiled steps (when --profile-steps was given)."""

    steps: int
    seconds: float
    tokens: int
    first_loss: float
    last_loss: float
    peak_mem_gib: float
    on_gpu: bool
    exposed_comm_ms: Optional[float] = None
    profiled: Optional[str] = None

    def line(self, per_device: str) -> str:
        memory = ("allocated" if self.on_gpu else "RSS") + ", max over ranks"
        text = (f"done: {self.steps} steps in {self.seconds:.1f} s | "
                f"{self.tokens / self.seconds:,.0f} tok/s | loss {self.first_loss:.4f} -> "
                f"{self.last_loss:.4f} | peak mem {self.peak_mem_gib:.2f} GiB{per_device} "
                f"({memory})")
        if self.exposed_comm_ms is not None:
            text += (f" | exposed comm {self.exposed_comm_ms:.2f} ms/step (profiled steps "
                     f"{self.profiled}, max over ranks)")
        return text


def plan_name(cfg: RunConfig) -> str:
    return cfg.overlap.overlap_plan if cfg.overlap.overlap_moe_expert_parallel_comm \
        else "sequential"


class Trainer:
    """Everything one training run needs, built once from a validated config."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups,
                 log: Callable[[str], None] = print):
        self.cfg, self.groups, self.log = cfg, groups, log
        self.device = groups.device
        backend = cfg.resolved_kernel_backend(self.device.type)
        self.comm = ExpertComm(groups.ep, groups.ep_size, cfg.overlap.comm_mode)
        self.wgrad_queue = WeightGradQueue(enabled=cfg.overlap.delay_wgrad_compute)
        self.model = MoEModel(cfg, self.comm, groups.ep_rank, make_moe_ops(backend),
                              dtype=model_dtype(cfg), device=self.device,
                              wgrad_queue=self.wgrad_queue)
        self.grads = GradBuffers(self.model, groups)
        self.optimizer = MixedPrecisionAdamW(self.model, cfg.train)
        overlap = cfg.overlap.overlap_moe_expert_parallel_comm
        self.lanes = make_lanes(self.device, overlap, cfg.overlap.comm_stream_high_priority)
        self.recorder = SpanRecorder(self.device, groups.rank, groups.world_size)
        self.executor = Executor(self.model.node_specs(), self.lanes, self.wgrad_queue,
                                 self.recorder)
        self.plan = build_plan(plan_name(cfg), self.model.layout(), cfg.train.num_microbatches,
                               cfg.overlap.delay_wgrad_compute)
        validate_plan(self.plan, self.model.layout(), cfg.train.num_microbatches,
                      cfg.overlap.delay_wgrad_compute)
        self.data = make_data_source(cfg.data.data, cfg.model.vocab_size, cfg.train.seed)
        self.backend = backend

    @property
    def per_device(self) -> str:
        """The unit of per-device rates: a GPU on CUDA, a rank (process) on CPU."""
        return "/GPU" if self.device.type == "cuda" else " per rank"

    def describe(self) -> str:
        cfg, g = self.cfg, self.groups
        params = count_parameters(self.model, g.ep_size)
        total = (params["dense"] + params["expert_global"]) / 1e6
        return (f"epoverlap: world {g.world_size} = EP {g.ep_size} x EDP {g.edp_size} (dense "
                f"layers: DP {g.world_size}) | {g.backend}, {self.device.type} | "
                f"{cfg.model.num_layers} layers, hidden "
                f"{cfg.model.hidden_size}, {cfg.moe.num_experts or 0} experts top-"
                f"{cfg.moe.moe_router_topk} | {total:.1f}M params | plan {plan_name(cfg)}"
                f"{' + delayed wgrad' if cfg.overlap.delay_wgrad_compute else ''} | kernels "
                f"{self.backend} | {model_dtype(cfg)} | data: {self.data.description}")

    def microbatches(self, step: int) -> list[dict]:
        t, rank = self.cfg.train, self.groups.rank
        batches = []
        for mb in range(t.num_microbatches):
            tokens, labels = self.data.batch(step, rank, mb, t.micro_batch_size,
                                             self.cfg.model.seq_length)
            batches.append({"tokens": tokens.to(self.device), "labels": labels.to(self.device)})
        return batches

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def run_microbatches(self, step: int, inputs: Optional[list[dict]] = None
                         ) -> list[torch.Tensor]:
        """Forward + backward of every microbatch; grads land in the main_grad buffers."""
        self.grads.zero()
        for router in self.model.routers():
            router.reset_step_stats()
        inputs = self.microbatches(step) if inputs is None else inputs
        return self.executor.run(self.plan, inputs, 1.0 / self.cfg.train.num_microbatches)

    def _reduce_stats(self, losses: list[torch.Tensor]) -> tuple[float, float, float]:
        """Mean loss and aux loss over microbatches and ranks; max expert imbalance."""
        t = self.cfg.train
        routers = self.model.routers()
        aux = sum((r.step_aux_loss for r in routers), torch.zeros((), device=self.device))
        stats = torch.stack([torch.stack(losses).sum().float(), aux.float()])
        counts = torch.stack([r.step_counts for r in routers]) if routers else None
        if self.groups.world_size > 1:
            self.groups.world.all_reduce(stats)
            if counts is not None:
                self.groups.world.all_reduce(counts)
        scale = 1.0 / (t.num_microbatches * self.groups.world_size)
        imbalance = 1.0
        if counts is not None:
            for router, layer_counts in zip(routers, counts):
                router.update_expert_bias(layer_counts)
            per_layer = counts.float().amax(dim=1) / counts.float().mean(dim=1).clamp(min=1e-9)
            imbalance = float(per_layer.max())
        loss_sum, aux_sum = stats.tolist()
        return loss_sum * scale, aux_sum * scale, imbalance

    def step(self, step: int) -> StepResult:
        self.groups.watch.step = step
        profiled = self._profiled(step)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = self._sync_time()
        if profiled:
            self.recorder.begin_step(step)
        losses = self.run_microbatches(step)
        if profiled:
            self.recorder.end_step()
        self.grads.reduce()
        grad_norm = self.grads.clip(self.cfg.train.clip_grad)
        loss, aux, imbalance = self._reduce_stats(losses)
        lr = lr_at(step, self.cfg.train)
        if not self.cfg.train.skip_optimizer_step:
            self.optimizer.step(lr)
        elapsed = self._sync_time() - start
        return self._result(step, loss, lr, grad_norm, aux, imbalance, elapsed)

    def _result(self, step, loss, lr, grad_norm, aux, imbalance, elapsed) -> StepResult:
        t, m = self.cfg.train, self.cfg.model
        tokens = self.groups.world_size * t.num_microbatches * t.micro_batch_size * m.seq_length
        peak = (torch.cuda.max_memory_allocated(self.device) / 2**30
                if self.device.type == "cuda" else None)
        tflops = training_flops_per_token(self.cfg) * tokens / elapsed / 1e12 / \
            self.groups.world_size
        return StepResult(step, loss, lr, grad_norm, aux, imbalance, elapsed, tokens, peak,
                          tflops)

    def _profiled(self, step: int) -> bool:
        window = self.cfg.log.profile_range
        return window is not None and window[0] <= step <= window[1]

    def train(self) -> list[StepResult]:
        cfg, results = self.cfg, []
        json_file = self._open_json()
        torch_profiler = self._torch_profiler()
        try:
            for step in range(1, cfg.train.train_iters + 1):
                result = self.step(step)
                results.append(result)
                if not math.isfinite(result.loss):
                    raise FloatingPointError(f"loss is {result.loss} at step {step}")
                self._report(result, json_file)
                if torch_profiler is not None:
                    torch_profiler.step()
        finally:
            if json_file is not None:
                json_file.close()
            if torch_profiler is not None:
                torch_profiler.stop()
        self._write_spans()
        self.log(self.summarize(results).line(self.per_device))
        return results

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
        peak, exposed = figures.tolist()
        return RunSummary(
            steps=len(results), seconds=sum(r.step_time_s for r in results),
            tokens=sum(r.tokens for r in results), first_loss=results[0].loss,
            last_loss=results[-1].loss, peak_mem_gib=peak, on_gpu=self.device.type == "cuda",
            exposed_comm_ms=None if exposed < 0 else exposed,
            profiled=self.cfg.log.profile_steps)

    def _open_json(self):
        path = self.cfg.log.log_json
        if path is None or not self.groups.is_first():
            return None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return open(path, "w")

    def _report(self, r: StepResult, json_file) -> None:
        if json_file is not None:
            json_file.write(json.dumps(r.to_json()) + "\n")
            json_file.flush()
        if self.groups.is_first() and (r.step % self.cfg.log.log_interval == 0
                                       or r.step == self.cfg.train.train_iters):
            mem = f" | mem {r.peak_mem_gib:.2f} GiB" if r.peak_mem_gib is not None else ""
            self.log(f"step {r.step:4d}/{self.cfg.train.train_iters} | loss {r.loss:.4f} | "
                     f"lr {r.lr:.2e} | grad norm {r.grad_norm:.3f} | aux {r.aux_loss:.4f} | "
                     f"imbalance {r.load_imbalance:.2f} | {r.tokens / r.step_time_s:,.0f} tok/s"
                     f" | {r.step_time_s * 1e3:.1f} ms | {r.tflops_per_gpu:.3g} TFLOP/s"
                     f"{self.per_device}{mem}")

    def _torch_profiler(self):
        window, log = self.cfg.log.profile_range, self.cfg.log
        if window is None or not log.profile_torch:
            return None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        out = Path(log.profile_dir) / f"torch-trace-rank{self.groups.rank:05d}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=window[0] - 1, warmup=0,
                                             active=window[1] - window[0] + 1, repeat=1),
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
        self.lanes.close()
        self.grads.close()
