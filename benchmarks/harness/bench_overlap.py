"""EP overlap benchmark: how much of the all-to-all time the combined 1F1B schedule hides.

    torchrun --standalone --nproc-per-node N -m benchmarks.harness.bench_overlap [--shapes a,b] \
        [--out-dir DIR] [--warmup 2] [--iters 5] [--profile-shapes a,b] \
        [--max-ctas default,16,8,2 [--min-ctas 1]] [--extra-flags "--comm-stream-priority normal"]

Runs on any number of ranks (EP = the world size); GPUs with NCCL (bf16), or CPU with gloo.
With `--extra-flags "--emulate-hosts 2"` the modes resolve the dispatch as a job over 2 hosts
would (by host where it pays, `--moe-dispatch-hierarchy`), except T_comp: local copies need
the flat dispatch, whose compute differs only by the hierarchy's second-stage permute.
For each shape it builds a fresh model per mode and times the forward-backward of all
microbatches (median over --iters after --warmup; the max over ranks; every timed step is kept
too, `fb_ms_samples` / `step_ms_samples`: the slowest rank's, rounds one after the other):
  T_seq   sequential schedule (no overlap)
  T_ovl   combined 1F1B with the all-to-alls on the comm stream
  T_wgrad T_ovl plus delayed weight-grad compute
  T_comp  the combined 1F1B schedule with every all-to-all replaced by a local copy of the same
          bytes (compute only)
  T_comm  the all-to-alls of one step alone, replayed back to back with the recorded sizes
          (by host, each stage's over its own group, in the order they ran)
and reports T_comm/T_comp (the ratio of the shape), T_seq/T_ovl, T_ovl/max(T_comp, T_comm),
the realized share of the attainable saving (T_seq - T_ovl) / (T_seq - max(T_comp, T_comm)),
exposed comm (T_ovl - T_comp), the full step time (plus grad reduction) and tokens/s/GPU, and
peak memory per mode next to one microbatch's activations (peak_seq - static).
With --graphs (GPU) every mode also runs with partial CUDA graphs of the pre-dispatch segments
(`--cuda-graph-impl local --cuda-graph-modules attn moe_router moe_preprocess`; mode names get
a `_graph` suffix), captured after the warmup iterations (the last one records).
For the shapes in --profile-shapes, --profile-steps more steps per mode run with span recording
(after a barrier, like the timed ones) into OUT/spans/<shape>/<mode>/ (epoverlap-timeline), and
the timeline's exposed comm of the overlapped run (mean over profiled steps and ranks) is put
next to the benchmark's T_ovl - T_comp, with the profiled steps' own time (the recording's cost).
With --host-nodes each mode also records, per rank, the host wall time of every node action
(`F dispatch` holds the split-size read) and of the whole issue (JSON `host_nodes`); with
--python-profile TOP, rank 0's cProfile of one more step per mode (JSON `python_profile`); with
--api-profile TOP, rank 0's torch.profiler host self time per name (aten ops, CUDA runtime
calls) of one more step per mode (JSON `api_profile`, and a seq/ovl/comp table per shape).
With --torch-trace also OUT/spans/<shape>/torch-trace-<mode>-rank<R>.json (kernel level; the
profiler slows these host-bound steps, so the span figures are then not comparable).
--max-ctas sweeps the expert-parallel communicator's NCCL CTA budget (each value a fresh set of
EP groups made with it, `--moe-a2a-nccl-max-ctas`; `default` is NCCL's own; --min-ctas sets
`--moe-a2a-nccl-min-ctas` beside every value): every shape and mode runs once per value, labelled
`shape [CTAs max N]`. --extra-flags passes training flags to every mode (checked like the
training command's, e.g. `--comm-stream-priority normal`). The profiled table also gives the
compute lane's wait on the comm lane and the compute slowdown of each mode against `seq`
(`epoverlap-timeline --compare`: compute time apart from waits, all layers).
Prints a markdown table last; OUT/bench_overlap.json holds every number.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from epoverlap.config import validate_config
from epoverlap.errors import ConfigError
from epoverlap.parallel.groups import (NcclCtaBudget, destroy_distributed,
                                       expert_parallel_groups, init_distributed)
from epoverlap.training.setup.environment import setup_environment
from epoverlap.training.loop.trainer import Trainer
from epoverlap.config.resolve import SEQUENTIAL_FLAG as SEQUENTIAL

from benchmarks.harness.train_bench import parse_config  # --comm-mode local_copy: T_comp

COMMON = ["--skip-optimizer-step", "--moe-router-force-load-balancing", "--mock-data",
          "--log-interval", "100000", "--train-iters", "1000", "--tune", "off"]
MEGATRON = ["--preset", "megatron-cmp"]
SHAPES = {
    # smoke shape (seconds)
    "quick": ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
              "--seq-length", "256", "--num-experts", "8", "--moe-router-topk", "2",
              "--moe-ffn-hidden-size", "256", "--micro-batch-size", "2",
              "--num-microbatches", "4"],
    # candidate shapes with all-to-all time near compute time (the ratio is measured): top-8
    # routing with small experts keeps the all-to-all bytes per FLOP high, and 8k-16k tokens
    # per microbatch keep each kernel long enough that the GPU, not the host, is the bottleneck
    "ratio_h2048_k8_f128": ["--num-layers", "2", "--hidden-size", "2048",
                            "--num-attention-heads", "16", "--num-query-groups", "4",
                            "--seq-length", "1024", "--num-experts", "32",
                            "--moe-router-topk", "8", "--moe-ffn-hidden-size", "128",
                            "--micro-batch-size", "16", "--num-microbatches", "4"],
    "ratio_h2048_k8_f256": ["--num-layers", "2", "--hidden-size", "2048",
                            "--num-attention-heads", "16", "--num-query-groups", "4",
                            "--seq-length", "1024", "--num-experts", "32",
                            "--moe-router-topk", "8", "--moe-ffn-hidden-size", "256",
                            "--micro-batch-size", "16", "--num-microbatches", "4"],
    "ratio_h4096_k8_f256": ["--num-layers", "2", "--hidden-size", "4096",
                            "--num-attention-heads", "32", "--num-query-groups", "8",
                            "--seq-length", "2048", "--num-experts", "16",
                            "--moe-router-topk", "8", "--moe-ffn-hidden-size", "256",
                            "--micro-batch-size", "4", "--num-microbatches", "4"],
    # near T_comm = T_comp with NCCL_P2P_DISABLE=1 (all-to-alls through host shared memory),
    # where the overlap can halve the step. Picked with the simulator (compute from FLOP
    # counts; the shm link at 24 GB/s per GPU, which reproduces the T_comm of 359 ms measured
    # at ratio_h2048_k8_f128 on 2 H200s with P2P off, issue 14, where the FLOP model also gives
    # its measured 66 ms T_comp): top-4 routing halves the bytes, 4096-wide experts multiply
    # the expert FLOPs by 32. Predicted at EP 2: T_comm 181 ms, T_comp 171-186 ms, so
    # T_comm/T_comp 0.97-1.06 (default rates / the rates calibrated on
    # megatron_e8_k8_f4096_mbs8x4 in benchmarks/scale.md); 0.10 over NVLink.
    # `epoverlap-simulate --flops --shape ratio_h2048_k4_f4096 --ep 2 --link shm
    # --link-bandwidth-gbs 24` (on a CPU machine add `-- --kernel-backend torch`)
    "ratio_h2048_k4_f4096": ["--num-layers", "2", "--hidden-size", "2048",
                             "--num-attention-heads", "16", "--num-query-groups", "4",
                             "--seq-length", "1024", "--num-experts", "32",
                             "--moe-router-topk", "4", "--moe-ffn-hidden-size", "4096",
                             "--micro-batch-size", "16", "--num-microbatches", "4"],
    # the three Megatron-core configurations of environment.md
    "megatron_e32_k4_mbs2x8": MEGATRON,
    "megatron_e32_k4_mbs8x4": MEGATRON + ["--micro-batch-size", "8", "--num-microbatches", "4"],
    "megatron_e8_k8_f4096_mbs8x4": MEGATRON + ["--num-experts", "8", "--moe-router-topk", "8",
                                               "--moe-ffn-hidden-size", "4096",
                                               "--micro-batch-size", "8",
                                               "--num-microbatches", "4"],
    # the Qwen3-30B-A3B proxy preset: 128 experts of FFN 768, top-8, 4096 tokens per microbatch
    "qwen3_proxy": ["--preset", "qwen3-30b-a3b-proxy"],
    # one DeepSeek-V3-like layer: hidden 7168, 256 experts, top-8, FFN 2048, 4096 tokens/rank
    "dsv3_layer": ["--num-layers", "1", "--hidden-size", "7168", "--num-attention-heads", "56",
                   "--num-query-groups", "8", "--seq-length", "4096", "--num-experts", "256",
                   "--moe-router-topk", "8", "--moe-ffn-hidden-size", "2048",
                   "--micro-batch-size", "1", "--num-microbatches", "4"],
}
OVERLAP = ["--overlap-moe-expert-parallel-comm"]
MODES = {"seq": [SEQUENTIAL], "ovl": OVERLAP, "ovl_wgrad": OVERLAP + ["--delay-wgrad-compute"],
         "comp": OVERLAP + ["--comm-mode", "local_copy"]}
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router",
          "moe_preprocess"]
EAGER = ["--cuda-graph-impl", "none"]  # on CUDA the default is GRAPHS (config.resolve)
# --sync-free: the budget dispatch eager, and under one full-iteration graph
BUDGET = ["--moe-dispatch-budget", "1.25"]
FULL_ITERATION = ["--cuda-graph-impl", "full_iteration"]
# the table's "graphs" column per mode suffix: eager, partial graphs (--graphs), and with
# --sync-free the budget dispatch eager and under one full-iteration graph
ROW_LABELS = {"": "off", "_graph": "on", "_budget": "budget, eager", "_full": "budget, full"}


def comm_ms(r: dict, suffix: str) -> float:
    """T_comm of a row: the budget's all-to-alls (its fixed blocks) for the budget rows."""
    return r["comm_budget" if suffix in ("_budget", "_full") else "comm"]["fb_ms"]


