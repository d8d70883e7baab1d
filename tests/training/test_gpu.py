"""GPU tier (markers `gpu`, `multigpu`; skipped without CUDA): streams and events keep the
overlap bit-exact on one GPU; bf16 training runs; the 2+ GPU bitwise contract over NCCL."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from dist_helpers import one_process_model
from epoverlap.config.resolve import SEQUENTIAL_FLAG

# strict --deterministic-mode needs cuBLAS's fixed workspace, set before cuBLAS starts
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
from gpu_runs import REPO, gpu_env as _env, identical_losses as _identical, needs_gpu, needs_gpus
from gpu_runs import train_cli as _train


def _single_gpu_grads(lanes_kind: str, delay: bool, graphs: bool = False, recorder=None):
    """Grads of one step of a 3-layer bf16 model on one GPU (EP=1: the all-to-alls are local
    copies on the comm lane). With `graphs`, an eager recording step, the capture, then the
    measured step replays partial CUDA graphs of attn, moe_router and moe_preprocess. With a
    `recorder` (a SpanRecorder), the measured step's spans are recorded (step 1)."""

    from epoverlap.config import parse_config
    from epoverlap.graphs.capture import GraphRunner
    from epoverlap.schedule.executor import CudaStreamLanes, Executor, SerialLanes
    from epoverlap.schedule.pipeline import build_plan

    torch.use_deterministic_algorithms(True)
    cfg = parse_config(["--num-layers", "3", "--hidden-size", "256", "--num-attention-heads",
                        "4", "--seq-length", "128", "--num-experts", "8", "--moe-router-topk",
                        "2", "--moe-ffn-hidden-size", "256", "--moe-first-k-dense-replace", "1",
                        "--moe-shared-expert-intermediate-size", "128", "--bf16",
                        "--num-microbatches", "4", "--moe-aux-loss-coeff", "0.01"])
    device = torch.device("cuda")
    model, queue, grads = one_process_model(cfg, "triton", torch.bfloat16, device, delay)
    lanes = CudaStreamLanes(device) if lanes_kind == "streams" else SerialLanes()
    plan = build_plan("combined_1f1b" if lanes_kind == "streams" else "sequential",
                      model.layout(), 4, delay)
    runner = (GraphRunner(model.node_specs(), {"attn", "moe_router", "moe_preprocess"},
                          device=device, queue=queue, check_inputs=True) if graphs else None)
    executor = Executor(model.node_specs(), lanes, queue, recorder,
                        **({"run_factory": runner} if runner else {}))

    def data(seed):
        gen = torch.Generator().manual_seed(seed)
        return [{"tokens": torch.randint(0, 256, (2, 128), generator=gen).to(device),
                 "labels": torch.randint(0, 256, (2, 128), generator=gen).to(device)}
                for _ in range(4)]
    try:
        if runner is not None:
            runner.recording = True
            executor.run(plan, data(1), 0.25)
            runner.recording = False
            runner.capture(plan)
            assert runner.graph_count() >= 2 * 3 * 4
        grads.zero()
        if recorder is not None:
            recorder.begin_step(1)
        losses = executor.run(plan, data(0), 0.25)
        if recorder is not None:
            recorder.end_step()
        torch.cuda.synchronize()
        return (torch.stack(losses).float().cpu(), grads.dense_flat.cpu(),
                grads.expert_flat.cpu())
    finally:
        if runner is not None:
            runner.release()
        lanes.close()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("delay", [False, True])
def test_streams_and_events_keep_one_gpu_bitwise(delay):
    reference = _single_gpu_grads("serial", False)
    got = _single_gpu_grads("streams", delay)
    for a, b in zip(reference, got):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_gpu
