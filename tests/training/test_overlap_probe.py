"""The overlap probe (`training/probe.py`, pure CPU): which schedule each step runs, and the
decision from the slowest rank's medians. Its bits (a run that switches schedules gives the
losses of a run that does not) are checked on gloo ranks in test_gloo.py."""

from __future__ import annotations

import pytest

from epoverlap.training.probe import SEQUENTIAL, OverlapProbe

OVL = "combined_1f1b"


def _run(probe: OverlapProbe, first: int, last: int, seconds, slowest=lambda m: m):
    """Drive steps first..last; seconds[name] is each schedule's step time. -> (schedules,
    decision lines)."""
    schedules, lines = [], []
    for step in range(first, last + 1):
        name = probe.schedule_for(step)
        schedules.append(name)
        line = probe.record(step, seconds[name], slowest)
        if line is not None:
            lines.append((step, line))
    return schedules, lines


def test_the_first_step_is_untimed_then_the_schedules_alternate_then_the_faster_stays():
    probe = OverlapProbe(steps=3, first_step=1, overlap=OVL)
    schedules, lines = _run(probe, 1, 10, {OVL: 0.25, SEQUENTIAL: 0.20})
    assert schedules == [OVL] + [OVL, SEQUENTIAL] * 3 + [SEQUENTIAL] * 3
    assert probe.times == {OVL: [0.25] * 3, SEQUENTIAL: [0.20] * 3}  # step 1 not recorded
    (step, line), = lines
    assert step == 7 and probe.chosen == SEQUENTIAL
    assert line == ("overlap probe, steps 2-7: combined_1f1b 250.0 ms, sequential 200.0 ms "
                    "per step (median of 3 each, slowest rank; overlap / sequential 1.250): "
                    "sequential for the rest of the run")


def test_a_faster_overlap_and_a_tie_keep_the_overlap():
    for seconds in ({OVL: 0.10, SEQUENTIAL: 0.30}, {OVL: 0.20, SEQUENTIAL: 0.20}):
        probe = OverlapProbe(steps=2, first_step=1, overlap=OVL)
        schedules, _ = _run(probe, 1, 8, seconds)
        assert probe.chosen == OVL and schedules[5:] == [OVL] * 3


def test_medians_not_means_and_the_slowest_rank_decides():
    """One slow step (a hiccup) does not decide; and every rank takes the all-reduced
    figures, so a rank whose own times favour the overlap still goes sequential."""
    probe = OverlapProbe(steps=3, first_step=1, overlap=OVL)
    times = iter([0.10, 0.20, 0.10, 0.20, 0.90, 0.20])  # ovl, seq, ovl, seq, ovl (hiccup), seq
    seen = []
    for step in range(2, 8):
        probe.record(step, next(times), lambda medians: seen.append(medians) or medians)
    assert seen == [[0.10, 0.20]] and probe.chosen == OVL  # median 0.10, not mean 0.37
    other = OverlapProbe(steps=3, first_step=1, overlap=OVL)
    _run(other, 1, 7, {OVL: 0.10, SEQUENTIAL: 0.20}, slowest=lambda medians: [0.30, 0.20])
    assert other.chosen == SEQUENTIAL


def test_a_resumed_run_probes_after_its_own_first_step():
    probe = OverlapProbe(steps=1, first_step=51, overlap="combined_1f1b_paired_ends")
    assert [probe.schedule_for(s) for s in (51, 52, 53)] == [
        "combined_1f1b_paired_ends", "combined_1f1b_paired_ends", SEQUENTIAL]
    assert probe.in_window(52) and probe.in_window(53) and not probe.in_window(54)
    assert probe.record(51, 9.0, lambda m: m) is None and probe.times[SEQUENTIAL] == []


def test_no_steps_is_refused():
    with pytest.raises(ValueError, match="at least one step"):
        OverlapProbe(steps=0, first_step=1, overlap=OVL)


