"""Host cost of a training step, eager vs CUDA graphs (one GPU; the step is host-bound).

    python -m benchmarks.harness.bench_host [--iters 20] [--out FILE.json] [--shape small] [--sync-free]
    python -m benchmarks.harness.bench_host --fusion-ab ROUNDS [--iters 10]
    python -m benchmarks.harness.bench_host --schedule-ab ROUNDS [--iters 10] [--top-ops 40] [--cpus 3]
    python -m benchmarks.harness.bench_host --autograd-share ITERS

For each mode it builds a fresh trainer on one GPU (EP=1, sequential plan), runs the warmup
steps (a graphed mode records in the last one and captures), then times --iters forward +
backward passes of all microbatches: the CPU time of the whole process (every thread: the
Python thread and autograd's) and the wall time, each as a median per step, and per layer and
microbatch (divided by layers x microbatches). A small model keeps the GPU ahead of the host,
so the figures are what the host spends issuing the work. Prints a markdown table last.

Modes: eager and graphed (`--cuda-graph-impl local --cuda-graph-modules attn moe_router
moe_preprocess`) with the dropless dispatch; with --sync-free also, over the budget dispatch
(`--moe-dispatch-budget 1.0`, which one GPU never overflows): eager, the same partial graphs,
whole-layer graphs (`--cuda-graph-impl local`, the MoE layer as one graphed node) and one
full-iteration graph; and over the padded capacity (factor 1.0): eager and full-iteration.

The eager mode runs twice: with the per-shape Triton launch cache (`eager`, the default path)
and with every Triton launch through Triton's own `JITFunction.run` (`eager_triton_path`;
skip with --no-triton-path); both print the loss of one more forward-backward of the same
weights and inputs, which must be bit-identical. The eager mode (dropless) also gets a per-node
table: the host wall time of each node action
(forward F, backward B) as the executor issues it (median over the timed steps, summed over
layers and microbatches, and per call), and, from one step under torch.profiler, the CUDA
kernel launches per step, so host time per launch = host CPU per step / launches.

--fusion-ab ROUNDS runs only an in-process A/B of the eager step without and with the
host-saving fusions (the Switch aux loss inside the router op; the weight-grad GEMMs adding
into main_grad, which only fp32 training takes, so this bf16 shape does not), the two
trainers' timed steps alternated ROUNDS times, each side first in turn: step and per-node
medians over the rounds, and each side's loss.

--schedule-ab ROUNDS runs only an in-process A/B of the sequential step, the combined 1F1B and
the combined 1F1B with delayed wgrad at EP 1 (the all-to-alls are local copies on the comm
stream), alternated the same way: what the overlap schedule itself adds to the host, without
NCCL's share; the three losses must be bit-identical (the overlap contract). It also prints,
per thread name, the scheduler's counters per timed step (switches, migrations between CPUs,
CPU ms): the backward of CUDA tensors runs on autograd's device thread, so every backward node
action hands the work to another thread and back. --cpus LIST runs the process on those CPUs
only (every thread inherits it), which tells a cost of crossing between CPUs from one of the
schedule's own work; --trainer-device cpu (with --shape tiny) runs the same A/B on CPU
trainers of the same host, one intra-op thread: the schedules without any CUDA call.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import json
import os
import pstats
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from epoverlap.config import parse_config, validate_config
from epoverlap.kernels import set_launch_cache
from epoverlap.model.nodes import segmented
from epoverlap.parallel.comm import SplitExchange
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.schedule.executor import SerialLanes
from epoverlap.schedule.node_run import as_node_leaf
from epoverlap.training.setup.environment import setup_environment
from epoverlap.training.loop.trainer import Trainer
from epoverlap.config.resolve import SEQUENTIAL_FLAG as SEQUENTIAL

SHAPES = {
    # host-bound: small GEMMs, four MoE layers
    "small": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
              "--num-query-groups", "2", "--seq-length", "512", "--num-experts", "16",
              "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512",
              "--moe-shared-expert-intermediate-size", "512", "--micro-batch-size", "2",
              "--num-microbatches", "4"],
    # the same structure at a size where torch's CPU kernels take little time, for
    # --trainer-device cpu: the step is then the host's Python and framework work
    "tiny": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--seq-length", "64", "--num-experts", "8",
             "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
             "--moe-shared-expert-intermediate-size", "64", "--micro-batch-size", "2",
             "--num-microbatches", "4"],
}
COMMON = ["--bf16", "--mock-data", "--skip-optimizer-step", "--log-interval", "100000",
          "--train-iters", "1000", "--moe-aux-loss-coeff", "0.01", "--tune", "off"]
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router",
          "moe_preprocess"]
EAGER = ["--cuda-graph-impl", "none"]  # on CUDA the default is GRAPHS (config.resolve)
BUDGET = ["--moe-dispatch-budget", "1.0"]
OVERLAP = ["--overlap-moe-expert-parallel-comm"]
# the sides of --schedule-ab (a "_one_stream" side runs its plan on serial lanes)
SCHEDULE_SIDES = {"sequential": [SEQUENTIAL], "combined_1f1b": OVERLAP,
                  "combined_1f1b_wgrad": OVERLAP + ["--delay-wgrad-compute"],
                  "combined_1f1b_one_stream": OVERLAP}
MODES = {"eager": EAGER, "graphed": GRAPHS}
# the eager mode again with every Triton launch through Triton's own JITFunction.run instead of
# the per-shape launch cache (epoverlap.kernels.launch_cache): the cache's A/B
TRITON_PATH_MODE = "eager_triton_path"
PADDED = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
# what --call-sites names when given no ops: the small fills, copies, host reads and GEMMs
CALL_SITE_OPS = ("aten::fill_", "aten::copy_", "aten::_local_scalar_dense", "aten::mm")
SYNC_FREE_MODES = {"budget_eager": BUDGET + EAGER, "budget_partial": BUDGET + GRAPHS,
                   "budget_layer": BUDGET + ["--cuda-graph-impl", "local"],
                   "budget_full": BUDGET + ["--cuda-graph-impl", "full_iteration"],
                   "padded_eager": PADDED + EAGER,
                   "padded_full": PADDED + ["--cuda-graph-impl", "full_iteration"]}


def measure(groups, argv, iters: int, warmup: int, per_node: int = 0,
            launch_cache: bool = True, call_site_ops: tuple = ()) -> dict:
    """Host and wall time per step of `argv`; with `per_node` (eager only) also the per-node
    table, the launches per step and the `per_node` ops with the most host self time (printed
    when `per_node` > 1). `launch_cache=False`: Triton launches take Triton's own path.
    `call_site_ops` (eager): where in our code each of these ops is issued (`call_sites`)."""
    trainer = Trainer(parse_config(argv), groups, log=lambda msg: None)
    set_launch_cache(launch_cache)
    try:
        inputs = trainer.microbatches(1)
        bank = warm_up_and_capture(trainer, inputs, warmup)
        cpu_ms, wall_ms = timed_steps(trainer, inputs, iters)
        cells = trainer.cfg.model.num_layers * trainer.cfg.train.num_microbatches
        row = {"cpu_ms": cpu_ms, "wall_ms": wall_ms, "cpu_ms_per_layer_mb": cpu_ms / cells,
               "graphs": bank.graph_count() if bank is not None else 0}
        if trainer.parts.graph_banks is None and per_node:
            row["nodes"] = per_node_host_ms(trainer, inputs, iters)
            row["launches_per_step"] = kernel_launches(trainer, inputs,
                                                       top=per_node if per_node > 1 else 0)
            row["host_us_per_launch"] = row["cpu_ms"] * 1e3 / max(row["launches_per_step"], 1)
        if trainer.parts.graph_banks is None and call_site_ops:
            row["call_sites"] = call_sites(trainer, inputs, call_site_ops)
        row["loss"] = _last_loss(trainer, inputs)
        return row
    finally:
        set_launch_cache(True)
        trainer.close()


def warm_up_and_capture(trainer: Trainer, inputs, warmup: int):
    """`warmup` forward-backward passes; a graphed trainer records in the last one and then
    captures its graphs. -> the graphed trainer's active bank (None when eager)."""
    graphs = trainer.parts.path.graphs
    bank = graphs.banks.active if graphs is not None else None
    for i in range(warmup):
        if bank is not None:
            bank.recording = i == warmup - 1
        trainer.run_microbatches(1, inputs)
    if bank is not None:
        bank.recording = False
        bank.capture(trainer.parts.path.plan)
    return bank