def sync_time(device) -> float:
    """The host clock once the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


NCCL_LOGGING = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")


def nccl_environment(environ=None) -> dict:
    """The NCCL settings in this process's environment, its logging ones left out: what every
    figure measured over NCCL ran under (NCCL reads them at its first communicator; a chunk or
    buffer size moves the host-memory all-to-all by 5-10%, benchmarks/peer.md run 6)."""
    environ = os.environ if environ is None else environ
    return {key: value for key, value in sorted(environ.items())
            if key.startswith("NCCL_") and key not in NCCL_LOGGING}


def nccl_environment_text(settings: dict) -> str:
    """`NCCL environment: K=V K=V` for a banner, NCCL_P2P_DISABLE left to the banner itself."""
    shown = [f"{key}={value}" for key, value in settings.items() if key != "NCCL_P2P_DISABLE"]
    return "NCCL environment: " + (" ".join(shown) if shown else "NCCL's defaults")


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64,
                          device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def max_over_ranks_each(values) -> list:
    """Each entry's max over ranks (every rank passes as many): per-step samples as the slowest
    rank timed them."""
    tensor = torch.tensor(list(values), dtype=torch.float64,
                          device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _memory(device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def measure_mode(groups, argv, args, profile_dir=None, want_trace=False) -> dict:
    """Median forward-backward and full-step time of one mode, peak memory, optional trace."""
    trainer = Trainer(parse_config(argv), groups, log=lambda msg: None)
    device = groups.device
    try:
        inputs = trainer.microbatches(1)
        static = _memory(device)
        graphs = trainer.parts.path.graphs
        bank = graphs.banks.active if graphs is not None else None
        for i in range(args.warmup):
            if bank is not None:
                bank.recording = i == args.warmup - 1  # the last one records
            trainer.run_microbatches(1, inputs)
            trainer.grads.reduce()
        graph_info = {}
        if bank is not None:
            bank.recording = False
            bank.capture(trainer.parts.path.plan)
            graph_info = {"graphs": bank.graph_count(), "capture_s": bank.capture_seconds,
                          "graph_gib": bank.pool_bytes / 2**30}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        fb, full, overflows = [], [], 0
        for _ in range(args.iters):
            dist.barrier()
            start = sync_time(device)
            trainer.run_microbatches(1, inputs)
            mid = sync_time(device)
            trainer.grads.reduce()
            full.append(sync_time(device) - start)
            fb.append(mid - start)
            overflows += trainer.budget is not None and trainer.overflow_level() is not None
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0
        reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0
        result = {"fb_ms": max_over_ranks(statistics.median(fb) * 1e3),
                  "step_ms": max_over_ranks(statistics.median(full) * 1e3),
                  # every timed step, not only the medians (ms, the slowest rank's)
                  "fb_ms_samples": [s * 1e3 for s in max_over_ranks_each(fb)],
                  "step_ms_samples": [s * 1e3 for s in max_over_ranks_each(full)],
                  "peak_gib": max_over_ranks(peak), "static_gib": max_over_ranks(static),
                  "peak_reserved_gib": max_over_ranks(reserved),
                  **graph_info}
        if trainer.budget is not None:  # attempts a training step would have rerun
            result["overflows"] = overflows
        if args.host_nodes:
            from benchmarks.harness.bench_host import per_node_host_ms
            dist.barrier()
            mine = per_node_host_ms(trainer, inputs, args.iters)
            every = [None] * groups.world_size
            dist.all_gather_object(every, mine)
            result["host_nodes"] = every  # per rank: {"F attn": [ms per step, us per call]}
        from benchmarks.harness.bench_host import api_profile, python_profile
        for key, profile, top in (("python_profile", python_profile, args.python_profile),
                                  ("api_profile", api_profile, args.api_profile)):
            found = _rank0_profiled_step(trainer, inputs, profile, top) if top else None
            if found is not None:
                result[key] = found
        if profile_dir is not None:
            _profile_steps(trainer, inputs, profile_dir, args)
        if want_trace:
            result["trace"] = _recorded_all_to_alls(trainer, inputs)
        tokens = groups.world_size * len(inputs) * inputs[0]["tokens"].numel()
        result["tokens_per_s_per_gpu"] = tokens / (result["step_ms"] / 1e3) / groups.world_size
        return result
    finally:
        trainer.close()
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _rank0_profiled_step(trainer, inputs, profile, top: int):
    """One more step on every rank (the all-to-alls need them all), rank 0's under
    `profile(trainer, inputs, top)`: its result on rank 0, None elsewhere."""
    dist.barrier()
    found = None
    if trainer.groups.rank == 0:
        found = profile(trainer, inputs, top)
    else:
        trainer.run_microbatches(1, inputs)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    return found


def _profile_steps(trainer, inputs, profile_dir: Path, args) -> None:
    """Spans of --profile-steps steps (and, with --torch-trace, a torch.profiler trace of them),
    each started like a timed step: after a barrier with the device idle."""
    profiler = None
    if args.torch_trace:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        profiler.start()
    for step in range(1, args.profile_steps + 1):
        dist.barrier()
        sync_time(trainer.groups.device)
        trainer.parts.recorder.begin_step(step)
        trainer.run_microbatches(1, inputs)
        trainer.parts.recorder.end_step()
        trainer.grads.reduce()
    if profiler is not None:
        profiler.stop()
        profile_dir.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(
            str(profile_dir.parent / f"torch-trace-{profile_dir.name}-rank{trainer.groups.rank}.json"))
    trainer.parts.recorder.write(str(profile_dir))


class _TaggedTrace:
    """An `ExpertComm.trace` that appends each record, with the comm's group, to one list
    shared by the EP comm and the hierarchical dispatch's two stages: the order they ran in."""

    def __init__(self, into: list, group):
        self.into, self.group = into, group

    def append(self, record: tuple) -> None:
        self.into.append(record + (self.group,))


