"""A CUDA graph capture that fails: where the graph scope was the auto default, the run goes on
without graphs (one line, the same bits as an eager run, tuned or not; while tuning, a failure
for want of memory turns them off at once, another drops its path first); where the flags gave
it, the run fails. One CPU process, the emulated graph backend (its capture made to raise)."""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import pytest

from epoverlap.config import parse_config
from epoverlap.config.resolve import GRAPHS_FLAG

GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router",
          "moe_preprocess", "--cuda-graph-warmup-steps", "2"]


class _CaptureFails:
    """The emulated graph backend whose every capture raises `message` (as a pool out of memory
    would, or another failure)."""

    message = "emulated out of memory"

    def __new__(cls, device):
        from graph_emulation import EmulatedGraphs

        backend = EmulatedGraphs(device)

        def capture(body, generators):
            raise RuntimeError(cls.message)
        backend.capture = capture
        return backend


class _CaptureBreaks(_CaptureFails):
    message = "emulated capture failure"


def _train(flags: list[str], auto_graphs: bool, backend=None):
    """The tiny model on one CPU process with the overlap; `auto_graphs`: the graph scope marked
    as the auto default's. -> (step results, log lines, whether graphs were left on)."""
    from graph_emulation import EmulatedGraphs

    from epoverlap.parallel.groups import destroy_distributed, init_distributed
    from epoverlap.training.loop.trainer import Trainer

    cfg = parse_config(["--preset", "tiny", "--mock-data", "--kernel-backend", "torch",
                        "--log-interval", "1", "--overlap-moe-expert-parallel-comm", *flags])
    if auto_graphs:
        cfg = dataclasses.replace(cfg, defaulted=cfg.defaulted + (GRAPHS_FLAG,))
    lines: list[str] = []
    with mock.patch.dict(os.environ):
        groups = init_distributed(1, "cpu")
        try:
            trainer = Trainer(cfg, groups, log=lines.append,
                              graph_backend=backend or EmulatedGraphs)
            try:
                results = trainer.train()
                graphs_on = trainer.parts.graph_banks is not None
            finally:
                trainer.close()
        finally:
            destroy_distributed(groups)
    return results, lines, graphs_on


def _hexes(results) -> list[str]:
    return [float.hex(r.loss) for r in results]


@pytest.mark.parametrize("tune", ["off", pytest.param("on", marks=pytest.mark.slow)])
def test_an_auto_graph_scope_whose_capture_fails_runs_on_without_graphs(tune):
    """Out of memory: the graphs go off at the first failed capture, and with the tuner no path
    is dropped (every path's graphs hold about as much), each is timed eager."""
    eager, _, _ = _train(["--train-iters", "12", "--tune", "off", "--cuda-graph-impl", "none"],
                         auto_graphs=False)
    ran, lines, graphs_on = _train(GRAPHS + ["--train-iters", "12", "--tune", tune,
                                             "--tune-steps", "1"],
                                   auto_graphs=True, backend=_CaptureFails)
    assert _hexes(ran) == _hexes(eager) and len(ran) == 12 and not graphs_on
    text = "\n".join(lines)
    assert ("the run goes on without graphs" in text and "emulated out of memory" in text
            and "--cuda-graph-impl pins one" in text), text[-3000:]
    assert text.count("the run goes on without graphs") == 1 and "dropped" not in text
    if tune == "on":
        assert "tune: steps " in text and {r.path for r in ran} >= {
            "combined_1f1b", "combined_1f1b+wgrad", "sequential"}


@pytest.mark.slow
def test_while_tuning_a_capture_that_fails_otherwise_drops_its_path_first():
    """Not for want of memory: each path whose capture fails is dropped, the last one left is
    chosen, and its capture failing after the decision turns the graphs off."""
    eager, _, _ = _train(["--train-iters", "12", "--tune", "off", "--cuda-graph-impl", "none"],
                         auto_graphs=False)
    ran, lines, graphs_on = _train(GRAPHS + ["--train-iters", "12", "--tune", "on",
                                             "--tune-steps", "1"],
                                   auto_graphs=True, backend=_CaptureBreaks)
    assert _hexes(ran) == _hexes(eager) and len(ran) == 12 and not graphs_on
    text = "\n".join(lines)
    assert "dropped: its CUDA graph capture failed" in text
    assert "the run goes on without graphs" in text, text[-3000:]


def test_a_graph_scope_the_flags_gave_fails_the_run_when_its_capture_fails():
    with pytest.raises(RuntimeError, match="emulated out of memory"):
        _train(GRAPHS + ["--train-iters", "6", "--tune", "off"], auto_graphs=False,
               backend=_CaptureFails)


def test_a_capture_the_free_memory_cannot_hold_is_refused_before_it_starts(monkeypatch):
    """`make_room` (the CUDA backend; torch.cuda's memory calls stood in for): the warm-up's
    cached blocks are released first, then the free memory is set against what the warm-up
    took, and a capture short of it raises GraphMemoryError, which the trainer counts as out
    of memory."""
    import torch

    from epoverlap.graphs.capture import CudaGraphBackend, GraphMemoryError
    from epoverlap.training.loop.step import _out_of_memory

    gib, state = 2**30, {"reserved": 30 * 2**30, "total": 0}
    calls = []

    def empty_cache():
        calls.append("empty")
        state["reserved"] = 20 * gib  # the warm-up's 10 GiB of cached blocks go back

    def mem_get_info(device):
        calls.append("free")
        return state["total"] - state["reserved"], state["total"]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    backend = object.__new__(CudaGraphBackend)
    backend.device = torch.device("cuda", 0)

    state["total"] = 31 * gib  # 11 GiB free once emptied: room for the warm-up's 10
    backend.make_room(20 * gib, "the graph")
    assert calls == ["empty", "free"]
    state.update(reserved=30 * gib, total=30 * gib)  # 10 GiB free: short of 10 x 1.05
    with pytest.raises(GraphMemoryError, match=r"the graph: its capture needs about 10\.0 GiB"
                                               r" .*, 10\.0 GiB of the device are free") as e:
        backend.make_room(20 * gib, "the graph")
    assert _out_of_memory(e.value) and not _out_of_memory(RuntimeError("capture failure"))