def timed_steps(trainer: Trainer, inputs, iters: int) -> tuple[float, float]:
    """Median host CPU ms (the whole process, read before the closing sync: the host's issuing
    cost) and wall ms of `iters` forward-backward passes of all microbatches."""
    cpu, wall = [], []
    sync = _sync_of(trainer)
    for _ in range(iters):
        sync()
        c0, w0 = time.process_time(), time.perf_counter()
        trainer.run_microbatches(1, inputs)
        c1 = time.process_time()
        sync()
        cpu.append(c1 - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


SPLIT_READ = "split read (in F dispatch)"
# the caching allocator's counters of device calls (cudaMalloc, cudaFree) and of the retries
# and stream syncs a miss costs: per step in the schedule A/B (`allocator_counts`)
ALLOCATOR_FIELDS = ("num_device_alloc", "num_device_free", "num_alloc_retries",
                    "num_sync_all_streams")
THREAD_FIELDS = ("nr_voluntary_switches", "nr_involuntary_switches", "se.nr_migrations",
                 "se.sum_exec_runtime")


def thread_counters() -> dict:
    """{thread id: (name, voluntary switches, involuntary switches, migrations between CPUs,
    CPU ms)} of every thread of this process, from Linux's /proc/self/task/*/sched (empty
    where it is not there). Which threads wake how often, and whether the scheduler moves
    them between CPUs, is what the host's per-node cost may hang on (`thread_table`)."""
    found = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            values = {}
            for line in (task / "sched").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() in THREAD_FIELDS:
                    values[key.strip()] = float(value)
        except OSError:  # the thread ended, or no sched file
            continue
        if len(values) == len(THREAD_FIELDS):
            found[task.name] = (name,) + tuple(values[key] for key in THREAD_FIELDS)
    return found


def allocator_counts() -> dict:
    """ALLOCATOR_FIELDS of the CUDA caching allocator, cumulative (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ALLOCATOR_FIELDS}


def thread_table(before: dict, after: dict, steps: int) -> dict:
    """{thread name: [voluntary, involuntary switches, migrations, CPU ms] per step}, summed
    over the threads of one name, from two `thread_counters` readings `steps` steps apart."""
    table: dict = defaultdict(lambda: [0.0] * 4)
    for tid, (name, *counts) in after.items():
        start = before.get(tid, (name, 0.0, 0.0, 0.0, 0.0))[1:]
        row = table[name]
        for i, (end, begin) in enumerate(zip(counts, start)):
            row[i] += (end - begin) / steps
    return {name: [round(v, 2) for v in row] for name, row in table.items()
            if any(row)}


def _sync_of(trainer: Trainer):
    """The device synchronize of `trainer`'s device (nothing on CPU)."""
    return torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)


