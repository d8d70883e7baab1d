"""The path tuner (`training/tuning/tuner.py`, `config/tuning.py`, `training/tuning/tune_cache.py`;
pure CPU and one CPU process): which path each step runs, the decision from the slowest rank's step
times, dropped paths, the paths of a config and its pinned axes, the cache key and files, and
in-process runs with emulated CUDA graphs that keep the bits of an untuned run. The 2-rank
training command is tests/training/test_tuner_cli.py; a run switching schedules mid-run on 2
and 4 gloo ranks, tests/parallel/test_gloo.py."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

from epoverlap.config import parse_config, resolve_config
from epoverlap.config.tuning import (SEQUENTIAL, candidate_paths, may_tune, paths_within,
                                     steps_needed)
from epoverlap.training.tuning.tune_cache import cache_key, key_fields, read_decision
from epoverlap.training.tuning.tuner import PRIME, TIMED, WARMUP, TuneDecision, Tuner, fits_beside

OVL, WG, PE = "combined_1f1b", "combined_1f1b+wgrad", "combined_1f1b_paired_ends"
PATHS = [OVL, WG, SEQUENTIAL]


def _run(tuner: Tuner, first: int, last: int, seconds, slowest=lambda times: times):
    """Drive steps first..last; seconds[name] is each path's step time (a number, or an
    iterator of them). -> (paths run, decisions as (step, decision))."""
    ran, decisions = [], []
    for step in range(first, last + 1):
        name = tuner.path_for(step)
        ran.append(name)
        time = seconds[name]
        decision = tuner.record(step, time if isinstance(time, float) else next(time), slowest)
        if decision is not None:
            decisions.append((step, decision))
    return ran, decisions


# ----------------------------------------------------------------------------- the decision
def test_the_first_step_is_untimed_then_the_paths_take_turns_then_the_fastest_stays():
    tuner = Tuner(PATHS, steps=2, first_step=1)
    ran, decisions = _run(tuner, 1, 10, {OVL: 0.25, WG: 0.22, SEQUENTIAL: 0.30})
    assert ran == [OVL] + PATHS * 2 + [WG] * 3
    assert [tuner.phase_of(s) for s in (1, 2, 7, 8)] == [WARMUP, TIMED, TIMED, None]
    assert tuner.times == {OVL: [0.25] * 2, WG: [0.22] * 2, SEQUENTIAL: [0.30] * 2}
    (step, decision), = decisions
    assert step == 7 and decision.chosen == WG and decision.window == (2, 7)
    assert tuner.losers() == [OVL, SEQUENTIAL]
    table = "\n".join(decision.table())
    assert table.splitlines()[0] == ("tune: steps 2-7, each path's step time on the slowest "
                                     "rank (ms): combined_1f1b+wgrad for the rest of the run")
    assert "  combined_1f1b+wgrad      220.0      220.0      220.0      2  chosen" in table
    record = decision.record()
    assert record["chosen"] == WG and record["cached"] is False and record["window"] == [2, 7]
    assert record["paths"][SEQUENTIAL] == {"median_ms": 300.0, "min_ms": 300.0,
                                           "max_ms": 300.0, "steps": 2}


def test_a_tie_keeps_the_earlier_path():
    for seconds, kept in (({OVL: 0.2, WG: 0.2, SEQUENTIAL: 0.2}, OVL),
                          ({OVL: 0.3, WG: 0.2, SEQUENTIAL: 0.2}, WG)):
        tuner = Tuner(PATHS, steps=1, first_step=1)
        _run(tuner, 1, 6, seconds)
        assert tuner.chosen == kept


def test_medians_not_means_and_the_slowest_rank_decides():
    """A hiccup does not decide (median 0.10 against 0.12, the means 0.37 against 0.12; the
    untimed first step's 9 s counts for nothing); and
    every rank takes the all-reduced step times, so a rank whose own times favour one path
    still takes the path the slowest rank's times favour."""
    tuner = Tuner([OVL, SEQUENTIAL], steps=3, first_step=1)
    seen = []
    _run(tuner, 1, 7, {OVL: iter([9.0, 0.10, 0.90, 0.10]), SEQUENTIAL: 0.12},
         slowest=lambda times: seen.append(list(times)) or times)
    assert seen == [[0.10, 0.12, 0.90, 0.12, 0.10, 0.12]] and tuner.chosen == OVL
    other = Tuner([OVL, SEQUENTIAL], steps=3, first_step=1)
    _run(other, 1, 7, {OVL: 0.10, SEQUENTIAL: 0.12},
         slowest=lambda times: [t * 3 if i % 2 == 0 else t for i, t in enumerate(times)])
    assert other.chosen == SEQUENTIAL
    row = other.decision.record()["paths"][OVL]
    assert row["median_ms"] == pytest.approx(300.0) and row["steps"] == 3


def test_with_graphs_each_other_path_runs_one_untimed_step_before_the_window():
    """Steps up to first_step run the first path (its graphs' warm-up and capture), then one
    untimed step per other path records its graphs, then the window times replays only."""
    tuner = Tuner(PATHS, steps=1, first_step=3, prime=True)
    assert (tuner.start, tuner.end) == (6, 8)
    ran, decisions = _run(tuner, 1, 10, {OVL: 0.3, WG: 0.3, SEQUENTIAL: 0.2})
    assert ran == [OVL] * 3 + [WG, SEQUENTIAL] + PATHS + [SEQUENTIAL] * 2
    assert [tuner.phase_of(s) for s in range(3, 7)] == [WARMUP, PRIME, PRIME, TIMED]
    assert [step for step, _ in decisions] == [8] and tuner.times[WG] == [0.3]
    assert " (tuned: 3 paths, 1 timed step(s) each, steps 6-8, each path's CUDA graphs " \
           "captured by step 5)" == tuner.describe()


def test_a_path_that_fails_to_capture_is_dropped_and_the_run_goes_on():
    tuner = Tuner(PATHS, steps=2, first_step=2, prime=True)
    assert [tuner.path_for(s) for s in (1, 2, 3)] == [OVL, OVL, WG]
    assert tuner.drop(WG, "its CUDA graph capture failed on 1 rank(s)") is None
    ran, decisions = _run(tuner, 4, 9, {OVL: 0.3, SEQUENTIAL: 0.2})
    assert ran == [SEQUENTIAL, OVL, SEQUENTIAL, OVL, SEQUENTIAL, SEQUENTIAL]
    (step, decision), = decisions
    assert step == 8 and decision.chosen == SEQUENTIAL and WG not in decision.rows()
    assert decision.table()[-1] == ("  combined_1f1b+wgrad  dropped: its CUDA graph capture "
                                    "failed on 1 rank(s)")
    assert decision.record()["dropped"] == {WG: "its CUDA graph capture failed on 1 rank(s)"}


def test_the_first_path_dropped_and_the_last_path_left_is_chosen_untimed():
    tuner = Tuner([OVL, SEQUENTIAL], steps=3, first_step=2, prime=True)
    assert tuner.path_for(2) == OVL
    decision = tuner.drop(OVL, "capture failed")
    assert decision is not None and decision.chosen == SEQUENTIAL and decision.timings == []
    assert tuner.path_for(3) == SEQUENTIAL and tuner.drop(SEQUENTIAL, "x") is None
    assert decision.table()[0] == ("tune: sequential, the only path left, for the rest of "
                                   "the run")
    fresh = Tuner(PATHS, steps=1, first_step=2, prime=True)
    fresh.path_for(2)
    fresh.drop(OVL, "capture failed")  # the next path was never primed: it primes first
    assert [fresh.path_for(s) for s in (3, 4)] == [WG, SEQUENTIAL]
    assert [fresh.phase_of(s) for s in (3, 4, 5)] == [PRIME, PRIME, None]


def test_a_resumed_run_tunes_after_its_own_first_step_and_a_cached_one_never_times():
    tuner = Tuner(PATHS, steps=1, first_step=51)
    assert [tuner.path_for(s) for s in (51, 52, 53, 54)] == [OVL] + PATHS
    assert tuner.record(51, 9.0, lambda t: t) is None and tuner.times[OVL] == []
    cached = Tuner(PATHS, steps=1, first_step=1,
                   cached=TuneDecision(WG, [], cache_file="d/k.json", cached_rows={}))
    assert [cached.path_for(s) for s in (1, 2, 3)] == [WG] * 3
    assert cached.record(2, 1.0, lambda t: t) is None and cached.cached
    assert cached.describe() == " (tuned: cached combined_1f1b+wgrad)"


def test_no_steps_or_no_paths_is_refused():
    with pytest.raises(ValueError, match="at least one timed step"):
        Tuner(PATHS, steps=0, first_step=1)
    with pytest.raises(ValueError, match="at least one path"):
        Tuner([], steps=1, first_step=1)


# ----------------------------------------------------------------------------- the paths
def _cfg(*flags: str, world: int = 2):
    return resolve_config(parse_config(["--preset", "tiny", "--mock-data", *flags]), world,
                          False)


def test_the_paths_of_a_config_and_its_pinned_axes():
    def names(*flags: str) -> list[str]:
        return [p.name for p in candidate_paths(_cfg(*flags))]
    # tiny: 8 experts, 4 local on EP 2: the path in waves has 4
    assert names() == [OVL, WG, PE, PE + "+wgrad", WG + "+w4", SEQUENTIAL]
    # --overlap-plan pinned: that plan (still against sequential), the wgrad axis tuned
    assert names("--overlap-plan", "combined_1f1b_early_release") == [
        "combined_1f1b_early_release", "combined_1f1b_early_release+wgrad",
        "combined_1f1b_early_release+wgrad+w4", SEQUENTIAL]
    # --delay-wgrad-compute pinned: every path defers, no name says so
    paths = candidate_paths(_cfg("--delay-wgrad-compute"))
    assert [p.name for p in paths] == [OVL, PE, OVL + "+w4", SEQUENTIAL]
    assert all(p.delay_wgrad for p in paths)
    # paired ends is a path of its own with two or more microbatches only
    assert names("--num-microbatches", "1") == [OVL, WG, WG + "+w4", SEQUENTIAL]
    # the overlap off: one path, nothing to tune
    assert names("--no-overlap-moe-expert-parallel-comm") == [SEQUENTIAL]
    # the deprecated probe: the flags' overlap plan against sequential
    assert names("--overlap-probe-steps", "2", "--delay-wgrad-compute") == [OVL, SEQUENTIAL]


def test_the_once_per_rank_path_only_with_tune_allow_rounding_and_where_it_can_run():
    def names(*flags: str) -> list[str]:
        return [p.name for p in candidate_paths(_cfg("--tune-allow-rounding", *flags))]
    once = [p for p in candidate_paths(_cfg("--tune-allow-rounding")) if p.once_per_rank]
    assert [(p.name, p.plan, p.delay_wgrad) for p in once] == [(WG + "+once", OVL, True)]
    assert names()[-2:] == [WG + "+once", SEQUENTIAL]
    assert not any(p.once_per_rank for p in candidate_paths(_cfg()))  # not without the flag
    for flags in (["--moe-dispatch-once-per-rank"], ["--moe-dispatch-budget", "2.0"],
                  ["--moe-a2a-waves", "2"], ["--expert-model-parallel-size", "1"]):
        assert not any(n.endswith("+once") for n in names(*flags)), flags
    assert names("--delay-wgrad-compute")[-2:] == [OVL + "+once", SEQUENTIAL]


@pytest.mark.parametrize("kind", ["host_memory", "peer_memory"])
def test_the_process_groups_path_where_the_flags_go_on_copy_engines(kind):
    """--moe-a2a-transport host_memory or peer_memory: every path goes on copy engines but one
    more, the first overlap plan with delayed weight grads on the process group (`+group`);
    with the process group's transport, no such path."""
    host = ["--moe-a2a-transport", kind]
    paths = candidate_paths(_cfg(*host))
    assert [p.name for p in paths] == [OVL, WG, PE, PE + "+wgrad", WG + "+w4", WG + "+group",
                                       SEQUENTIAL]
    assert [p.copy_engine for p in paths] == [True] * 5 + [False, True]
    group = paths[5]
    assert (group.plan, group.delay_wgrad, group.waves) == (OVL, True, 1)
    assert not any(p.copy_engine or p.name.endswith("+group") for p in candidate_paths(_cfg()))
    assert [p.name for p in candidate_paths(_cfg(*host, "--delay-wgrad-compute"))][-2:] == [
        OVL + "+group", SEQUENTIAL]


def test_the_path_in_waves_where_the_config_allows_it_and_the_flags_left_it_at_one():
    def waves(*flags: str, world: int = 2) -> list[int]:
        return [p.waves for p in candidate_paths(_cfg(*flags, world=world))]
    assert waves() == [1, 1, 1, 1, 4, 1]
    # fewer local experts than 4: as many waves as experts; one local expert: no waves
    assert waves("--num-experts", "4")[4] == 2
    assert 4 not in waves("--num-experts", "2") and 2 not in waves("--num-experts", "2")
    # the flags' waves: every path has them, no other count is tried
    assert set(waves("--moe-a2a-waves", "2")) == {2}
    # the budget dispatch splits into waves too
    budget = ["--moe-dispatch-budget", "1.5"]
    assert waves(*budget)[4] == 4
    # a dispatch or graphs the waves cannot run with: no path in waves
    for flags in (["--moe-dispatch-once-per-rank"],
                  ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"],
                  budget + ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"]):
        assert set(waves(*flags)) == {1}, flags


def test_auto_tunes_on_cuda_only_and_on_anywhere_off_never():
    cfg = _cfg()
    assert may_tune(cfg, "cuda") and not may_tune(cfg, "cpu")
    assert may_tune(_cfg("--tune", "on"), "cpu")
    assert not may_tune(_cfg("--tune", "off"), "cuda")
    assert not may_tune(_cfg("--no-overlap-moe-expert-parallel-comm"), "cuda")
    assert steps_needed(cfg, 5) == 1 + 5 * 3


def test_a_short_run_times_the_first_paths_it_has_steps_for_and_sequential():
    cfg = _cfg("--tune-steps", "1")  # eager: one untimed step, then one timed step a path
    paths = candidate_paths(cfg)
    names = lambda steps: [p.name for p in paths_within(cfg, paths, steps)]
    assert names(7) == [p.name for p in paths]  # 6 paths: 1 + 6 steps
    assert names(5) == [OVL, WG, PE, SEQUENTIAL]
    assert names(3) == [OVL, SEQUENTIAL]
    assert names(2) == []  # not even one overlap path beside the sequential one


# ----------------------------------------------------------------------------- the cache
def _key(*flags: str, world: int = 2, env=None) -> str:
    with mock.patch.dict(os.environ, env or {}):
        return cache_key(key_fields(_cfg(*flags, world=world), world, torch.device("cpu")))


def test_the_cache_key_follows_what_shapes_the_step_and_nothing_else():
    base = _key()
    assert base == _key()
    for flags in (["--hidden-size", "64"], ["--num-experts", "4"], ["--micro-batch-size", "1"],
                  ["--num-microbatches", "2"], ["--delay-wgrad-compute"],
                  ["--overlap-plan", "combined_1f1b"], ["--moe-router-topk", "1"]):
        assert _key(*flags) != base, flags
    assert _key(world=4) != base
    assert _key(env={"NCCL_P2P_DISABLE": "1"}) != base
    assert _key(env={"NCCL_NET_GDR_LEVEL": "2"}) != base
    for flags in (["--train-iters", "500"], ["--seed", "7"], ["--log-json", "x.jsonl"],
                  ["--save", "ckpt"], ["--tune-steps", "5"], ["--tune", "on"],
                  ["--tune-cache", "somewhere"], ["--lr", "5e-3"]):
        assert _key(*flags) == base, flags


def test_a_cache_file_that_does_not_parse_or_names_no_path_is_ignored(tmp_path):
    path = tmp_path / "k.json"
    assert read_decision(path, PATHS) == (None, None)  # none yet: no warning
    path.write_text("{not json")
    decision, warning = read_decision(path, PATHS)
    assert decision is None and warning.startswith(f"tune: ignoring the cache file {path}: "
                                                   "it does not parse")
    path.write_text(json.dumps({"chosen": "zigzag", "paths": {}}))
    decision, warning = read_decision(path, PATHS)
    assert decision is None and "it names 'zigzag', not a path of this run" in warning
    path.write_text(json.dumps({"chosen": WG, "paths": {WG: {"median_ms": 1.0, "min_ms": 1.0,
                                                             "max_ms": 1.0, "steps": 1}}}))
    decision, warning = read_decision(path, PATHS)
    assert warning is None and decision.chosen == WG and decision.cache_file == str(path)
    assert decision.table()[0] == f"tune: cached {WG} ({path})"
    assert decision.table()[-1].endswith("chosen (cached)")


def test_a_cache_file_written_before_waves_were_named_so_still_reads(tmp_path):
    """Its key: the overlap field under its former name, so the key is the one written then;
    its path names: `+k4` reads as `+w4`, the rows and the dropped ones too."""
    fields = key_fields(_cfg(world=2), 2, torch.device("cpu"))["overlap"]
    assert fields["moe_a2a_chunks"] == 1 and "moe_a2a_waves" not in fields
    old, new = WG + "+k4", WG + "+w4"
    row = {"median_ms": 1.0, "min_ms": 1.0, "max_ms": 1.0, "steps": 1}
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"chosen": old, "paths": {old: row, WG: row},
                                "dropped": {OVL + "+k4": "graphs"}}))
    decision, warning = read_decision(path, PATHS + [new])
    assert warning is None and decision.chosen == new
    assert set(decision.rows()) == {new, WG} and decision.dropped == {OVL + "+w4": "graphs"}
    _, warning = read_decision(path, PATHS)  # a run without the path in waves: one line
    assert f"it names {new!r}, not a path of this run" in warning and "\n" not in warning