def test_stream_spans_time_the_wait_apart_from_the_run(tmp_path):
    """Two streams, one event per microbatch: every span's queued mark precedes its start, and
    each F/B node starts after the previous node of its microbatch ended (its start event
    follows the stream's wait_event), whichever lane that node ran on; the file reads back."""
    from epoverlap.profiling.recorder import SpanRecorder
    from epoverlap.cli import timeline
    recorder = SpanRecorder(torch.device("cuda"), 0, 1)
    _single_gpu_grads("streams", True, recorder=recorder)
    spans = recorder.steps[-1].spans
    assert spans and {s.lane for s in spans} == {"compute", "comm"}
    assert all(s.queued_us is not None and s.queued_us <= s.start_us <= s.end_us for s in spans)
    for microbatch in {s.microbatch for s in spans}:
        chain = [s for s in spans if s.microbatch == microbatch and s.phase != "wgrad"]
        for before, after in zip(chain, chain[1:]):
            assert after.start_us >= before.end_us - 1.0, (before, after)  # event resolution
    recorder.write(str(tmp_path))
    assert timeline.main([str(tmp_path), "--no-png"]) == 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lanes_kind, delay", [("serial", False), ("streams", False),
                                               ("streams", True)])
def test_partial_cuda_graphs_replay_bitwise_like_eager_on_one_gpu(lanes_kind, delay):
    """Graphs of attn + moe_router + moe_preprocess per (layer, microbatch, phase), captured
    in plan order, under the sequential plan and the combined 1F1B on two streams (with and
    without the delayed-wgrad graphs): the same losses and grads as the eager run."""
    eager = _single_gpu_grads(lanes_kind, delay)
    graphed = _single_gpu_grads(lanes_kind, delay, graphs=True)
    for a, b, what in zip(eager, graphed, ("losses", "dense grads", "expert grads")):
        assert torch.equal(a, b), what


@pytest.mark.gpu
@needs_gpu
def test_bf16_training_on_one_gpu_reduces_the_loss(tmp_path):
    """The default path on one GPU (EP 1, sequential, the partial CUDA graphs), bf16."""
    log = tmp_path / "log.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "-m", "epoverlap.train", "--preset", "tiny", "--bf16", "--train-iters", "15",
         "--log-json", str(log)], capture_output=True, text=True, timeout=600, env=_env(),
        cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


@pytest.mark.multigpu
@needs_gpus
def test_overlap_bitwise_over_nccl(tmp_path):
    """All modes (overlap, delayed wgrad, early release) equal sequential bit for bit."""
    out = tmp_path / "bitwise.json"
    nproc = torch.cuda.device_count()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", "-m", "benchmarks.harness.check_bitwise", "--steps", "20",
         "--out", str(out)], capture_output=True, text=True, timeout=900, env=_env(), cwd=REPO)
    print(result.stdout[-3000:])
    assert out.exists(), result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    bad = [r for r in rows if not (r["grads_bitwise_equal"] and r["losses_identical"])]
    assert not bad, bad
    assert result.returncode == 0


GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router",
          "moe_preprocess"]
# the sequential schedule and eager steps, pinned: on CUDA the defaults are the overlap (EP > 1)
# and the partial graphs
SEQUENTIAL = [SEQUENTIAL_FLAG]
EAGER = ["--cuda-graph-impl", "none"]


@pytest.mark.gpu
@needs_gpu
def test_graphed_sequential_run_on_one_gpu_equals_eager_bitwise(tmp_path):
    flags = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "12",
             *SEQUENTIAL]
    _, eager = _train(tmp_path, "eager_1gpu", 1, flags + EAGER)
    out, graphed = _train(tmp_path, "graphs_1gpu", 1, flags + GRAPHS +
                          ["--cuda-graph-check-inputs"])
    assert "CUDA graphs: " in out and " captured after step 3" in out
    assert _identical(eager, graphed)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("extra", [
    EAGER,
    GRAPHS,
    # fixed blocks whose padding rows the grouped GEMMs leave unwritten, a rerun every step
    # (half the rows), and one graph over the whole step
    ["--moe-dispatch-budget", "0.5", "--cuda-graph-impl", "full_iteration"],
], ids=["eager", "partial_graphs", "budget_full_iteration"])
def test_cli_runs_with_and_without_the_fill_of_new_memory_are_bitwise_on_one_gpu(tmp_path,
                                                                                  extra):
    """--deterministic-mode leaves torch's fill of new memory off: a run with the fill (every
    new tensor NaN or the largest integer until written) and one without (whatever the caching
    allocator hands back) give the same losses, so no result reads memory nothing wrote."""
    flags = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "10",
             "--kernel-backend", "triton", *extra]
    _, unfilled = _train(tmp_path, "unfilled", 1, flags)
    _, filled = _train(tmp_path, "filled", 1,
                       flags + ["--deterministic-fill-uninitialized-memory"])
    assert all(math.isfinite(r["loss"]) for r in filled)
    assert _identical(unfilled, filled)