def _last_loss(trainer: Trainer, inputs) -> float:
    """The summed loss of one more forward-backward (no optimizer step: the same weights and
    inputs in every mode, so the modes' figures can be compared for bit equality)."""
    losses = trainer.run_microbatches(1, inputs)
    return float(sum(loss.float() for loss in losses if loss is not None))


class _HostTimes:
    """A recorder for the executor (its `span(action, lane)` protocol) that sums the host wall
    time of each node action, keyed "F attn", "B mlp", ..."""

    def __init__(self):
        self.totals: dict = defaultdict(lambda: [0.0, 0])

    @contextlib.contextmanager
    def span(self, action, lane, wait):
        wait()  # no wait on serial lanes; outside the node's host time either way
        start = time.perf_counter()
        yield
        total = self.totals[f"{action.kind} {action.node}"]
        total[0] += time.perf_counter() - start
        total[1] += 1


def per_node_host_ms(trainer: Trainer, inputs, iters: int) -> dict:
    """{"F attn": (ms per step, us per call), ...}: host wall time of each node action, timed
    around the executor's task (the issuing thread; the GPU stays behind), plus "issue": the
    host wall time of the whole forward-backward call (what the nodes do not cover is the
    executor's own work and the plan's bookkeeping), and SPLIT_READ: the host's wait for the
    exchanged split sizes (`SplitExchange.read`, part of F dispatch's time; a wait for the GPU
    to finish what the compute stream held when the exchange started, so it grows with how
    far the GPU lags the host)."""
    executor, steps = trainer.parts.path.executor, []
    recorder = executor.recorder
    sync = _sync_of(trainer)
    read = SplitExchange.read
    times = _HostTimes()

    def timed_read(exchange):  # the dispatch's one host wait, inside the F dispatch node
        start = time.perf_counter()
        try:
            return read(exchange)
        finally:
            total = times.totals[SPLIT_READ]
            total[0] += time.perf_counter() - start
            total[1] += 1
    SplitExchange.read = timed_read
    try:
        for _ in range(iters):
            executor.recorder = times = _HostTimes()
            sync()
            start = time.perf_counter()
            trainer.run_microbatches(1, inputs)
            times.totals["issue"] = [time.perf_counter() - start, 1]
            sync()
            steps.append(dict(times.totals))
    finally:
        executor.recorder = recorder
        SplitExchange.read = read
    keys = sorted(steps[0], key=lambda k: (k == "issue", k == SPLIT_READ, k[0] != "F", k))
    return {key: (statistics.median(s[key][0] for s in steps) * 1e3,
                  statistics.median(s[key][0] / s[key][1] for s in steps) * 1e6)
            for key in keys}


def python_profile(trainer: Trainer, inputs, top: int) -> str:
    """cProfile of one eager step: the Python functions with the most own time (the host cost
    torch.profiler cannot attribute: launchers, argument handling, the executor, host waits)."""
    text = own_time_profile(lambda: trainer.run_microbatches(1, inputs), top)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return text


def own_time_profile(run, top: int) -> str:
    """cProfile of `run()`: the `top` Python functions by own time, as pstats prints them."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def api_profile(trainer: Trainer, inputs, top: Optional[int]) -> list:
    """One step under torch.profiler (CPU ops on every thread, and on CUDA the runtime API calls
    through CUPTI): the `top` names (None: all) by host self time, as [name, calls, self ms].
    Where a Python profile shows a C++ call's own time (autograd's `run_backward`), this names
    what inside it took the time (aten ops, `cudaLaunchKernel`, `cudaEventRecord`, ...)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        trainer.run_microbatches(1, inputs)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
    rows = [[event.key, event.count, event.self_cpu_time_total / 1e3]
            for event in prof.key_averages()]
    rows.sort(key=lambda row: -row[2])
    return rows if top is None else rows[:top]