# ----------------------------------------------------------------------------- in-process runs
def _train(flags: list[str], graph_backend=None):
    """The tiny model on one CPU process, the overlap at EP 1 (a comm thread), mock data.
    -> (step results, log lines, the keys of the banks left captured, None without graphs)."""
    from graph_emulation import EmulatedGraphs

    from epoverlap.parallel.groups import destroy_distributed, init_distributed
    from epoverlap.training.loop.trainer import Trainer

    argv = ["--preset", "tiny", "--mock-data", "--kernel-backend", "torch", "--log-interval",
            "1", "--overlap-moe-expert-parallel-comm", *flags]
    lines: list[str] = []
    with mock.patch.dict(os.environ):  # init_distributed sets RANK, MASTER_PORT, ...
        groups = init_distributed(1, "cpu")
        try:
            trainer = Trainer(parse_config(argv), groups, log=lines.append,
                              graph_backend=graph_backend or EmulatedGraphs)
            try:
                lines.append(trainer.describe())
                results = trainer.train()
                store = trainer.parts.graph_banks
                banks = None if store is None else sorted(
                    key for key, bank in store.banks.items() if bank.captured)
            finally:
                trainer.close()
        finally:
            destroy_distributed(groups)
    return results, lines, banks


GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router",
          "moe_preprocess", "--cuda-graph-warmup-steps", "2"]