FUSED_LOSS_VOCAB = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"]


@pytest.mark.gpu
@needs_gpu
def test_cli_with_the_fused_loss_is_bitwise_on_one_gpu(tmp_path):
    """A vocabulary the fused cross-entropy takes (32001 >= FUSED_MIN_VOCAB): the training
    command twice, and eager against the partial CUDA graphs, bitwise under
    --deterministic-mode (bf16, optimizer on); the first loss near log(V), as from random
    logits (at init std 0.02: the tiny preset's 0.1 makes logits wide enough to start near 11)."""
    from epoverlap.kernels.cross_entropy_triton import FUSED_MIN_VOCAB

    assert 32001 >= FUSED_MIN_VOCAB
    flags = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "12",
             "--kernel-backend", "triton", "--init-method-std", "0.02", *FUSED_LOSS_VOCAB]
    _, first = _train(tmp_path, "fused_loss", 1, flags + EAGER)
    _, again = _train(tmp_path, "fused_loss_again", 1, flags + EAGER)
    _, graphed = _train(tmp_path, "fused_loss_graphs", 1, flags + GRAPHS)
    assert abs(first[0]["loss"] - math.log(32001)) < 0.5, first[0]["loss"]
    assert _identical(first, again) and _identical(first, graphed)


@pytest.mark.gpu
@needs_gpu
def test_padded_and_unpadded_vocabulary_train_alike_on_one_gpu(tmp_path):
    """NullTokenizer's 32001 padded to 32128 (the default) and unpadded: the same initial real
    weights, losses within bf16 rounding (the logit GEMMs take other kernels, the loss leaves
    the padding out); the padded run names no unaligned GEMM, the unpadded one its vocabulary."""
    flags = ["--preset", "tiny", "--bf16", "--train-iters", "4", "--kernel-backend", "triton",
             *FUSED_LOSS_VOCAB, *EAGER, *SEQUENTIAL]
    out_padded, padded = _train(tmp_path, "padded", 1, flags)
    out_plain, plain = _train(tmp_path, "unpadded", 1,
                              flags + ["--make-vocab-size-divisible-by", "1"])
    assert "unaligned GEMMs" not in out_padded
    assert "unaligned GEMMs: vocabulary 32001" in out_plain
    for a, b in zip(padded, plain, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=2.0 ** -8), (a["step"], a, b)


@pytest.mark.gpu
@needs_gpu
def test_overlap_with_the_fused_loss_is_bitwise_the_sequential_schedule():
    """The combined 1F1B with delayed wgrad (two CUDA streams, EP 1) against the sequential
    schedule at a vocabulary the fused cross-entropy takes: the same losses, bit for bit."""
    from epoverlap.parallel.groups import init_distributed

    torch.use_deterministic_algorithms(True)
    flags = ["--preset", "tiny", "--bf16", "--train-iters", "6", "--log-interval", "100",
             *FUSED_LOSS_VOCAB, *EAGER]
    losses = {}
    for name, extra in (("seq", SEQUENTIAL), ("ovl", ["--overlap-moe-expert-parallel-comm",
                                              "--delay-wgrad-compute"])):
        with mock.patch.dict(os.environ):  # init_distributed sets RANK, MASTER_PORT, ...
            results = _train_in_process(init_distributed(1, "cuda"), flags + extra)
        losses[name] = [float.hex(r.loss) for r in results]
    assert len(losses["seq"]) == 6 and losses["seq"] == losses["ovl"]


