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