ALL = [OVL, WG, PE, PE + "+wgrad", SEQUENTIAL]


def _hexes(results) -> list[str]:
    return [float.hex(r.loss) for r in results]


def test_tuning_with_graphs_gives_each_path_its_bank_and_keeps_the_bits():
    """--cuda-graph-impl local: the first path's graphs are captured after the warm-up (step
    2), one untimed step per other path captures its own (steps 3-6), steps 7-11 time
    replays, and after the decision only the chosen path's bank is left. Every loss equals
    the untuned graphed run's bit for bit."""
    fixed, _, fixed_banks = _train(GRAPHS + ["--train-iters", "13", "--tune", "off"])
    tuned, lines, banks = _train(GRAPHS + ["--train-iters", "13", "--tune", "on",
                                           "--tune-steps", "1"])
    ran = [r.path for r in tuned]
    assert ran[:11] == [OVL, OVL] + ALL[1:] + ALL and set(ran[11:]) == {ran[11]}
    assert _hexes(tuned) == _hexes(fixed)
    assert fixed_banks == [0] and banks == [(ran[11], 0)]
    assert [r.tuned_path is not None for r in tuned] == [s == 11 for s in range(1, 14)]
    text = "\n".join(lines)
    assert "(tuned: 5 paths, 1 timed step(s) each, steps 7-11, each path's CUDA graphs " \
           "captured by step 6)" in text
    assert "| tune: sequential (untimed: its CUDA graphs are captured)" in text
    assert "| tune: combined_1f1b_paired_ends+wgrad |" in text
    assert text.count("CUDA graphs: ") == 5  # one capture per path
    assert "tune: steps 7-11, each path's step time on the slowest rank (ms): " in text
    assert "tune: the other paths' CUDA graphs released" in text


