"""GPU tier of the sync-free dispatch (markers `gpu`, `multigpu`; skipped without CUDA): the
budget and padded-capacity dispatch read nothing on the host; graphs of the whole MoE layer and
of the whole iteration (overlap on or off) are captured for real and replay bitwise like eager;
over NCCL, the CLI runs with a budget that overflows rerun through a second graph bank and give
the eager losses bit for bit."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

from dist_helpers import one_process_model
from epoverlap.config.resolve import SEQUENTIAL_FLAG
from gpu_runs import identical_losses as _identical, needs_gpu, needs_gpus
from gpu_runs import train_cli as _train

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
BUDGET = ["--moe-dispatch-budget", "1.0"]
# the sequential schedule and eager steps, pinned: on CUDA the defaults are the overlap (EP > 1)
# and the partial graphs
SEQUENTIAL = [SEQUENTIAL_FLAG]
EAGER = ["--cuda-graph-impl", "none"]
PADDED = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
MODEL = ["--num-layers", "3", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "128", "--num-experts", "8", "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "256", "--moe-first-k-dense-replace", "1",
         "--moe-shared-expert-intermediate-size", "128", "--bf16", "--num-microbatches", "4",
         "--moe-aux-loss-coeff", "0.01"]


def _parts(flags, one_node=False, delay=False):
    from epoverlap.config import parse_config
    torch.use_deterministic_algorithms(True)
    return one_process_model(parse_config(MODEL + flags), "triton", torch.bfloat16, "cuda",
                             delay, one_node)


def _data(seed, seq=128):
    gen = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, 256, (2, seq), generator=gen).cuda(),
             "labels": torch.randint(0, 256, (2, seq), generator=gen).cuda()}
            for _ in range(4)]


def _measure(run, grads, seed=0, seq=128):
    grads.zero()
    losses = run(_data(seed, seq))
    torch.cuda.synchronize()
    return torch.stack(losses).float().cpu(), grads.dense_flat.cpu(), grads.expert_flat.cpu()


def _record(bank, run, grads, seq=128):
    """Two warmup steps (Triton compiles, cuBLAS), the second one recording."""
    for _ in range(2):
        bank.recording = True
        _measure(run, grads, seed=1, seq=seq)
    bank.recording = False


def _run(flags, graphs=None, lanes_kind="serial", delay=False):
    """One measured step on one GPU: eager (graphs None), per-layer graphs of the modules in
    `graphs` (a tuple; MoE layers as one node when they reach past the dispatch), or "full"."""
    from epoverlap.graphs.capture import GraphRunner, graphed_modules, graphs_span_moe_layer
    from epoverlap.graphs.full_iteration import FullIterationGraph
    from epoverlap.schedule.executor import CudaStreamLanes, Executor, SerialLanes
    from epoverlap.schedule.pipeline import build_plan

    one_node = isinstance(graphs, tuple) and graphs_span_moe_layer("local", graphs)
    model, queue, grads = _parts(flags, one_node, delay)
    lanes = CudaStreamLanes(torch.device("cuda")) if lanes_kind == "streams" else SerialLanes()
    plan = build_plan("combined_1f1b" if lanes_kind == "streams" else "sequential",
                      model.layout(), 4, delay)
    runner = (GraphRunner(model.node_specs(), graphed_modules(graphs), device=torch.device("cuda"),
                          queue=queue, check_inputs=True) if isinstance(graphs, tuple) else None)
    executor = Executor(model.node_specs(), lanes, queue,
                        **({"run_factory": runner} if runner else {}))
    full = (FullIterationGraph(executor, plan, 0.25, device=torch.device("cuda"))
            if graphs == "full" else None)
    bank = runner or full
    run = full.run if full else (lambda data: executor.run(plan, data, 0.25))
    try:
        if bank is not None:
            _record(bank, run, grads)
            bank.capture(plan)
            assert bank.graph_count() >= 1
        return _measure(run, grads)
    finally:
        if bank is not None:
            bank.release()
        lanes.close()


def _assert_bitwise(eager, graphed):
    for a, b, what in zip(eager, graphed, ("losses", "dense grads", "expert grads")):
        assert torch.equal(a, b), what


@contextlib.contextmanager
def _host_syncs_raise():
    """torch's sync debug mode "error" (device-to-host copies, `.item()`, `.tolist()`, stream and
    device syncs issued inside aten), plus the waits it does not see: `Event.synchronize`,
    `Stream.synchronize` and `torch.cuda.synchronize` called from Python. Our host reads wait on
    an event after a pinned copy (`watch.host_list`, `SplitExchange.read`), which the debug
    mode alone lets through: the dropless control below then passed unseen."""
    def refuse(what):
        def call(*args, **kwargs):
            raise RuntimeError(f"{what}: the host would synchronize with the GPU here")
        return call
    with contextlib.ExitStack() as stack:
        for owner, name in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
                            (torch.cuda, "synchronize")):
            stack.enter_context(mock.patch.object(owner, name,
                                                  refuse(f"{getattr(owner, '__name__', owner)}"
                                                         f".{name}")))
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _moe_layer_pass_without_host_reads(flags):
    """Forward and backward of a one-node MoE layer with every host synchronization raising
    (`_host_syncs_raise`)."""
    model, _, _ = _parts(flags, one_node=True)
    layer = next(layer for layer in model.transformer_layers() if layer.is_moe)
    spec = layer.node_specs()[0]
    hidden = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    spec.fn(hidden=hidden)  # warm up (Triton compiles, allocations) outside the check
    torch.cuda.synchronize()
    with _host_syncs_raise():
        out = spec.fn(hidden=hidden)["layer_out"]
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return hidden.grad


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("flags", [BUDGET, PADDED], ids=["budget", "padded"])
def test_sync_free_moe_layer_reads_nothing_on_the_host(flags):
    """Any device-to-host copy or stream sync in router, permute, dispatch, experts, unsort or
    combine would raise."""
    assert torch.isfinite(_moe_layer_pass_without_host_reads(flags).float()).all()


@pytest.mark.gpu
@needs_gpu
def test_dropless_moe_layer_is_caught_reading_the_host():
    """The control: the dropless dispatch reads its split sizes, and the check sees it."""
    with pytest.raises(RuntimeError, match="synchroniz"):
        _moe_layer_pass_without_host_reads([])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("flags", [BUDGET, PADDED], ids=["budget", "padded"])
@pytest.mark.parametrize("modules", [(), ("moe",), ("attn", "moe")],
                         ids=["whole-layer", "moe", "attn-moe"])
def test_whole_moe_layer_graphs_replay_bitwise_like_eager_on_one_gpu(flags, modules):
    _assert_bitwise(_run(flags), _run(flags, graphs=modules))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lanes_kind, delay", [("serial", False), ("streams", False),
                                               ("streams", True)],
                         ids=["sequential", "overlap", "overlap-wgrad"])
@pytest.mark.parametrize("flags", [BUDGET, PADDED], ids=["budget", "padded"])
def test_full_iteration_graph_replays_bitwise_like_eager_on_one_gpu(flags, lanes_kind, delay):
    """One graph over the 4 microbatches' forward and backward; with the overlap, both streams
    inside it (the comm stream joins the capture through the executor's events)."""
    _assert_bitwise(_run(flags, lanes_kind=lanes_kind, delay=delay),
                    _run(flags, graphs="full", lanes_kind=lanes_kind, delay=delay))


@pytest.mark.gpu
@needs_gpu
def test_cli_budget_reruns_through_a_second_graph_bank_on_one_gpu(tmp_path):
    """One GPU (EP=1: every row goes to the one rank): a budget of half the rows overflows in
    every step and reruns at budget 1; whole-layer and full-iteration graphs capture a bank for
    each budget after the warmup and replay them with exactly the eager losses."""
    base = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "6",
            "--kernel-backend", "triton", "--moe-dispatch-budget", "0.5"]
    runs = {"eager": EAGER, "layer": ["--cuda-graph-impl", "local"],
            "full": ["--cuda-graph-impl", "full_iteration"]}
    outs, logs = {}, {}
    for name, extra in runs.items():
        outs[name], logs[name] = _train(tmp_path, f"bank_{name}", 1, base + extra)
    assert all(r["dispatch_reruns"] == 1 and r["dispatch_budget"] == 1 for r in logs["eager"])
    for name in ("layer", "full"):
        assert _identical(logs["eager"], logs[name]), name
        assert "CUDA graph banks by budget level: bank 0" in outs[name], outs[name][-3000:]
        assert "bank 1:" in outs[name]