def _recorded_all_to_alls(trainer, inputs) -> list:
    """One microbatch's all-to-alls, in order: (output splits, input splits, row shape,
    dtype, group), over the EP group or, by host, a stage's (a one-rank stage left out: its
    all-to-all is a local copy that never reaches the backend). By host the EP group carries
    only the split-size exchanges; they ran beside the stages (their own communicator, started
    from the compute lane), so the ranks saw them in different orders among the stages' calls:
    replayed after them, they cannot wait on one another."""
    comm = trainer.parts.comm
    comms = [comm] + ([comm.by_host.between, comm.by_host.within] if comm.by_host else [])
    recorded = []
    for each in comms:
        each.trace = _TaggedTrace(recorded, each.group)
    try:
        trainer.run_microbatches(1, inputs)
    finally:
        for each in comms:
            each.trace = None
    replayed = [record for record in recorded if record[4] is None or record[4].size > 1]
    if comm.by_host is None:
        return replayed
    return ([record for record in replayed if record[4] is not comm.group]
            + [record for record in replayed if record[4] is comm.group])


def replay_comm_ms(trace, groups, args) -> tuple:
    """The recorded all-to-alls alone, back to back on one stream, each over the group it ran
    on: the median of --iters replays (max over ranks) and each replay's ms (the slowest
    rank's)."""
    device = groups.device
    def elems(shape):
        return int(torch.tensor(shape).prod()) if shape else 1
    biggest = max(max(sum(out), sum(inp)) * elems(shape) for out, inp, shape, *_ in trace)
    buffers = {dtype: (torch.zeros(biggest, dtype=dtype, device=device),
                       torch.zeros(biggest, dtype=dtype, device=device))
               for dtype in {rec[3] for rec in trace}}

    def run_all():
        for out_splits, in_splits, shape, dtype, group in trace:
            width = elems(shape)
            send, recv = buffers[dtype]
            send_view = send[: sum(in_splits) * width].view(-1, width)
            recv_view = recv[: sum(out_splits) * width].view(-1, width)
            dist.all_to_all_single(recv_view, send_view, out_splits, in_splits,
                                   group=group.pg if group is not None else groups.ep_group)
    run_all()
    times = []
    for _ in range(args.iters):
        dist.barrier()
        start = sync_time(device)
        run_all()
        times.append(sync_time(device) - start)
    return (max_over_ranks(statistics.median(times) * 1e3),
            [s * 1e3 for s in max_over_ranks_each(times)])