def gpu_busy_ms(trainer: Trainer, inputs) -> Optional[float]:
    """The GPU's busy time in one step: the union of its kernels' and copies' intervals, from
    torch.profiler's device events (CUDA only, else None). Beside the host CPU time it says
    whether a step is bound by the host (busy well below the step) or by the GPU (the host
    then waits, and a wait at a host read spins: it counts as host CPU time too)."""
    if trainer.device.type != "cuda":
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        trainer.run_microbatches(1, inputs)
        torch.cuda.synchronize(trainer.device)
    spans = sorted((event.time_range.start, event.time_range.end) for event in prof.events()
                   if event.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e3


def kernel_launches(trainer: Trainer, inputs, top: int = 0) -> int:
    """CUDA kernel launches of one step (every thread), counted by torch.profiler; with `top`,
    also prints the ops with the most host self time (where the host time goes)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        trainer.run_microbatches(1, inputs)
        _sync_of(trainer)()
    if top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
        print(python_profile(trainer, inputs, top))
    return launch_count(prof)


# the CUDA runtime and driver calls that launch a kernel (aten's, Triton's, CUTLASS's)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def launch_count(prof) -> int:
    """Kernel launches among a finished torch.profiler's events (every thread)."""
    return sum(1 for event in prof.events() if event.name in LAUNCH_CALLS)


def call_sites(trainer: Trainer, inputs, ops: list[str], top: int = 8) -> dict:
    """Where in this project's code each aten op in `ops` (e.g. aten::fill_, aten::copy_,
    aten::_local_scalar_dense) is issued during one eager step, and how long the calls take:
    {op: [(site, calls, mean wall us of the op), ...]}, most total time first. A dispatch mode
    (below autograd, so backward ops on autograd's thread count too) takes each call's Python
    stack and times the op itself (the mode's own cost is outside the timed span)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    wanted = {name.replace("::", ".", 1): name for name in ops}
    sites: dict = {name: defaultdict(lambda: [0, 0.0]) for name in ops}

    class _Sites(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = wanted.get(str(func.overloadpacket))
            if op is None:
                return func(*args, **(kwargs or {}))
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            elapsed = time.perf_counter() - start
            site = sites[op][_project_site()]
            site[0] += 1
            site[1] += elapsed * 1e6
            return out

    with _Sites():
        trainer.run_microbatches(1, inputs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {op: sorted(((where, n, total / n) for where, (n, total) in found.items()),
                       key=lambda row: -row[1] * row[2])[:top]
            for op, found in sites.items()}


def _project_site() -> str:
    """'dir/file:line function' of the innermost frame of this project's code on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if (any(part in path for part in ("epoverlap/", "kernels/", "epoverlap.kernels/"))
                and not path.endswith("bench_host.py")):
            short = path[path.rfind("/", 0, path.rfind("/")) + 1:]
            return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "(no project frame)"


def autograd_share(trainer: Trainer, inputs, iters: int) -> dict:
    """{"F attn": (host us with autograd recording, without), ...}: each node's forward of
    microbatch 0, in plan order, issued twice, each form first in turn: under `torch.no_grad`
    (outputs dropped) and as the executor runs it (inputs as fresh leaves, under autograd; its
    outputs feed the next node). A node given a split exchange (the dropless dispatch) is run
    once and left out: its host read is kept by the first call. The difference bounds what a
    node written as one autograd Function with a hand-written backward could save on its
    forward: the recording of every op's backward node, saved tensors and views. Medians over
    `iters` passes; the GPU is synced before each timed call, so a node's host read waits for
    nothing queued by the other form. A node made of segments also gets each segment's time
    with autograd ("F attn: moe_router")."""
    sync = _sync_of(trainer)
    samples: dict = defaultdict(lambda: ([], []))
    for index in range(iters):
        trainer.grads.zero()
        for router in trainer.model.routers():
            router.reset_step_stats()
        values = dict(inputs[0])
        for spec in trainer.model.node_specs(trainer.cfg.overlap.moe_a2a_waves):
            args = {local: values[name] for local, name in spec.inputs.items()}
            leaves = {local: as_node_leaf(value) for local, value in args.items()}
            recorded = _segments_timed(spec, samples) if spec.segments else spec.fn
            times = samples[f"F {spec.name}"]
            forms = ((False, times[1]), (True, times[0]))
            if any(isinstance(value, SplitExchange) for value in args.values()):
                forms = ((True, []),)  # its read is kept by the first call: not comparable
            for record, timed in forms if index % 2 else forms[::-1]:  # each form first in turn
                sync()
                start = time.perf_counter()
                with torch.set_grad_enabled(record):
                    out = recorded(**leaves) if record else spec.fn(**args)
                timed.append((time.perf_counter() - start) * 1e6)
            values.update({spec.outputs[local]: as_node_leaf(value)
                           for local, value in out.items()})
        sync()
    return {key: (statistics.median(with_grad),
                  statistics.median(without) if without else None)
            for key, (with_grad, without) in samples.items() if with_grad and (
                without or ": " in key)}


