"""--local-copy-hold-us: each all-to-all node holds its comm lane after its local copy
(`schedule.executor.CommHold`), so a local-copy recording's compute queues behind the comm lane
as behind a real all-to-all. Checked on CPU: the executor calls the hold once per all-to-all
action, on the comm lane's thread, inside the node's span; a training run's comm spans last at
least the hold and its span files say it was held. On a GPU (marker `gpu`): the sleep kernel
lasts about the hold."""

from __future__ import annotations

import statistics
import threading

import pytest
import torch

from epoverlap.model.nodes import COMM, COMPUTE, NodeSpec
from epoverlap.profiling.recorder import SpanRecorder
from epoverlap.profiling.spans import read_span_directory
from epoverlap.schedule import executor as executor_module

from benchmarks.harness.train_bench import main as train_bench_main
from epoverlap.schedule.executor import CommHold, Executor, SerialLanes, ThreadLanes
from epoverlap.schedule.pipeline import build_plan
from epoverlap.schedule.wgrad import WeightGradQueue

LAYERS, MICROBATCHES = 2, 2
HOLD_US = 20_000


def _toy_specs() -> list[NodeSpec]:
    def node(name, layer, lane, source, target, loss=False):
        def forward(x):
            return {"out": x.sum() if loss else x * 2}
        return NodeSpec(name, layer, lane, forward, {"x": source}, {"out": target},
                        loss="out" if loss else None)
    specs = [node("embed", None, COMPUTE, "tokens", "hidden.L0")]
    for layer in range(LAYERS):
        chain = [("attn", COMPUTE), ("dispatch", COMM), ("mlp", COMPUTE), ("combine", COMM)]
        values = [f"hidden.L{layer}"] + [f"{name}.L{layer}" for name, _ in chain[:-1]] + \
            [f"hidden.L{layer + 1}"]
        specs += [node(name, layer, lane, values[i], values[i + 1])
                  for i, (name, lane) in enumerate(chain)]
    return specs + [node("loss", None, COMPUTE, f"hidden.L{LAYERS}", "loss", loss=True)]


class _Recorder:
    """Which action is open on which thread (the span recorder's context, without clocks)."""

    def __init__(self):
        self.open: dict[int, str] = {}

    def span(self, action, lane, wait):
        recorder = self

        class _Open:
            def __enter__(self):
                wait()
                recorder.open[threading.get_ident()] = f"{action}"

            def __exit__(self, *exc):
                recorder.open.pop(threading.get_ident())
        return _Open()


@pytest.mark.parametrize("plan_name, lanes", [("sequential", SerialLanes),
                                              ("combined_1f1b", ThreadLanes)])
def test_each_all_to_all_action_holds_its_lane_inside_its_span(plan_name, lanes):
    specs, recorder, holds = _toy_specs(), _Recorder(), []

    def hold():
        thread = threading.current_thread()
        holds.append((recorder.open.get(threading.get_ident()), thread.name))
    lanes = lanes()
    layout = [tuple(s.kind for s in specs if s.layer == layer) for layer in range(LAYERS)]
    plan = build_plan(plan_name, layout, MICROBATCHES, False)
    executor = Executor(specs, lanes, WeightGradQueue(enabled=False), recorder, hold=hold)
    inputs = [{"tokens": torch.ones(3, requires_grad=True)} for _ in range(MICROBATCHES)]
    try:
        executor.run(plan, inputs, 1.0)
    finally:
        lanes.close()
    comm = [str(a) for a in plan if a.node in ("dispatch", "combine")]
    assert sorted(action for action, _ in holds) == sorted(comm)  # each once, nothing else
    comm_thread = {name for _, name in holds}
    if lanes.__class__ is ThreadLanes:
        assert all(name.startswith("epoverlap-comm") for name in comm_thread)
    else:
        assert comm_thread == {threading.current_thread().name}


def test_the_hold_sleeps_on_cpu_and_counts_cycles_on_gpu(monkeypatch):
    hold = CommHold(HOLD_US, torch.device("cpu"))
    clock = executor_module.time.perf_counter
    start = clock()
    hold()
    assert clock() - start >= HOLD_US / 1e6
    slept = []
    monkeypatch.setattr(executor_module, "_sleep_cycles_per_us", lambda device: 1500.0)
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    CommHold(4000, torch.device("cuda"))()
    assert slept == [6_000_000]


def _run(tmp_path, *extra) -> list:
    spans = tmp_path / "spans"
    assert train_bench_main(["--preset", "tiny", "--mock-data", "--train-iters", "2",
                       "--comm-mode", "local_copy", "--profile-steps", "2:2",
                       "--profile-dir", str(spans), *extra]) == 0
    return read_span_directory(spans)


def test_a_held_local_copy_run_records_its_comm_nodes_at_least_the_hold(tmp_path):
    """Lower bounds on the held spans; the unheld run's by its median (a loaded CPU stretches
    a few spans of any run)."""
    hold_us = 2 * HOLD_US
    (rank,) = _run(tmp_path / "held", "--local-copy-hold-us", str(hold_us))
    assert rank.local_copy_hold_us == hold_us
    comm = [s for s in rank.steps[0].spans if s.lane == "comm"]
    assert comm and {s.node for s in comm} == {"dispatch", "combine"}
    assert min(s.duration_us for s in comm) >= hold_us
    (free,) = _run(tmp_path / "free")  # no hold: the local copies are short, the file says 0
    assert free.local_copy_hold_us == 0.0
    assert statistics.median(s.duration_us for s in free.steps[0].spans
                             if s.lane == "comm") < hold_us / 2


def test_the_recorder_writes_the_hold_and_a_bad_one_does_not_read(tmp_path):
    recorder = SpanRecorder(torch.device("cpu"), 0, 1, local_copy_hold_us=250.0)
    recorder.begin_step(1)
    recorder.end_step()
    path = recorder.write(str(tmp_path))
    assert read_span_directory(tmp_path)[0].local_copy_hold_us == 250.0
    path.write_text(path.read_text().replace("250.0", "-1"))
    with pytest.raises(ValueError, match="local_copy_hold_us"):
        read_span_directory(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_hold_lasts_about_its_time_on_the_current_stream():
    """The cycles come from the clock timed at build: the sleep lasts about the hold."""
    hold = CommHold(HOLD_US // 4, torch.device("cuda"))
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    hold()
    end.record()
    end.synchronize()
    assert 0.8 * HOLD_US / 4e3 <= start.elapsed_time(end) <= 1.5 * HOLD_US / 4e3