def replayed_comm(trace, groups, args) -> dict:
    """T_comm: the replay, --rounds times, its median (each round's in fb_ms_rounds). One
    replay can come out slow: once 2.35x its 4-microbatch twin for 2x the bytes, which read
    as T_ovl/max 1.00 where a rerun gave 1.17 (benchmarks/overlap.md run M)."""
    replays = [replay_comm_ms(trace, groups, args) for _ in range(max(1, args.rounds))]
    rounds = [median for median, _ in replays]
    figures = {"fb_ms": statistics.median(rounds),
               "fb_ms_samples": [ms for _, samples in replays for ms in samples]}
    return {**figures, "fb_ms_rounds": rounds} if len(rounds) > 1 else figures


def parse_budgets(max_ctas: str, min_ctas) -> list[NcclCtaBudget]:
    """--max-ctas "default,16,8" (+ --min-ctas) -> the budgets to sweep; ValueError if bad."""
    budgets = []
    for item in (part.strip() for part in max_ctas.split(",") if part.strip()):
        if item == "default":
            budgets.append(NcclCtaBudget(None, min_ctas))
        elif item.isdigit():
            budgets.append(NcclCtaBudget(int(item), min_ctas))
        else:
            raise ValueError(f"--max-ctas {max_ctas!r}: {item!r} is neither 'default' nor a "
                             "CTA count")
    if not budgets:
        raise ValueError("--max-ctas needs at least one value (e.g. default,8,2)")
    return budgets


def budget_flags(budget: NcclCtaBudget) -> list[str]:
    """The training flags of a budget (recorded with each mode's flags, checked by the probe)."""
    flags = []
    for flag, value in (("--moe-a2a-nccl-max-ctas", budget.max_ctas),
                        ("--moe-a2a-nccl-min-ctas", budget.min_ctas)):
        flags += [flag, str(value)] if value is not None else []
    return flags