def _segments_timed(spec, samples: dict):
    """`spec`'s node callable (`nodes.segmented` of its segments), each segment's host time
    added to samples["F <node>: <segment>"] (with autograd; no no_grad figure)."""
    def timed(segment):
        def fn(**inputs):
            start = time.perf_counter()
            out = segment.fn(**inputs)
            samples[f"F {spec.name}: {segment.name}"][0].append(
                (time.perf_counter() - start) * 1e6)
            return out
        return dataclasses.replace(segment, fn=fn)
    return segmented([timed(segment) for segment in spec.segments], tuple(spec.outputs))


def fusion_ab(groups, argv, rounds: int, iters: int, warmup: int) -> dict:
    """The eager step without and with the host-saving fusions (the Switch aux loss inside the
    router op, and the weight-grad GEMMs accumulating into main_grad), alternated (`alternate`).
    Separate runs of one command moved 124-148 ms per step on one host, more than these fusions
    can save."""
    sides = {"unfused": Trainer(parse_config(argv + ["--no-gradient-accumulation-fusion"]),
                                groups, log=lambda msg: None),
             "fused": Trainer(parse_config(argv), groups, log=lambda msg: None)}
    for layer in sides["unfused"].model.modules():
        if hasattr(layer, "aux_loss_in_op"):
            layer.aux_loss_in_op = False
    return alternate(sides, rounds, iters, warmup, "fusion A/B")


def schedule_ab(groups, argv, rounds: int, iters: int, warmup: int, top: int,
                names: Optional[list[str]] = None) -> dict:
    """The sequential step against the combined 1F1B (and with delayed wgrad) on one GPU,
    alternated (`alternate`); and the combined 1F1B's order issued on one stream (serial lanes:
    no event, no hand-over), which tells the cost of the lanes from that of the order.
    `names`: which of `SCHEDULE_SIDES`, in that order (default: all; the first is the
    baseline of the ratios). At EP 1 the all-to-alls are local copies, issued on the comm
    stream like NCCL's would be, so what the overlap adds to the host here is the schedule's
    own cost: the second stream, the events and hand-overs, the interleaved microbatches, the
    autograd engine's stream changes; NCCL's share is not in it. (The training command refuses
    the overlap at EP 1: there is nothing to hide; this builds the trainer without that check.)
    With `top`, each side also gets one step under torch.profiler (the `top` names by host self
    time, and every CUDA runtime call, with their call counts: `api_profile`) and one under
    cProfile (the `top` Python functions by own time: `python_profile`)."""
    sides = {name: Trainer(parse_config(argv + SCHEDULE_SIDES[name]), groups,
                           log=lambda msg: None)
             for name in names or list(SCHEDULE_SIDES)}
    for name, trainer in sides.items():
        if name.endswith("_one_stream"):  # the combined plan's order on serial lanes: no
            trainer.parts.lanes.close()         # second stream, event or hand-over
            trainer.parts.lanes = trainer.parts.path.executor.lanes = SerialLanes()

    def profile(trainer, inputs):
        if not top:
            return None
        rows = api_profile(trainer, inputs, None)
        runtime = [row for row in rows if row[0].startswith("cu") or
                   "record_stream" in row[0]]  # every runtime call: the lanes' events, syncs
        return {"api": rows[:top] + [row for row in runtime if row not in rows[:top]],
                "python": python_profile(trainer, inputs, top)}
    return alternate(sides, rounds, iters, warmup, "schedule A/B", profile=profile)


def alternate(sides: dict, rounds: int, iters: int, warmup: int, what: str,
              profile=None) -> dict:
    """Both (all) trainers in this process, their timed steps alternated `rounds` times, each
    side first in turn (the same side first in every round favoured it by about 5% on
    untouched nodes in benchmarks/cuda_graphs.md run 6), so every side sees the same host
    drift (with `iters` 1 the sides alternate step by step: these hosts drift by 15-30%
    between rounds of 10 steps, benchmarks/overlap.md run H):
    {side: {"cpu_ms": [per round], "wall_ms": [...], "nodes": [per-round tables], "loss": ...,
    "launches_per_step": ..., "profile": `profile(trainer, inputs)`}}. Closes the trainers."""
    try:
        inputs = {side: trainer.microbatches(1) for side, trainer in sides.items()}
        for side, trainer in sides.items():
            for _ in range(warmup):
                trainer.run_microbatches(1, inputs[side])
        results = {side: {"cpu_ms": [], "wall_ms": [], "nodes": [], "threads": [],
                          "allocator": []} for side in sides}
        names = list(sides)
        for round_index in range(rounds):
            first = round_index % len(names)  # each side leads in turn: no place favoured
            for side in names[first:] + names[:first]:
                trainer = sides[side]
                before, alloc = thread_counters(), allocator_counts()
                cpu_ms, wall_ms = timed_steps(trainer, inputs[side], iters)
                results[side]["threads"].append(thread_table(before, thread_counters(),
                                                             iters))
                results[side]["allocator"].append({
                    key: (end - alloc[key]) / iters
                    for key, end in allocator_counts().items()})
                results[side]["cpu_ms"].append(cpu_ms)
                results[side]["wall_ms"].append(wall_ms)
                results[side]["nodes"].append(per_node_host_ms(trainer, inputs[side], iters))
            print(f"{what} round {round_index + 1}/{rounds}: " + ", ".join(
                f"{side} {results[side]['cpu_ms'][-1]:.2f} ms" for side in names), flush=True)
        for side, trainer in sides.items():
            results[side]["loss"] = _last_loss(trainer, inputs[side])
            results[side]["launches_per_step"] = kernel_launches(trainer, inputs[side])
            results[side]["gpu_busy_ms"] = gpu_busy_ms(trainer, inputs[side])
            if profile is not None:
                results[side]["profile"] = profile(trainer, inputs[side])
        return results
    finally:
        for trainer in sides.values():
            trainer.close()