@pytest.mark.gpu
@needs_gpu
def test_liveness_watch_skips_captured_collectives_and_tracks_the_replay(monkeypatch):
    """A collective captured in a CUDA graph (NCCL, one rank) is not tracked while capturing:
    its completion event could not be queried, and the monitor thread's query (polled here
    throughout the capture) would invalidate the capture and fail on every later tick. The
    replay, wrapped in `Group.watched` as the trainer does, is tracked and seen finished."""
    import threading
    import time

    from epoverlap.parallel.groups import _free_port, destroy_distributed, init_distributed
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    groups = init_distributed(1, "cuda", timeout_minutes=1)
    errors, capturing_done = [], threading.Event()

    def monitor():
        while not capturing_done.is_set():
            try:
                groups.watch.oldest_unfinished()
            except RuntimeError as error:
                errors.append(error)
            time.sleep(0.001)
    graph = torch.cuda.CUDAGraph()
    try:
        x_N = torch.ones(256, device="cuda")
        groups.ep.all_reduce(x_N)  # eager: tracked, finished
        torch.cuda.synchronize()
        poller = threading.Thread(target=monitor)
        poller.start()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            groups.ep.all_reduce(x_N)
            time.sleep(0.2)
        capturing_done.set()
        poller.join()
        assert not errors, errors[:1]
        assert groups.watch.oldest_unfinished() is None
        with groups.ep.watched("all_to_all (CUDA graph replay)"):
            graph.replay()
        assert any("CUDA graph replay" in e.where for e in groups.watch._pending)
        torch.cuda.synchronize()
        assert groups.watch.oldest_unfinished() is None and x_N[0].item() == 1.0
    finally:
        capturing_done.set()
        del graph
        torch.cuda.synchronize()
        destroy_distributed(groups)