def bench_shape(name, groups, args, log, budget=NcclCtaBudget()) -> dict:
    label = name if budget.is_default else f"{name} [{budget.describe()}]"
    base = SHAPES[name] + COMMON + ["--expert-model-parallel-size", str(groups.world_size)]
    base += budget_flags(budget) + args.extra
    if torch.cuda.is_available():
        base.append("--bf16")
    modes = {mode: flags + EAGER for mode, flags in MODES.items()}
    if args.graphs:
        modes.update({f"{mode}_graph": flags + GRAPHS for mode, flags in MODES.items()})
    if args.sync_free:  # every mode, comp too: each suffix's row has its own T_comp
        for mode in MODES:
            modes[f"{mode}_budget"] = MODES[mode] + BUDGET + EAGER
            modes[f"{mode}_full"] = MODES[mode] + BUDGET + FULL_ITERATION
    results = {"shape": label, "flags": base}
    spans_root = Path(args.out_dir) / "spans" / (name if budget.is_default else
                                                 f"{name}@max{budget.max_ctas or 'default'}")
    for mode, flags in modes.items():
        profile = spans_root / mode if name in args.profile_shapes else None
        results[mode] = measure_mode(groups, base + flags, args, profile,
                                     want_trace=mode in ("ovl", "ovl_budget"))
        log(f"[bench_overlap] {label} {mode}: fb {results[mode]['fb_ms']:.2f} ms, step "
            f"{results[mode]['step_ms']:.2f} ms, peak {results[mode]['peak_gib']:.2f} GiB"
            + (f", {results[mode]['graphs']} graphs, {results[mode]['graph_gib']:.3f} GiB"
               if "graphs" in results[mode] else ""))
    _more_rounds(results, modes, base, groups, args, lambda msg: log(f"[bench_overlap] {label} "
                                                                      + msg))
    for comm, traced in (("comm", "ovl"), ("comm_budget", "ovl_budget")):
        if traced in results:  # the budget's all-to-alls carry its fixed blocks
            results[comm] = replayed_comm(results[traced].pop("trace"), groups, args)
            log(f"[bench_overlap] {label} {comm.replace('_', ' ')} alone: "
                f"{results[comm]['fb_ms']:.2f} ms")
    if name in args.profile_shapes:
        dist.barrier()  # every rank's span files are written
        if groups.rank == 0:
            results["timeline"] = timeline_figures(spans_root, list(modes))
    return results


def _more_rounds(results: dict, modes: dict, base: list, groups, args, log) -> None:
    """Rounds 2..`--rounds` of every mode's timing (order reversed every other round, so no
    mode always runs first): fb_ms and step_ms become the medians over the rounds, each
    round's in fb_ms_rounds / step_ms_rounds. On hosts whose speed drifts by 10-15% between
    runs minutes apart (benchmarks/overlap.md), one round per mode cannot tell modes apart
    that differ by less."""
    if args.rounds <= 1:
        return
    timing_only = argparse.Namespace(**{**vars(args), "host_nodes": False, "python_profile": 0,
                                        "api_profile": 0})
    for mode in modes:
        results[mode]["fb_ms_rounds"] = [results[mode]["fb_ms"]]
        results[mode]["step_ms_rounds"] = [results[mode]["step_ms"]]
    for round_index in range(2, args.rounds + 1):
        order = list(modes) if round_index % 2 else list(reversed(modes))
        for mode in order:
            got = measure_mode(groups, base + modes[mode], timing_only)
            results[mode]["fb_ms_rounds"].append(got["fb_ms"])
            results[mode]["step_ms_rounds"].append(got["step_ms"])
            results[mode]["fb_ms_samples"] += got["fb_ms_samples"]
            results[mode]["step_ms_samples"] += got["step_ms_samples"]
            log(f"{mode} round {round_index}: fb {got['fb_ms']:.2f} ms")
    for mode in modes:
        first_step_ms = results[mode]["step_ms"]
        results[mode]["fb_ms"] = statistics.median(results[mode]["fb_ms_rounds"])
        results[mode]["step_ms"] = statistics.median(results[mode]["step_ms_rounds"])
        results[mode]["tokens_per_s_per_gpu"] *= first_step_ms / results[mode]["step_ms"]