def _probe_run(device_kind: str, probe_steps: int, graphs: bool = False) -> list:
    """Ten steps (twelve with `graphs`: the partial CUDA graphs, two warm-up steps) of a small
    bf16 model on one process, the combined 1F1B with delayed wgrad and the optimizer on,
    probed against the sequential schedule over `probe_steps` steps each (the deprecated
    --overlap-probe-steps: the tuner over those two paths; 0: --tune off, never). EP 1: the
    all-to-alls are local copies on the comm lane; the training command refuses the overlap at
    EP 1 (nothing to hide), the trainer does not check."""
    from epoverlap.parallel.groups import init_distributed

    torch.use_deterministic_algorithms(True)
    flags = ["--preset", "tiny", "--mock-data", "--train-iters", "12" if graphs else "10",
             "--log-interval", "100", "--overlap-moe-expert-parallel-comm",
             "--delay-wgrad-compute", *(["--overlap-probe-steps", str(probe_steps)]
                                        if probe_steps else ["--tune", "off"])]
    flags += (GRAPHS + ["--cuda-graph-warmup-steps", "2"]) if graphs else EAGER
    flags += ["--bf16"] if device_kind == "cuda" else ["--kernel-backend", "torch"]
    with mock.patch.dict(os.environ):  # init_distributed sets RANK, MASTER_PORT, ...
        return _train_in_process(init_distributed(1, device_kind), flags)


def _train_in_process(groups, flags: list) -> list:
    """`Trainer.train()` of `flags` (parsed, not validated) on `groups`, torn down after."""
    from epoverlap.config import parse_config
    from epoverlap.parallel.groups import destroy_distributed
    from epoverlap.training.loop.trainer import Trainer

    try:
        trainer = Trainer(parse_config(flags), groups, log=lambda message: None)
        try:
            return trainer.train()
        finally:
            trainer.close()
    finally:
        destroy_distributed(groups)


@pytest.mark.gpu
@needs_gpu
def test_overlap_probe_switches_cuda_lanes_mid_run_bitwise():
    """The probe hands the executor two CUDA streams with events (the combined 1F1B) and serial
    lanes (sequential) in turn mid-run; every step's loss equals the never-probed run's."""
    fixed, probed = _probe_run("cuda", 0), _probe_run("cuda", 3)
    assert [r.path for r in probed][:7] == ["combined_1f1b"] + [
        "combined_1f1b", "sequential"] * 3
    assert len({r.path for r in probed[7:]}) == 1
    assert [float.hex(r.loss) for r in probed] == [float.hex(r.loss) for r in fixed]


@pytest.mark.gpu
@needs_gpu
def test_overlap_probe_with_partial_graphs_replays_each_schedules_own_bank_bitwise():
    """With the partial CUDA graphs each schedule captures its own bank (the overlap's after
    the warm-up, the sequential one's in an untimed step) and the probe times replays of
    both, streams and events against serial lanes; every loss equals the never-probed
    graphed run's."""
    fixed, probed = _probe_run("cuda", 0, graphs=True), _probe_run("cuda", 3, graphs=True)
    assert [r.path for r in probed][:9] == ["combined_1f1b", "combined_1f1b",
                                                "sequential"] + [
        "combined_1f1b", "sequential"] * 3
    assert len({r.path for r in probed[9:]}) == 1
    assert [float.hex(r.loss) for r in probed] == [float.hex(r.loss) for r in fixed]