def print_ab(results: dict) -> None:
    """Medians over the rounds: the step, then each node action; every side against the first."""
    med = {side: {key: statistics.median(r[key]) for key in ("cpu_ms", "wall_ms")}
           for side, r in results.items()}
    sides = list(results)
    first = sides[0]
    print("\n| eager step | host CPU ms/step | wall ms/step | GPU busy ms, one step | "
          "launches/step | loss |\n| --- | --- | --- | --- | --- | --- |")
    for side, r in results.items():
        busy = r.get("gpu_busy_ms")
        print(f"| {side} | {med[side]['cpu_ms']:.2f} | {med[side]['wall_ms']:.2f} | "
              f"{'-' if busy is None else f'{busy:.2f}'} | {r['launches_per_step']} | "
              f"{r['loss']!r} |")
    for side in sides[1:]:
        print(f"{side} / {first}: host CPU {med[side]['cpu_ms'] / med[first]['cpu_ms']:.3f}x, "
              f"wall {med[side]['wall_ms'] / med[first]['wall_ms']:.3f}x (medians of "
              f"{len(results[side]['cpu_ms'])} alternated rounds)")
    print("\n| eager node action | host us per call, " + " | ".join(sides) + " | "
          + " | ".join(f"{side} / {first}" for side in sides[1:]) + " |\n|"
          + " --- |" * (2 * len(sides)))
    keys = list(results[first]["nodes"][0])
    keys += [k for side in sides[1:] for k in results[side]["nodes"][0] if k not in keys]
    for key in keys:
        us = {side: statistics.median(table[key][1] for table in r["nodes"])
              if key in r["nodes"][0] else float("nan") for side, r in results.items()}
        print(f"| {key} | " + " | ".join(f"{us[side]:.0f}" for side in sides) + " | "
              + " | ".join(f"{us[side] / us[first]:.3f}" for side in sides[1:]) + " |")
    print_threads(results)
    for side, r in results.items():
        if r.get("allocator") and r["allocator"][0]:
            print(f"allocator, {side}, per timed step (medians): " + ", ".join(
                f"{key} {statistics.median(a[key] for a in r['allocator']):g}"
                for key in r["allocator"][0]))
    for side, r in results.items():
        if r.get("profile"):
            print(f"\n{side}, one step under torch.profiler:\n| name | calls | host self ms |"
                  "\n| --- | --- | --- |")
            for name, calls, ms in r["profile"]["api"]:
                print(f"| {name} | {calls} | {ms:.2f} |")
            print(f"\n{side}, one step under cProfile:\n{r['profile']['python']}")