def timeline_figures(spans_root: Path, modes: list) -> dict:
    """Per mode, the timeline tool's figures of the profiled steps, mean over steps and ranks
    (and the worst rank's exposed comm): what `epoverlap-timeline` prints for that directory;
    with a `seq` mode, each mode's compute slowdown against it (`epoverlap-timeline --compare`,
    all layers: compute time apart from waits) and its comm lane's time against seq's (the
    all-to-alls' spans, a wait for a late peer included). `comm_busy_share` is the comm lane's
    time over the step: near 1, the all-to-alls run back to back and the step is their sum."""
    from epoverlap.profiling.node_times import compare_runs, node_figures
    from epoverlap.profiling.spans import read_span_directory
    from epoverlap.cli.timeline import span_summary

    out, nodes = {}, {}
    for mode in modes:
        ranks = read_span_directory(spans_root / mode)
        summary = span_summary(ranks, [step.step for step in ranks[0].steps])
        per_rank = summary.get("mean_over_steps") or summary["steps"][0]["ranks"]
        exposed = [row["exposed_comm_us"] / 1e3 for row in per_rank]
        out[mode] = {"step_ms": statistics.mean(row["step_time_us"] for row in per_rank) / 1e3,
                     "exposed_ms": statistics.mean(exposed), "exposed_max_rank_ms": max(exposed),
                     "comm_ms": statistics.mean(row["comm_us"] for row in per_rank) / 1e3,
                     "compute_busy_ms": statistics.mean(row["compute_busy_us"]
                                                        for row in per_rank) / 1e3,
                     "compute_wait_ms": statistics.mean(row["compute_wait_us"]
                                                        for row in per_rank) / 1e3}
        nodes[mode] = node_figures(ranks)
    if "seq" in nodes:
        for mode in modes:
            total = compare_runs(nodes["seq"], nodes[mode])[-1]  # the "all layers" row
            out[mode]["compute_ms"] = total.other_compute_us / 1e3
            out[mode]["compute_slowdown_vs_seq"] = total.slowdown
            if out["seq"]["comm_ms"] > 0:
                out[mode]["comm_slowdown_vs_seq"] = out[mode]["comm_ms"] / out["seq"]["comm_ms"]
    for figures in out.values():
        figures["comm_busy_share"] = figures["comm_ms"] / figures["step_ms"]
    return out


def realized_saving(t_seq: float, t_ovl: float, t_comp: float, t_comm: float) -> float:
    """Share of the attainable saving realized: (T_seq - T_ovl) / (T_seq - max(T_comp, T_comm))."""
    attainable = t_seq - max(t_comp, t_comm)
    return (t_seq - t_ovl) / attainable if attainable > 0 else float("nan")


def derived(r: dict) -> dict:
    """The ratios the issues ask for, from one shape's raw results (per graph setting)."""
    out = {}
    for suffix in ROW_LABELS:
        if "seq" + suffix not in r:
            continue
        comm = comm_ms(r, suffix)
        seq, comp = r["seq" + suffix]["fb_ms"], r["comp" + suffix]["fb_ms"]
        for mode in ("ovl", "ovl_wgrad"):
            t = r[mode + suffix]["fb_ms"]
            out[f"seq_over_{mode}{suffix}"] = seq / t
            out[f"{mode}{suffix}_over_ideal"] = t / max(comp, comm)
            out[f"realized_{mode}{suffix}"] = realized_saving(seq, t, comp, comm)
            out[f"exposed_{mode}{suffix}_ms"] = t - comp
        out[f"ratio{suffix}"] = comm / comp
    if "seq_graph" in r:
        out["eager_seq_over_graph_ovl"] = r["seq"]["fb_ms"] / r["ovl_graph"]["fb_ms"]
        out["eager_seq_over_graph_ovl_wgrad"] = r["seq"]["fb_ms"] / r["ovl_wgrad_graph"]["fb_ms"]
    if "timeline" in r:
        # T_comp still runs a comm-lane node per all-to-all (the local copy; the count exchange
        # still syncs the host), and T_ovl - T_comp subtracts their exposure too: the timeline's
        # matching figure is the overlapped run's exposed comm minus the compute-only run's.
        timeline = r["timeline"]
        for mode in ("ovl", "ovl_wgrad"):
            bench_exposed = r[mode]["fb_ms"] - r["comp"]["fb_ms"]
            net = timeline[mode]["exposed_ms"] - timeline["comp"]["exposed_ms"]
            out[f"timeline_exposed_{mode}_ms"] = timeline[mode]["exposed_ms"]
            out[f"timeline_net_exposed_{mode}_ms"] = net
            out[f"timeline_net_vs_bench_{mode}"] = (net / bench_exposed if bench_exposed > 0
                                                    else float("nan"))
    act = r["seq"]["peak_gib"] - r["seq"]["static_gib"]
    out["one_mb_activations_gib"] = act
    out["extra_peak_ovl_gib"] = r["ovl"]["peak_gib"] - r["seq"]["peak_gib"]
    return out


def api_profile_table(r: dict, top: int = 25) -> list[str]:
    """Rank 0's host self time per name (torch.profiler, one step) beside each other per mode:
    calls and ms, the names with the largest ovl - seq difference first."""
    modes = [m for m in ("seq", "ovl", "comp") if "api_profile" in r.get(m, {})]
    if "seq" not in modes or "ovl" not in modes:
        return []
    rows = {mode: {name: (calls, ms) for name, calls, ms in r[mode]["api_profile"]}
            for mode in modes}
    names = set().union(*(rows[m] for m in modes))
    gap = lambda n: rows["ovl"].get(n, (0, 0.0))[1] - rows["seq"].get(n, (0, 0.0))[1]  # noqa
    lines = ["", f"{r['shape']}: rank 0's host self time of one step (torch.profiler), "
             "largest ovl - seq first", "| name | " + " | ".join(
                 f"{m} calls | {m} ms" for m in modes) + " | ovl - seq ms |",
             "| --- " * (2 * len(modes) + 2) + "|"]
    for name in sorted(names, key=lambda n: -abs(gap(n)))[:top]:
        cells = []
        for mode in modes:
            calls, ms = rows[mode].get(name, (None, None))
            cells += ["-", "-"] if calls is None else [str(calls), f"{ms:.2f}"]
        lines.append(f"| {name[:60]} | " + " | ".join(cells) + f" | {gap(name):+.2f} |")
    return lines


