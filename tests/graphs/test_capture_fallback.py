"""A CUDA graph capture that fails: where the graph scope was the auto default, the run goes on
without graphs (one line, the same bits as an eager run, tuned or not); where the flags gave
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
    """The emulated graph backend whose every capture raises, as a pool out of memory would."""

    def __new__(cls, device):
        from graph_emulation import EmulatedGraphs

        backend = EmulatedGraphs(device)

        def capture(body, generators):
            raise RuntimeError("emulated out of memory")
        backend.capture = capture
        return backend


def _train(flags: list[str], auto_graphs: bool, backend=None):
    """The tiny model on one CPU process with the overlap; `auto_graphs`: the graph scope marked
    as the auto default's. -> (step results, log lines, whether graphs were left on)."""
    from graph_emulation import EmulatedGraphs

    from epoverlap.parallel.groups import destroy_distributed, init_distributed
    from epoverlap.training.trainer import Trainer

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
                graphs_on = trainer.graphs is not None
            finally:
                trainer.close()
        finally:
            destroy_distributed(groups)
    return results, lines, graphs_on


def _hexes(results) -> list[str]:
    return [float.hex(r.loss) for r in results]


@pytest.mark.parametrize("tune", ["off", pytest.param("on", marks=pytest.mark.slow)])
def test_an_auto_graph_scope_whose_capture_fails_runs_on_without_graphs(tune):
    """With the tuner every path's capture fails: each is dropped, the last one left is chosen,
    and its capture failing after the decision turns the graphs off."""
    eager, _, _ = _train(["--train-iters", "12", "--tune", "off", "--cuda-graph-impl", "none"],
                         auto_graphs=False)
    ran, lines, graphs_on = _train(GRAPHS + ["--train-iters", "12", "--tune", tune,
                                             "--tune-steps", "1"],
                                   auto_graphs=True, backend=_CaptureFails)
    assert _hexes(ran) == _hexes(eager) and len(ran) == 12 and not graphs_on
    text = "\n".join(lines)
    assert ("the run goes on without graphs" in text and "emulated out of memory" in text
            and "--cuda-graph-impl pins one" in text), text[-3000:]


def test_a_graph_scope_the_flags_gave_fails_the_run_when_its_capture_fails():
    with pytest.raises(RuntimeError, match="emulated out of memory"):
        _train(GRAPHS + ["--train-iters", "6", "--tune", "off"], auto_graphs=False,
               backend=_CaptureFails)