@pytest.mark.multigpu
@needs_gpus
def test_cli_probe_run_is_bitwise_the_sequential_run(tmp_path):
    """The training command with --overlap-probe-steps over NCCL (bf16, optimizer on, delayed
    wgrad, --deterministic-mode): it switches schedules at steps 2-7, says which it keeps, and
    its losses are the sequential run's bit for bit."""
    nproc = torch.cuda.device_count()
    flags = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "12",
             "--expert-model-parallel-size", str(nproc), *EAGER]
    _, sequential = _train(tmp_path, "probe_reference", nproc, flags + SEQUENTIAL)
    out, probed = _train(tmp_path, "probe", nproc, flags + [
        "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
        "--overlap-probe-steps", "3"])
    assert "tune: steps 2-7, " in out, out[-3000:]
    assert [r["path"] for r in probed][1:7] == ["combined_1f1b", "sequential"] * 3
    assert _identical(sequential, probed)


@pytest.mark.multigpu
@needs_gpus
def test_cli_probe_with_partial_graphs_is_bitwise_the_sequential_run(tmp_path):
    """The same with the partial CUDA graphs (two warm-up steps): the overlap's graphs are
    captured at step 2, the sequential schedule's at step 3 (untimed), steps 4-9 alternate
    replays, the loser's graphs are released; the losses are the eager sequential run's."""
    nproc = torch.cuda.device_count()
    flags = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "12",
             "--expert-model-parallel-size", str(nproc)]
    _, sequential = _train(tmp_path, "probe_graphs_reference", nproc,
                           flags + SEQUENTIAL + EAGER)
    out, probed = _train(tmp_path, "probe_graphs", nproc, flags + GRAPHS + [
        "--cuda-graph-warmup-steps", "2", "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute", "--overlap-probe-steps", "3"])
    assert "tune: steps 4-9, " in out, out[-3000:]
    assert "tune: the other paths' CUDA graphs released" in out
    assert [r["path"] for r in probed][:9] == ["combined_1f1b", "combined_1f1b",
                                                   "sequential"] + [
        "combined_1f1b", "sequential"] * 3
    assert _identical(sequential, probed)


@pytest.mark.multigpu
@needs_gpus
def test_cli_runs_are_bitwise_identical_under_deterministic(tmp_path):
    """The path users run (CLI, bf16, optimizer on, Triton kernels, 2 ranks, real text and the
    learned router): the same command twice, and sequential vs overlap vs overlap + delayed
    wgrad vs the same with CUDA graphs (also with torch's fill of new memory) vs the
    paired-ends plan with the grouped GEMMs' SM carveout, all bitwise identical under
    --deterministic; and no
    Triton compile after the warmup steps although every step routes differently."""
    steps = os.environ.get("EPOVERLAP_GPU_STEPS", "30")
    base = ["--preset", "small", "--bf16", "--deterministic-mode", "--train-iters", steps,
            "--expert-model-parallel-size", "2", "--kernel-backend", "triton", "--seed", "3"]
    overlap = ["--overlap-moe-expert-parallel-comm"]
    wgrad = overlap + ["--delay-wgrad-compute"]
    paired_carved = wgrad + ["--overlap-plan", "combined_1f1b_paired_ends",
                             "--moe-grouped-gemm-sm-carveout", "8"]
    runs = {"seq": SEQUENTIAL + EAGER, "seq_again": SEQUENTIAL + EAGER, "ovl": overlap + EAGER,
            "ovl_wgrad": wgrad + EAGER, "ovl_wgrad_graphs": wgrad + GRAPHS,
            "seq_graphs": SEQUENTIAL + GRAPHS, "paired_ends_carveout": paired_carved + EAGER,
            # torch's fill of new memory on: no result reads memory nothing wrote
            "ovl_wgrad_graphs_filled": wgrad + GRAPHS + [
                "--deterministic-fill-uninitialized-memory"]}
    logs, outs = {}, {}
    for name, extra in runs.items():
        outs[name], logs[name] = _train(tmp_path, name, 2, base + extra)
    assert all(r["deterministic"] for records in logs.values() for r in records)
    differing = [name for name in runs if not _identical(logs["seq"], logs[name])]
    assert not differing, differing
    for name, out in outs.items():
        assert "after the 3 warmup steps: 0" in out, (name, out[-2000:])
        variants = [r["triton_variants"] for r in logs[name]]
        assert len(set(variants[3:])) == 1, (name, variants)