def markdown(all_results: list, world: int) -> str:
    lines = ["| shape | graphs | T_comm/T_comp | T_seq ms | T_ovl ms | T_ovl+wgrad ms | "
             "T_comp ms | T_comm ms | T_seq/T_ovl | T_seq/T_wgrad | T_ovl/max | T_wgrad/max | "
             "realized ovl | realized wgrad | peak reserved seq/ovl/wgrad GiB | graph GiB |",
             "| --- " * 16 + "|"]
    f = lambda x: f"{x:.2f}"  # noqa: E731
    for r in all_results:
        d = r["derived"]
        for s, label in ROW_LABELS.items():
            if "seq" + s not in r:
                continue
            lines.append(" | ".join([
                f"| {r['shape']}", label, f(d["ratio" + s]),
                f(r["seq" + s]["fb_ms"]), f(r["ovl" + s]["fb_ms"]),
                f(r["ovl_wgrad" + s]["fb_ms"]), f(r["comp" + s]["fb_ms"]),
                f(comm_ms(r, s)), f(d[f"seq_over_ovl{s}"]), f(d[f"seq_over_ovl_wgrad{s}"]),
                f(d[f"ovl{s}_over_ideal"]), f(d[f"ovl_wgrad{s}_over_ideal"]),
                f(d[f"realized_ovl{s}"]), f(d[f"realized_ovl_wgrad{s}"]),
                f"{r['seq' + s]['peak_reserved_gib']:.1f}/{r['ovl' + s]['peak_reserved_gib']:.1f}/"
                f"{r['ovl_wgrad' + s]['peak_reserved_gib']:.1f}",
                f(r["ovl_wgrad" + s].get("graph_gib", 0.0))]) + " |")
    for r in all_results:
        lines += api_profile_table(r)
    graphed = [r for r in all_results if "seq_graph" in r]
    if graphed:
        lines += ["", "| shape | eager T_seq / graphed T_ovl | eager T_seq / graphed T_wgrad | "
                  "1-mb activations GiB | tok/s/GPU eager seq | tok/s/GPU graphed ovl+wgrad |",
                  "| --- " * 6 + "|"]
        for r in graphed:
            d = r["derived"]
            lines.append(f"| {r['shape']} | {f(d['eager_seq_over_graph_ovl'])} | "
                         f"{f(d['eager_seq_over_graph_ovl_wgrad'])} | "
                         f"{f(d['one_mb_activations_gib'])} | "
                         f"{r['seq']['tokens_per_s_per_gpu'] / 1e3:.1f}k | "
                         f"{r['ovl_wgrad_graph']['tokens_per_s_per_gpu'] / 1e3:.1f}k |")
    profiled = [r for r in all_results if "timeline" in r]
    if profiled:
        lines += ["", "| profiled shape | mode | bench fb ms | profiled step ms | bench exposed "
                  "(T_mode - T_comp) ms | timeline exposed ms (mean / worst rank) | timeline "
                  "net exposed (mode - comp) ms | timeline comm ms | compute ms (waits apart) | "
                  "compute slowdown vs seq | compute wait ms | comm slowdown vs seq | "
                  "comm lane busy share |", "| --- " * 13 + "|"]
    def slowdown(figures, key):  # against seq; "-" where there is no seq to compare with
        return f"{figures[key]:.3f}" if figures.get(key) else "-"
    for r in profiled:
        comp_exposed = r["timeline"].get("comp", {}).get("exposed_ms")
        for mode, t in r["timeline"].items():
            bench = f"{r[mode]['fb_ms'] - r['comp']['fb_ms']:.2f}"
            net = f"{t['exposed_ms'] - comp_exposed:.2f}" if comp_exposed is not None else "-"
            compute = f"{t['compute_ms']:.2f}" if "compute_ms" in t else "-"
            lines.append(f"| {r['shape']} | {mode} | {r[mode]['fb_ms']:.2f} | {t['step_ms']:.2f} "
                         f"| {bench} | {t['exposed_ms']:.2f} / {t['exposed_max_rank_ms']:.2f} | "
                         f"{net} | {t['comm_ms']:.2f} | {compute} | "
                         f"{slowdown(t, 'compute_slowdown_vs_seq')} | "
                         f"{t['compute_wait_ms']:.2f} | {slowdown(t, 'comm_slowdown_vs_seq')} | "
                         f"{t['comm_busy_share']:.2f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="quick")
    parser.add_argument("--profile-shapes", default="")
    parser.add_argument("--out-dir", default="runs/bench_overlap")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every mode (and the all-to-alls' replay, T_comm) this many "
                             "times, alternating the order; report the median (for hosts whose "
                             "speed drifts between runs)")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="profiled steps per mode of the --profile-shapes")
    parser.add_argument("--torch-trace", action="store_true",
                        help="also write a torch.profiler trace of each profiled step")
    parser.add_argument("--graphs", action="store_true",
                        help="also run every mode with partial CUDA graphs (GPU only)")
    parser.add_argument("--max-ctas", default="default",
                        help="comma list of NCCL CTA budgets for the expert-parallel "
                             "communicator to sweep: 'default' (NCCL's) or a count, e.g. "
                             "default,16,8,2 (--moe-a2a-nccl-max-ctas; GPU only)")
    parser.add_argument("--min-ctas", type=int, default=None,
                        help="--moe-a2a-nccl-min-ctas beside every --max-ctas value")
    parser.add_argument("--extra-flags", default="",
                        help="training flags for every mode, one string, e.g. "
                             "\"--comm-stream-priority normal\"")
    parser.add_argument("--sync-free", action="store_true",
                        help="also run every mode with the budget dispatch (--moe-dispatch-budget "
                             "1.25), eager and as one full-iteration graph (GPU only), each "
                             "a row of the table with its own T_comp and the budget's own "
                             "T_comm; the budget's overflows are counted")
    parser.add_argument("--host-nodes", action="store_true",
                        help="also time --iters more steps per mode with the host wall time of "
                             "every node action (bench_host's per-node table), per rank, into "
                             "the JSON (host_nodes)")
    parser.add_argument("--python-profile", type=int, default=0, metavar="TOP",
                        help="also run one step per mode with rank 0 under cProfile: the TOP "
                             "functions by own time go into the JSON (python_profile)")
    parser.add_argument("--api-profile", type=int, default=0, metavar="TOP",
                        help="also run one step per mode with rank 0 under torch.profiler "
                             "(CPU ops and CUDA runtime calls): the TOP names by host self "
                             "time go into the JSON (api_profile) and a table per shape")
    args = parser.parse_args(argv)
    args.profile_shapes = [s for s in args.profile_shapes.split(",") if s]
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.extra = shlex.split(args.extra_flags)
    return args