class _SecondCaptureFails:
    """The emulated graph backend, whose second bank capture (the second path's) raises."""

    made = 0

    def __new__(cls, device):
        from graph_emulation import EmulatedGraphs

        cls.made += 1
        backend = EmulatedGraphs(device)
        if cls.made == 2:
            def capture(body, generators):
                raise RuntimeError("emulated capture failure")
            backend.capture = capture
        return backend


def test_a_path_whose_capture_fails_is_dropped_and_the_bits_stay():
    fixed, _, _ = _train(GRAPHS + ["--train-iters", "12", "--tune", "off"])
    _SecondCaptureFails.made = 0
    tuned, lines, banks = _train(GRAPHS + ["--train-iters", "12", "--tune", "on",
                                           "--tune-steps", "1"], _SecondCaptureFails)
    ran = [r.path for r in tuned]
    left = [OVL, PE, PE + "+wgrad", SEQUENTIAL]
    assert ran[:10] == [OVL, OVL, WG] + left[1:] + left and WG not in ran[3:]
    assert _hexes(tuned) == _hexes(fixed)
    text = "\n".join(lines)
    assert ("tune: combined_1f1b+wgrad dropped: its CUDA graph capture failed on 1 rank(s) "
            "(RuntimeError: emulated capture failure); the run goes on") in text
    assert "  combined_1f1b+wgrad" in text and "dropped: its CUDA graph capture" in text
    assert banks == [(ran[10], 0)]