@pytest.mark.multigpu
@needs_gpus
def test_cli_sync_free_graphs_and_budget_reruns_over_nccl(tmp_path):
    """2 GPUs, EP=2, bf16, Triton, --deterministic-mode, real text and the learned router. A
    budget of a quarter of the balanced share overflows: every step reruns, eagerly and by the
    second graph bank alike; whole-layer graphs and full-iteration graphs with the overlap give
    the eager losses bit for bit; the padded capacity the same with one bank."""
    base = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "8",
            "--expert-model-parallel-size", "2", "--kernel-backend", "triton"]
    tiny = ["--moe-dispatch-budget", "0.25"]
    overlap = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    layer = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe"]
    full = ["--cuda-graph-impl", "full_iteration"]
    runs = {"tiny": tiny + SEQUENTIAL + EAGER, "tiny_layer": tiny + SEQUENTIAL + layer,
            "tiny_ovl": tiny + overlap + EAGER, "tiny_full_ovl": tiny + overlap + full,
            "at_ranks": ["--moe-dispatch-budget", "2"] + SEQUENTIAL + EAGER,
            "padded": PADDED + SEQUENTIAL + EAGER, "padded_full_ovl": PADDED + overlap + full}
    outs, logs = {}, {}
    for name, extra in runs.items():
        outs[name], logs[name] = _train(tmp_path, name, 2, base + extra)
    for graphed, eager in (("tiny_layer", "tiny"), ("tiny_full_ovl", "tiny_ovl"),
                           ("tiny_ovl", "tiny"), ("padded_full_ovl", "padded")):
        assert _identical(logs[eager], logs[graphed]), (graphed, eager)
    assert all(r["dispatch_reruns"] >= 1 for r in logs["tiny"])
    assert all(r["dispatch_reruns"] == 0 for r in logs["at_ranks"])
    # a rerun gives what a run at its budget gives (here every rerun ends at budget 2)
    if all(r["dispatch_budget"] == 2 for r in logs["tiny"]):
        assert _identical(logs["tiny"], logs["at_ranks"])
    for name in ("tiny_layer", "tiny_full_ovl"):
        assert "CUDA graph banks by budget level" in outs[name], outs[name][-3000:]
    assert "dropped" in outs["padded"] and "CUDA graphs: 1 captured" in outs["padded_full_ovl"]


