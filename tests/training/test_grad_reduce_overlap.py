"""--overlap-grad-reduce on gloo: the gradient buckets reduced beside the backward give the bits
of the reduce after it (4 ranks, so the data-parallel sum of more than two replicas, whose
order depends on how a buffer is split, is exercised), with the EP overlap and delayed weight
grads, the sequential schedule and pipeline stages; the recorded spans show the reduces before
the last backward node ends with the option, and after the forward-backward without it."""

from __future__ import annotations

import pytest

from dist_helpers import run_ranks
from gloo_workers import TINY, assert_modes_match_sequential, mode_grads_and_losses
from pipeline_workers import VIRTUAL, WGRAD, mode_results
from run_paths import assert_flag_differs
from epoverlap.config import parse_config
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.loop.trainer import Trainer

SEQUENTIAL = ["--no-overlap-moe-expert-parallel-comm"]
OVERLAP_WGRAD = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
ON, OFF = ["--overlap-grad-reduce"], []
MODES = {"sequential": SEQUENTIAL,  # the reference: reduced after the backward (the default)
         "sequential_beside": SEQUENTIAL + ON,
         "overlap_wgrad_beside": OVERLAP_WGRAD + ON,
         "overlap_wgrad_after": OVERLAP_WGRAD + OFF}
# sequential_beside differs from the reference in the option only (the path line names no
# grad reduce: the resolved config does)
BESIDE_DIFFERS = {"sequential_beside": lambda a, b: assert_flag_differs(a, b, ON[0])}


@pytest.mark.slow
def test_reducing_beside_the_backward_keeps_the_bits_on_four_data_parallel_ranks(tmp_path):
    # EP 2 on 4 ranks: dense grads summed over DP 4, expert grads over EDP 2
    results = run_ranks(mode_grads_and_losses, 4, 2, str(tmp_path), 3, (), MODES,
                        timeout_s=600)
    assert_modes_match_sequential(results, tmp_path, 3, MODES, BESIDE_DIFFERS)


@pytest.mark.slow
@pytest.mark.parametrize("virtual", [False, True])
def test_pipeline_stages_reduce_beside_the_backward_with_the_same_bits(virtual, tmp_path):
    parallel = ["--pipeline-model-parallel-size", "2"] + (VIRTUAL if virtual else [])
    modes = [("after", WGRAD + OFF), ("beside", WGRAD + ON)]
    results = run_ranks(mode_results, 4, parallel, modes, str(tmp_path), 2, timeout_s=600)
    for rank in results:
        after, beside = rank["after"], rank["beside"]
        assert beside["losses"] == after["losses"] and beside["norms"] == after["norms"]
        assert beside["grads"] == after["grads"] and beside["params"] == after["params"]


def recorded_steps(rank, world_size, flag_sets):
    """Per flag set: one profiled step's spans, and the flag as resolved, on this rank."""
    groups = init_distributed(2, "cpu", timeout_minutes=3)
    try:
        return [_recorded_step(groups, flags) for flags in flag_sets]
    finally:
        destroy_distributed(groups)


def _recorded_step(groups, flags):
    cfg = parse_config(TINY + ["--expert-model-parallel-size", "2", "--train-iters", "1",
                               "--profile-steps", "1:1"] + flags)
    trainer = Trainer(cfg, groups, log=lambda msg: None)
    try:
        trainer.train()
        return trainer.parts.cfg.overlap.overlap_grad_reduce, trainer.parts.recorder.steps[0]
    finally:
        trainer.close()


@pytest.mark.slow
def test_the_spans_show_each_bucket_reduced_before_the_last_backward_ends():
    cases = ((OVERLAP_WGRAD + ON, True), (OVERLAP_WGRAD + OFF, False))
    for rank in run_ranks(recorded_steps, 2, [flags for flags, _ in cases]):
        for (resolved, step), (_, beside) in zip(rank, cases):
            assert resolved is beside
            reduces = [s for s in step.spans if s.node == "grad_reduce"]
            backward = [s for s in step.spans if s.phase != "forward" and s not in reduces]
            last_end = max(s.end_us for s in backward)
            tail = [p for p in step.parts if p.name == "grad_reduce"]
            assert all(p.start_us >= step.step_time_us >= last_end for p in tail)
            if not beside:  # one reduce of every bucket after the forward-backward
                assert not reduces and len(tail) == 1
                continue
            names = [s.action for s in sorted(reduces, key=lambda s: s.start_us)]
            assert names[:3] == ["grad_reduce.final_norm", "grad_reduce.head",
                                 "grad_reduce.L1.expert"], names
            assert all(s.lane == "comm" and s.start_us < last_end for s in reduces)