def test_a_cached_rerun_skips_tuning_and_runs_the_cached_path_from_the_first_step(tmp_path):
    cache = str(tmp_path / "tune")
    first, lines, _ = _train(["--train-iters", "7", "--tune", "on", "--tune-steps", "1",
                              "--tune-cache", cache])
    files = list((tmp_path / "tune").glob("*.json"))
    assert len(files) == 1 and f"tune: decision written to {files[0]}" in lines
    chosen = json.loads(files[0].read_text())["chosen"]
    assert chosen == first[-1].path and chosen in ALL
    again, lines, _ = _train(["--train-iters", "3", "--tune", "on", "--tune-cache", cache])
    assert [r.path for r in again] == [chosen] * 3
    assert f"tune: cached {chosen} ({files[0]})" in lines
    assert again[0].tuned_path["cached"] is True and again[0].tuned_path["chosen"] == chosen
    assert again[1].tuned_path is None
    assert _hexes(again) == _hexes(first[:3])
    assert any(line.endswith("chosen (cached)") for line in lines)
    files[0].write_text('{"chosen": "zigzag"}')  # not a path of this run: tuned again
    retuned, lines, _ = _train(["--train-iters", "7", "--tune", "on", "--tune-steps", "1",
                                "--tune-cache", cache])
    assert [r.path for r in retuned][:6] == [OVL] + ALL
    assert json.loads(files[0].read_text())["chosen"] in ALL