@pytest.mark.multigpu
@needs_gpus
def test_cli_once_per_rank_dispatch_is_bitwise_across_schedules_on_two_gpus(tmp_path):
    """--moe-dispatch-once-per-rank on the path users run (CLI, bf16, Triton, 2 GPUs, top-4
    of 16 experts, so most tokens have several experts on a rank): sequential, overlap +
    delayed wgrad, the same with the partial graphs, and the paired ends with the carveout
    give the same loss bits; against the dispatch per expert the losses differ by the
    combine's rounding order only."""
    steps = os.environ.get("EPOVERLAP_GPU_STEPS", "20")
    base = ["--preset", "small", "--bf16", "--deterministic-mode", "--train-iters", steps,
            "--expert-model-parallel-size", "2", "--kernel-backend", "triton", "--seed", "5",
            "--moe-router-topk", "4"]
    once = base + ["--moe-dispatch-once-per-rank"]
    wgrad = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    runs = {"per_expert": base + SEQUENTIAL + EAGER, "once_seq": once + SEQUENTIAL + EAGER,
            "once_ovl_wgrad": once + wgrad + EAGER,
            "once_ovl_wgrad_graphs": once + wgrad + GRAPHS,
            "once_paired_ends_carveout": once + wgrad + EAGER + [
                "--overlap-plan", "combined_1f1b_paired_ends",
                "--moe-grouped-gemm-sm-carveout", "8"]}
    logs = {name: _train(tmp_path, name, 2, flags)[1] for name, flags in runs.items()}
    differing = [name for name in runs if name.startswith("once")
                 and not _identical(logs["once_seq"], logs[name])]
    assert not differing, differing
    once_losses = [r["loss"] for r in logs["once_seq"]]
    plain_losses = [r["loss"] for r in logs["per_expert"]]
    assert len(once_losses) == len(plain_losses) == int(steps)
    assert once_losses[0] == pytest.approx(plain_losses[0], rel=2e-3)
    assert once_losses == pytest.approx(plain_losses, rel=2e-2)


@pytest.mark.multigpu
@needs_gpus
def test_simulator_replays_a_recorded_overlapped_run(tmp_path):
    """2 GPUs, the f128 ratio shape, overlapped: record 3 steps' spans, replay them with the
    simulator (recorded compute and comm, host launch costs read from the same recording's
    gaps, each rank's host time before its first action as recorded). benchmarks/scale.md
    measured -1% on a run of this shape; 15% is the bound."""
    from epoverlap.cli import simulate as sim
    from benchmarks.harness.bench_overlap import COMMON, SHAPES
    spans = tmp_path / "spans"
    flags = SHAPES["ratio_h2048_k8_f128"] + COMMON + EAGER + [
        "--bf16", "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm",
        "--train-iters", "6", "--profile-steps", "4:6", "--profile-dir", str(spans)]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "epoverlap.train", *flags], capture_output=True, text=True, timeout=600,
        env=_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    keep = os.environ.get("EPOVERLAP_GPU_LOGS")
    if keep:  # the device suite keeps the recording, to replay it again on a CPU
        shutil.copytree(spans, Path(keep) / "simulator_spans", dirs_exist_ok=True)
    scenario = sim.build_scenario(sim.parse_args(
        ["--spans", str(spans), "--link", "measured", "--host-from", str(spans), "--",
         *SHAPES["ratio_h2048_k8_f128"], "--bf16"]))
    rows = sim.replay_steps(scenario)
    assert [row["mode"] for row in rows] == ["ovl"] * 3
    measured = sum(row["measured_ms"] for row in rows)
    simulated = sum(row["simulated_ms"] for row in rows)
    assert abs(simulated / measured - 1) < 0.15, rows
