"""Checkpoints across context-parallel sizes, on gloo ranks: a run saved at CP 2 resumes at
CP 1 and CP 4, one saved at CP 4 or CP 1 resumes at CP 2, and the resumed steps are the saving
run's within fp32 rounding (CP N trains to CP 1's losses, and nothing in a checkpoint is per CP
rank); `epoverlap-convert-checkpoint` carries a CP run to Megatron-core's torch_dist layout and
back with every weight's bits, and the conversion loads at CP 2 and CP 1 alike.

Slow tier: each case spawns 1-4 gloo ranks (about a minute on a loaded 2-core machine)."""

from __future__ import annotations

import pytest
import torch

from checkpoint_workers import checkpoint_tensors
from context_workers import cp_checkpoint_run
from dist_helpers import run_ranks
from epoverlap.cli.convert_checkpoint import main as convert
from epoverlap.training.checkpoints.checkpoint_files import iter_name
from epoverlap.training.checkpoints.megatron_checkpoint import read_common
from gloo_workers import TINY

STEPS = ["--train-iters", "4"]
ROUNDING = 2e-6  # relative: CP N against CP 1 (test_context_parallel.py)


def _close(ours: list[float], reference: list[float]) -> None:
    assert len(ours) == len(reference) and ours, (ours, reference)
    for a, b in zip(ours, reference):
        assert abs(a - b) <= ROUNDING * b, (ours, reference)


def _run(cp: int, ep: int, flags: list, save=None, resume=None) -> list[float]:
    """Losses of a run at CP `cp` on CP ranks (DP 1), rank 0's (every rank reports the agreed
    loss)."""
    return run_ranks(cp_checkpoint_run, cp, cp, ep, STEPS + flags,
                     None if save is None else str(save),
                     None if resume is None else str(resume), timeout_s=500)[0]


@pytest.fixture(scope="module")
def cp2_saved(tmp_path_factory):
    """A: CP 2 (p2p ring), EP 2, 4 steps, saved at steps 2 and 4."""
    root = tmp_path_factory.mktemp("cp2")
    losses = _run(2, 2, ["--cp-comm-type", "p2p"], save=root / "A")
    return root / "A", losses


@pytest.mark.slow
def test_a_cp2_save_resumes_at_cp1_and_at_cp4(cp2_saved):
    """Steps 3-4 resumed from A@2 at CP 4 (the all-gather, EP 2 x EDP 2) and at CP 1 (one
    rank) are A's within rounding."""
    saved, whole = cp2_saved
    at_2 = saved / iter_name(2)
    _close(_run(4, 2, ["--cp-comm-type", "allgather"], resume=at_2), whole[2:])
    _close(_run(1, 1, [], resume=at_2), whole[2:])


@pytest.mark.slow
def test_cp4_and_cp1_saves_resume_at_cp2(cp2_saved, tmp_path):
    """B: CP 4 saved at 2, and C: CP 1 saved at 2 (each A's losses within rounding); each
    resumed at CP 2 continues as its saving run."""
    _, whole = cp2_saved
    for name, cp, ep in (("B", 4, 2), ("C", 1, 1)):
        saving = _run(cp, ep, ["--cp-comm-type", "allgather"], save=tmp_path / name)
        _close(saving, whole)
        resumed = _run(2, 2, ["--cp-comm-type", "p2p"],
                       resume=tmp_path / name / iter_name(2))
        _close(resumed, saving[2:])


@pytest.mark.slow
def test_a_cp_run_converts_to_megatron_core_and_back_and_loads_at_any_cp(cp2_saved, tmp_path):
    """A@4 (CP 2) -> Megatron-core torch_dist (its args then saying CP 2, as a Megatron-LM CP
    run's do) -> epoverlap (the flags of a CP 2 run): every weight's bits back; the
    conversion (weights only, a fresh optimizer) trains step 5 at CP 2 and at CP 1 to the
    same loss within rounding."""
    saved, _ = cp2_saved
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert convert(["--to-megatron", str(saved), "--out", str(mcore)]) == 0
    common_pt = mcore / iter_name(4) / "common.pt"
    common, why = read_common(common_pt)
    assert why is None and "args" in common
    # as a Megatron-LM CP run's own save says: its CP size is the run's, not the weights'
    common["args"].context_parallel_size, common["args"].cp_comm_type = 2, "p2p"
    torch.save(common, common_pt)
    flags = TINY + ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]
    assert convert(["--from-megatron", str(mcore), "--out", str(back), *flags]) == 0
    ours = checkpoint_tensors(saved / iter_name(4), ("model/", "buffer/"))
    theirs = checkpoint_tensors(back / iter_name(4), ("model/", "buffer/"))
    assert sorted(ours) == sorted(theirs) and ours
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype and value.equal(theirs[key]), key
    five = ["--train-iters", "5"]
    at_cp2 = run_ranks(cp_checkpoint_run, 2, 2, 2, five + ["--cp-comm-type", "allgather"],
                       None, str(back / iter_name(4)), timeout_s=500)[0]
    at_cp1 = run_ranks(cp_checkpoint_run, 1, 1, 1, five, None, str(back / iter_name(4)),
                       timeout_s=500)[0]
    assert len(at_cp2) == 1
    _close(at_cp2, at_cp1)