def test_a_run_too_short_for_every_path_times_the_first_ones_and_caches_nothing(tmp_path):
    cache = str(tmp_path / "tune")
    tuned, lines, _ = _train(["--train-iters", "5", "--tune", "on", "--tune-steps", "1",
                              "--tune-cache", cache])
    assert [r.path for r in tuned][:5] == [OVL, OVL, WG, PE, SEQUENTIAL]
    assert ("tune: 5 steps left, 6 needed for all 5 paths: timing 4, leaving out "
            "combined_1f1b_paired_ends+wgrad (not cached)") in lines
    assert tuned[-1].tuned_path is not None  # decided at the last step
    assert not list(tmp_path.glob("tune/*.json"))


def test_in_turn_each_path_is_primed_then_timed_before_the_next():
    """take_turns after the first path's capture: each other path's untimed recording step,
    then its timed steps, then the next path's; the decision as in the round-robin."""
    tuner = Tuner(PATHS, steps=2, first_step=3, prime=True)
    tuner.take_turns()
    ran, decisions = _run(tuner, 1, 14, {OVL: 0.3, WG: 0.2, SEQUENTIAL: 0.25})
    assert ran == [OVL] * 5 + [WG] * 3 + [SEQUENTIAL] * 3 + [WG] * 3
    assert [tuner.phase_of(s) for s in range(3, 12)] == [
        WARMUP, TIMED, TIMED, PRIME, TIMED, TIMED, PRIME, TIMED, TIMED]
    assert [step for step, _ in decisions] == [11] and decisions[0][1].chosen == WG