def checked_probe(args, world: int):
    """The config of the first shape with the extra flags and each budget's flags, checked as
    the training command checks them (the last one is returned); None after printing the one
    line of a bad value (argparse prints its own)."""
    try:
        for budget in args.budgets:
            probe = parse_config(SHAPES[args.shapes[0]] + COMMON + OVERLAP + args.extra +
                                 budget_flags(budget) +
                                 ["--expert-model-parallel-size", str(world)])
            validate_config(probe, world, torch.cuda.is_available())
    except (ConfigError, SystemExit) as error:
        if os.environ.get("RANK", "0") == "0" and isinstance(error, ConfigError):
            print(f"bench_overlap: error: {error}", file=sys.stderr)
        return None
    return probe


def input_error(args, world: int) -> Optional[str]:
    """The one line for arguments this run cannot take (None: none)."""
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        return f"bench_overlap: unknown shape(s) {unknown}; known: {', '.join(SHAPES)}"
    if (args.graphs or args.sync_free) and not torch.cuda.is_available():
        return "bench_overlap: --graphs needs a CUDA device (CUDA graphs); none is visible here"
    try:
        args.budgets = parse_budgets(args.max_ctas, args.min_ctas)
    except ValueError as error:
        return f"bench_overlap: error: {error}"
    if world < 2:
        return ("bench_overlap: needs 2+ ranks (the overlap hides an all-to-all between them): "
                "run it under torchrun, e.g. torchrun --standalone --nproc-per-node 2 "
                "-m", "benchmarks.harness.bench_overlap")
    return None


def write_results(out_dir: str, world: int, results: list) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, "bench_overlap.json").write_text(json.dumps(
        {"world": world, "nccl_env": nccl_environment(), "results": results}, indent=2,
        default=str))


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    error = input_error(args, world)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    probe = checked_probe(args, world)
    if probe is None:
        return 2
    setup_environment(probe, print)
    groups = init_distributed(world, "cuda" if torch.cuda.is_available() else "cpu")
    log = print if groups.rank == 0 else (lambda msg: None)
    all_results = []
    try:
        for budget in args.budgets:  # fresh EP groups for each budget but NCCL's default
            budget_groups = groups if budget.is_default else expert_parallel_groups(
                world, groups.device, groups.local_rank, watch=groups.watch, ep_budget=budget)
            for name in args.shapes:
                result = bench_shape(name, budget_groups, args, log, budget)
                result["derived"] = derived(result)
                all_results.append(result)
                if groups.rank == 0:  # after every shape: a run cut short keeps what it did
                    write_results(args.out_dir, world, all_results)
    finally:
        destroy_distributed(groups)
    if groups.rank == 0:
        p2p = os.environ.get("NCCL_P2P_DISABLE", "0")
        print(f"\nbench_overlap: {world} rank(s), "
              f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
              f"NCCL_P2P_DISABLE={p2p}; {nccl_environment_text(nccl_environment())}")
        print(markdown(all_results, world))
    return 0


if __name__ == "__main__":
    sys.exit(main())