def test_a_primed_probe_runs_one_untimed_sequential_step_before_its_window():
    """With CUDA graphs: steps up to first_step run the overlap (its graphs' warm-up and
    capture), the next runs sequential untimed (it records the sequential graphs), then the
    window alternates replays; the loser is named once decided."""
    probe = OverlapProbe(steps=2, first_step=3, overlap=OVL, prime=True)
    schedules, lines = _run(probe, 1, 10, {OVL: 0.30, SEQUENTIAL: 0.20})
    assert schedules == [OVL] * 3 + [SEQUENTIAL] + [OVL, SEQUENTIAL] * 2 + [SEQUENTIAL] * 2
    assert probe.prime_step == 4 and (probe.start, probe.end) == (5, 8)
    assert not probe.in_window(4) and probe.times == {OVL: [0.30] * 2, SEQUENTIAL: [0.20] * 2}
    assert [step for step, _ in lines] == [8] and probe.losing() == OVL
    plain = OverlapProbe(steps=1, first_step=1, overlap=OVL)
    assert plain.prime_step is None and plain.start == 2 and plain.losing() is None


def _graphed_probe_run(probe_steps: int):
    """Eleven steps of the tiny model on one CPU process, the combined 1F1B with delayed wgrad
    (a comm thread at EP 1) and the partial graphs (capture emulated, `test_graphs_cpu`),
    probed over `probe_steps` steps each (0: never). -> (step results, log lines, the keys of
    the banks left captured)."""
    import os
    from unittest import mock

    from graph_emulation import EmulatedGraphs

    from epoverlap.config import parse_config
    from epoverlap.parallel.groups import destroy_distributed, init_distributed
    from epoverlap.training.trainer import Trainer

    flags = ["--preset", "tiny", "--mock-data", "--kernel-backend", "torch", "--train-iters",
             "11", "--log-interval", "1", "--overlap-moe-expert-parallel-comm",
             "--delay-wgrad-compute", "--cuda-graph-impl", "local", "--cuda-graph-modules",
             "attn", "moe_router", "moe_preprocess", "--cuda-graph-warmup-steps", "2",
             "--overlap-probe-steps", str(probe_steps)]
    lines: list[str] = []
    with mock.patch.dict(os.environ):  # init_distributed sets RANK, MASTER_PORT, ...
        groups = init_distributed(1, "cpu")
        try:
            trainer = Trainer(parse_config(flags), groups, log=lines.append,
                              graph_backend=EmulatedGraphs)
            try:
                lines.append(trainer.describe())
                results = trainer.train()
                banks = sorted(key for key, bank in trainer.graphs.banks.banks.items()
                               if bank.captured)
            finally:
                trainer.close()
        finally:
            destroy_distributed(groups)
    return results, lines, banks


def test_a_probe_with_partial_graphs_gives_each_schedule_its_bank_and_keeps_the_bits():
    """With --cuda-graph-impl local: the overlap's graphs are captured after the warm-up
    (step 2), one untimed sequential step captures the sequential schedule's graphs (step 3),
    steps 4-7 alternate replays, and after the decision only the kept schedule's bank is
    left. Every loss equals the never-probed graphed run's bit for bit."""
    fixed, _, fixed_banks = _graphed_probe_run(0)
    probed, lines, banks = _graphed_probe_run(2)
    schedules = [r.schedule for r in probed]
    assert schedules[:7] == [OVL, OVL, SEQUENTIAL, OVL, SEQUENTIAL, OVL, SEQUENTIAL]
    kept = schedules[7]
    assert set(schedules[7:]) == {kept}
    assert [float.hex(r.loss) for r in probed] == [float.hex(r.loss) for r in fixed]
    assert fixed_banks == [0] and banks == [(kept, 0)]
    text = "\n".join(lines)
    assert "probed against sequential, steps 4-7, its CUDA graphs captured at step 3" in text
    assert "probe: sequential (untimed: its CUDA graphs are captured)" in text
    loser = OVL if kept == SEQUENTIAL else SEQUENTIAL
    assert f"the {loser} schedule's CUDA graphs released" in text
    assert text.count("CUDA graphs: ") == 2  # one capture per schedule
    assert "CUDA graph banks by schedule: bank ('combined_1f1b', 0): 24 graphs" in text