def test_a_path_fits_beside_the_others_with_room_for_its_recording_step():
    assert fits_beside(10, 40, 3) and not fits_beside(10, 39, 3)
    assert fits_beside(86 * 2**30, None, 4)  # no CUDA device: unknown free memory fits


def test_graphs_that_do_not_fit_side_by_side_are_tuned_in_turn_with_the_same_bits(monkeypatch):
    """With the check of `fits_beside` failing, the tuner takes the paths one after another:
    each path's bank captured in its turn (one capture per path, the chosen one's again after
    the decision), at most one path's bank held, and the losses the untuned run's bits."""
    fixed, _, _ = _train(GRAPHS + ["--train-iters", "16", "--tune", "off"])
    monkeypatch.setattr("epoverlap.training.loop.step.fits_beside", lambda *args: False)
    tuned, lines, banks = _train(GRAPHS + ["--train-iters", "16", "--tune", "on",
                                           "--tune-steps", "1"])
    ran = [r.path for r in tuned]
    # warm-up (2 steps) and the first path's timed step; then each other path twice
    assert ran[:13] == [OVL, OVL, OVL] + [p for p in ALL[1:] for _ in range(2)] + [ran[13]] * 2
    assert _hexes(tuned) == _hexes(fixed)
    text = "\n".join(lines)
    assert "the paths are timed one after another" in text
    assert text.count("CUDA graphs: ") >= 5 and banks == [(ran[-1], 0)]


def test_the_fitted_budget_learns_each_steps_demand_and_keeps_the_chosen_paths_steps():
    """Each step's demand reaches the budget's fit with its step, and at the decision the fit
    keeps the steps that ran the chosen path (`BudgetFit.keep_steps`)."""
    from epoverlap.model.budget import BudgetFit

    seen, kept = [], []
    observe, keep = BudgetFit.observe, BudgetFit.keep_steps

    def spy_observe(fit, need, step=None):
        seen.append(step)
        observe(fit, need, step)

    def spy_keep(fit, steps):
        kept.append(steps)
        keep(fit, steps)
    with mock.patch.object(BudgetFit, "observe", spy_observe), \
            mock.patch.object(BudgetFit, "keep_steps", spy_keep):
        tuned, _, _ = _train(["--train-iters", "9", "--tune", "on", "--tune-steps", "1",
                              "--moe-dispatch-budget", "1.0", "--moe-dispatch-budget-fit"])
    assert seen == [r.step for r in tuned]
    at = next(i for i, r in enumerate(tuned) if r.tuned_path is not None)
    chosen = tuned[at].tuned_path["chosen"]
    assert chosen == tuned[-1].path
    assert kept == [{r.step for r in tuned[:at + 1] if r.path == chosen}]
    assert 0 < len(kept[0]) < at + 1  # the chosen path's steps, not the others'