def print_threads(results: dict) -> None:
    """Per thread name and side: switches, migrations and CPU ms per timed step (medians over
    the rounds; Linux's scheduler counters)."""
    names = sorted({name for r in results.values() for table in r.get("threads", ())
                    for name in table})
    if not names:
        return
    print(f"\nthreads (CPUs this process may use: {len(os.sched_getaffinity(0))}), per timed "
          "step: voluntary / involuntary switches, migrations, CPU ms\n| thread | "
          + " | ".join(results) + " |\n|" + " --- |" * (len(results) + 1))
    for name in names:
        cells = []
        for r in results.values():
            rows = [table[name] for table in r["threads"] if name in table]
            if not rows:
                cells.append("-")
                continue
            med = [statistics.median(row[i] for row in rows) for i in range(4)]
            cells.append(f"{med[0]:.0f} / {med[1]:.0f}, {med[2]:.0f}, {med[3]:.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def print_call_sites(found: dict) -> None:
    for op, rows in found.items():
        print(f"\n| {op}: issued at | calls per step | op wall us per call |\n| --- | --- | --- |")
        for where, calls, mean_us in rows:
            print(f"| {where} | {calls} | {mean_us:.1f} |")


def print_node_table(eager: dict, triton_path: Optional[dict]) -> None:
    """The per-node host table of the eager mode, beside the same with Triton's own launch
    path when that was measured."""
    for name, row in (("eager", eager), (TRITON_PATH_MODE, triton_path)):
        if row is not None:
            print(f"{name}: {row['launches_per_step']} CUDA kernel launches per step, "
                  f"{row['host_us_per_launch']:.1f} us of host CPU per launch")
    if triton_path is None:
        print("\n| eager node action | host ms/step | host us per call |\n| --- | --- | --- |")
        for key, (ms, us) in eager["nodes"].items():
            print(f"| {key} | {ms:.2f} | {us:.0f} |")
        return
    print("\n| eager node action | host ms/step, Triton's launch path | with the launch cache "
          "| host us per call, Triton's path | with the cache |\n| --- | --- | --- | --- | --- |")
    for key, (ms, us) in eager["nodes"].items():
        before_ms, before_us = triton_path["nodes"].get(key, (float("nan"),) * 2)
        print(f"| {key} | {before_ms:.2f} | {ms:.2f} | {before_us:.0f} | {us:.0f} |")


def cpu_list(text: str) -> set[int]:
    """'3', '2,3', '2-5,8' -> a set of CPU numbers (argparse type of --cpus)."""
    cpus = set()
    try:
        for part in text.split(","):
            low, dash, high = part.partition("-")
            cpus.update(range(int(low), int(high if dash else low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list like 3, 2,3 or 2-5")
    if not cpus:
        raise argparse.ArgumentTypeError(f"{text!r} names no CPU")
    return cpus


def autograd_share_main(groups, base: list[str], args) -> int:
    """--autograd-share: one eager trainer, its warm-up steps, then `autograd_share`; prints
    the table. Tears `groups` down."""
    trainer = Trainer(parse_config(base), groups, log=lambda msg: None)
    try:
        inputs = trainer.microbatches(1)
        for _ in range(args.warmup):
            trainer.run_microbatches(1, inputs)
        share = autograd_share(trainer, inputs, args.autograd_share)
    finally:
        trainer.close()
        destroy_distributed(groups)
    print(f"\nbench_host --autograd-share: {torch.cuda.get_device_name()}, shape "
          f"{args.shape}, microbatch 0, medians of {args.autograd_share}\n| node forward | "
          "host us, autograd | no_grad | autograd's share |\n| --- | --- | --- | --- |")
    for key, (with_grad, without) in share.items():
        print(f"| {key} | {with_grad:.0f} | " + ("- | - |" if without is None else
              f"{without:.0f} | {1 - without / with_grad:.0%} |"))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--top-ops", type=int, default=30,
                        help="eager: print this many ops with the most host self time")
    parser.add_argument("--no-triton-path", action="store_true",
                        help=f"skip the {TRITON_PATH_MODE} mode (eager without the launch cache)")
    parser.add_argument("--call-sites", nargs="*", default=None, metavar="OP",
                        help="eager: where in our code these aten ops are issued, and their time "
                             f"(with no names: {' '.join(CALL_SITE_OPS)})")
    parser.add_argument("--fusion-ab", type=int, default=0, metavar="ROUNDS",
                        help="only this: the eager step without and with the host-saving "
                             "fusions (aux loss in the router op, gradient-accumulation "
                             "fusion), alternated ROUNDS times in this process")
    parser.add_argument("--schedule-ab", type=int, default=0, metavar="ROUNDS",
                        help="only this: the sequential step against the combined 1F1B (and "
                             "with delayed wgrad) at EP 1, alternated ROUNDS times in this "
                             "process: what the overlap schedule itself costs the host; "
                             "--top-ops names per side from one profiled step")
    parser.add_argument("--schedule-sides", type=lambda text: text.split(","), default=None,
                        metavar="NAME[,NAME...]",
                        help=f"--schedule-ab: these sides only, the first the baseline "
                             f"(of {', '.join(SCHEDULE_SIDES)})")
    parser.add_argument("--autograd-share", type=int, default=0, metavar="ITERS",
                        help="only this: each node's forward host time with and without "
                             "autograd recording (median of ITERS passes over microbatch 0)")
    parser.add_argument("--sync-free", action="store_true",
                        help="also the budget dispatch: eager, partial, whole-layer and "
                             "full-iteration graphs")
    parser.add_argument("--extra", type=shlex.split, default=[], metavar="'ARGS'",
                        help="more training flags for every mode and side (one quoted "
                             "string), e.g. '--moe-dispatch-budget 1.0'")
    parser.add_argument("--trainer-device", choices=("cuda", "cpu"), default="cuda",
                        help="--schedule-ab only: cpu runs the sides' trainers on CPU (torch "
                             "kernels, one intra-op thread; use --shape tiny): the same A/B "
                             "without the CUDA path, on the same host")
    parser.add_argument("--cpus", type=cpu_list, default=None, metavar="LIST",
                        help="run on these CPUs only (e.g. 3 or 2,3 or 2-5): set before any "
                             "thread of torch, autograd or NCCL starts, so all inherit it")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cpus is not None:
        allowed = os.sched_getaffinity(0)
        if not args.cpus <= allowed:
            parser.error(f"--cpus: {sorted(args.cpus - allowed)} not available; this process "
                         f"may use {sorted(allowed)}")
        os.sched_setaffinity(0, args.cpus)
    unknown = set(args.schedule_sides or ()) - set(SCHEDULE_SIDES)
    if unknown:
        parser.error(f"--schedule-sides: {sorted(unknown)} unknown; allowed: "
                     f"{', '.join(SCHEDULE_SIDES)}")
    sites = CALL_SITE_OPS if args.call_sites == [] else tuple(args.call_sites or ())
    not_aten = [name for name in sites if not name.startswith("aten::")]
    if not_aten:  # runtime calls (cudaMemcpyAsync, ...) never reach a dispatch mode
        parser.error(f"--call-sites: {not_aten} are not aten ops (names like aten::fill_)")
    on_cpu = args.trainer_device == "cpu"
    if on_cpu and not args.schedule_ab:
        parser.error("--trainer-device cpu: only with --schedule-ab")
    if not torch.cuda.is_available() and not on_cpu:
        print("bench_host: needs a CUDA device (it measures CUDA graphs against eager)")
        return 2
    base = SHAPES[args.shape] + COMMON + args.extra
    if on_cpu:  # bf16 needs CUDA here; torch's kernels; one thread: the host's own work
        base = [flag for flag in base if flag != "--bf16"] + [
            "--device", "cpu", "--kernel-backend", "torch"]
        torch.set_num_threads(1)
    modes = {**MODES, **({} if args.no_triton_path else {TRITON_PATH_MODE: EAGER}),
             **(SYNC_FREE_MODES if args.sync_free else {})}
    for extra in () if on_cpu else modes.values():  # the CPU A/B builds no graphed mode
        validate_config(parse_config(base + extra), 1, True)
    setup_environment(parse_config(base + ([] if on_cpu else GRAPHS)), print)
    groups = init_distributed(1, args.trainer_device)
    if args.autograd_share:  # eager, as the A/Bs
        return autograd_share_main(groups, base + EAGER, args)
    if args.fusion_ab or args.schedule_ab:
        try:
            results = (fusion_ab(groups, base + EAGER, args.fusion_ab, args.iters, args.warmup)
                       if args.fusion_ab else
                       schedule_ab(groups, base + EAGER, args.schedule_ab, args.iters,
                                   args.warmup, args.top_ops, args.schedule_sides))
        finally:
            destroy_distributed(groups)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        if args.fusion_ab:
            print(f"\nbench_host --fusion-ab: {torch.cuda.get_device_name()}, shape {args.shape}")
        else:
            where = "CPU trainers (one thread)" if on_cpu else torch.cuda.get_device_name()
            print(f"\nbench_host --schedule-ab: {where}, shape {args.shape}, EP 1 (the "
                  "all-to-alls are local copies on the comm lane)")
        print_ab(results)
        return 0
    try:
        rows = {mode: measure(groups, base + extra, args.iters, args.warmup,
                              per_node={"eager": args.top_ops, TRITON_PATH_MODE: 1}.get(mode, 0),
                              launch_cache=mode != TRITON_PATH_MODE,
                              call_site_ops=sites if mode == "eager" else ())
                for mode, extra in modes.items()}
    finally:
        destroy_distributed(groups)
    ratio = rows["eager"]["cpu_ms"] / rows["graphed"]["cpu_ms"]
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "rows": rows,
                                              "cpu_ratio": ratio}, indent=2))
    print(f"\nbench_host: {torch.cuda.get_device_name()}, shape {args.shape}")
    print("| mode | host CPU ms/step | wall ms/step | host CPU ms per layer x microbatch | "
          "graphs | loss |\n| --- | --- | --- | --- | --- | --- |")
    for mode, r in rows.items():
        print(f"| {mode} | {r['cpu_ms']:.2f} | {r['wall_ms']:.2f} | "
              f"{r['cpu_ms_per_layer_mb']:.3f} | {r['graphs']} | {r['loss']!r} |")
    print(f"host CPU time eager / graphed: {ratio:.2f}x")
    for mode in SYNC_FREE_MODES if args.sync_free else ():
        reference = mode.split("_")[0] + "_eager"
        print(f"{reference} / {mode}: host CPU time "
              f"{rows[reference]['cpu_ms'] / rows[mode]['cpu_ms']:.2f}x, wall "
              f"{rows[reference]['wall_ms'] / rows[mode]['wall_ms']:.2f}x")
    if TRITON_PATH_MODE in rows:
        eager, triton_path = rows["eager"], rows[TRITON_PATH_MODE]
        same = "identical" if eager["loss"] == triton_path["loss"] else "DIFFERENT"
        print(f"launch cache: host CPU {triton_path['cpu_ms'] / eager['cpu_ms']:.2f}x less "
              f"than Triton's own launch path; loss {same} ({eager['loss']!r} vs "
              f"{triton_path['loss']!r})")
    if "nodes" in rows["eager"]:
        print_node_table(rows["eager"], rows.get(TRITON_PATH_MODE))
    if "call_sites" in rows["eager"]:
        print_call_sites(rows["eager"]["call_sites"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