@pytest.mark.multigpu
@needs_gpus
def test_cli_once_per_rank_budget_graphs_over_nccl(tmp_path):
    """--moe-dispatch-once-per-rank with the budget (no host read in the layer): a quarter of
    the balanced share overflows, every step reruns; whole-layer graphs, and full-iteration
    graphs with the overlap, give the eager losses bit for bit (2 GPUs, bf16, Triton,
    --deterministic-mode, real text and the learned router)."""
    base = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "8",
            "--expert-model-parallel-size", "2", "--kernel-backend", "triton",
            "--moe-dispatch-once-per-rank", "--moe-dispatch-budget", "0.25"]
    overlap = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    runs = {"eager": SEQUENTIAL + EAGER,
            "layer": SEQUENTIAL + ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
                                   "moe"],
            "ovl": overlap + EAGER, "full_ovl": overlap + ["--cuda-graph-impl", "full_iteration"]}
    outs, logs = {}, {}
    for name, extra in runs.items():
        outs[name], logs[name] = _train(tmp_path, f"once_{name}", 2, base + extra)
    for graphed, eager in (("layer", "eager"), ("ovl", "eager"), ("full_ovl", "ovl")):
        assert _identical(logs[eager], logs[graphed]), (graphed, eager)
    assert all(r["dispatch_reruns"] >= 1 for r in logs["eager"])
    for name in ("layer", "full_ovl"):
        assert "CUDA graph banks by budget level" in outs[name], outs[name][-3000:]


@pytest.mark.multigpu
@needs_gpus
def test_cli_probe_with_full_iteration_graphs_is_bitwise_the_sequential_run(tmp_path):
    """--overlap-probe-steps (deprecated: the tuner over the overlap plan and sequential) with
    --cuda-graph-impl full_iteration over NCCL (2 GPUs, bf16,
    Triton, the budget dispatch, --deterministic-mode): the overlap's full-iteration graph is
    captured after the warm-up step, the sequential schedule's in one untimed step, steps 3-8
    alternate replays of the two graphs, the loser's graph is released, and every loss is the
    eager sequential run's."""
    nproc = torch.cuda.device_count()
    base = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "10",
            "--expert-model-parallel-size", str(nproc), "--kernel-backend", "triton",
            "--moe-dispatch-budget", "1.0"]
    _, sequential = _train(tmp_path, "probe_full_reference", nproc, base + SEQUENTIAL + EAGER)
    out, probed = _train(tmp_path, "probe_full", nproc, base + [
        "--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "1",
        "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
        "--overlap-probe-steps", "3"])
    assert "tune: steps 3-8, " in out, out[-3000:]
    assert "tune: the other paths' CUDA graphs released" in out
    assert [r["path"] for r in probed][:8] == ["combined_1f1b", "sequential"] + [
        "combined_1f1b", "sequential"] * 3
    assert _identical(sequential, probed)


@pytest.mark.gpu
@needs_gpu
def test_a_full_iteration_capture_holds_its_pool_not_also_its_warm_ups_blocks():
    """The warm-up run on the capture stream allocates outside the graph's pool; its blocks are
    released before the capture (`CudaGraphBackend.make_room`), so the device's reserve peaks
    at about the pool, not the pool plus a whole iteration's activations again."""
    from epoverlap.graphs.full_iteration import FullIterationGraph
    from epoverlap.schedule.executor import Executor, SerialLanes
    from epoverlap.schedule.pipeline import build_plan

    wide = BUDGET + ["--seq-length", "2048", "--hidden-size", "1024", "--num-attention-heads", "8",
                     "--moe-ffn-hidden-size", "1024"]
    model, queue, grads = _parts(wide)
    plan = build_plan("sequential", model.layout(), 4, False)
    lanes = SerialLanes()
    full = FullIterationGraph(Executor(model.node_specs(), lanes, queue), plan, 0.25,
                              device=torch.device("cuda"))
    try:
        _record(full, full.run, grads, seq=2048)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        full.capture(plan)
        peak = torch.cuda.max_memory_reserved() - before
        assert full.pool_bytes > 256 * 2**20  # a whole iteration's activations: a real test
        assert peak <= 1.3 * full.pool_bytes, (peak / 2**20, full.pool_bytes / 2**20)
    finally:
        full.release()
        lanes.close()
