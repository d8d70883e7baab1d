"""Dispatch modes on gloo (2 CPU ranks, EP=2): the capacity modes equal megatron-core's router
and all-to-all dispatcher bit for bit; the capacity and budget modes train, overlapped and
sequential bitwise alike; a budget too small for the routing reruns its steps and gives the
dropless run's losses."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.bench_peer import megatron_installed

from dist_helpers import run_ranks
from dispatch_workers import graphed_training, megatron_dispatch_equivalence, mode_runs
from run_paths import assert_paths_differ, assert_schedules_differ, read_run_record

pytestmark = pytest.mark.slow
needs_megatron = pytest.mark.skipif(not megatron_installed(),
                                    reason="megatron-core is not installed "
                                           "(pip install -e '.[peer]')")


MEGATRON_CASES = {
    "dropless": [],
    "drop-probs": ["--moe-expert-capacity-factor", "1.0"],
    "drop-position": ["--moe-expert-capacity-factor", "0.75", "--moe-token-drop-policy",
                      "position"],
    "pad-probs": ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
    "pad-position": ["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
                     "--moe-token-drop-policy", "position"],
}


@needs_megatron
def test_router_and_dispatcher_equal_megatron_core():
    """Routing, the rows and probs each local expert receives, the rows per expert, the
    combined output and the grads of tokens and probs, for each case on each of 2 EP ranks."""
    per_rank = run_ranks(megatron_dispatch_equivalence, 2, list(MEGATRON_CASES.values()))
    names = ("probs", "routing map", "expert rows", "expert row probs", "output",
             "token grads", "prob grads")
    for rank, cases in enumerate(per_rank):
        for case, (ours, theirs) in zip(MEGATRON_CASES, cases):
            for name, mine, other in zip(names, ours, theirs):
                assert torch.equal(mine, other), (rank, case, name)
            assert ours[-1] == theirs[-1], (rank, case, "rows per local expert")
        dropped = [int(ours[1].sum()) for ours, _ in cases]
        assert dropped[1] < dropped[0] and dropped[2] < dropped[0]  # the capacity bit


OVERLAP = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
SEQUENTIAL = ["--no-overlap-moe-expert-parallel-comm"]  # at EP 2 the auto default is the overlap
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]
PADDED = CAPACITY + ["--moe-pad-expert-input-to-capacity"]
TINY_BUDGET = ["--moe-dispatch-budget", "0.25"]  # a quarter of the balanced share: overflows
ONCE = ["--moe-dispatch-once-per-rank"]
# every run without OVERLAP is pinned to the sequential schedule
RUNS = [(name, flags if name.endswith("_ovl") else SEQUENTIAL + flags) for name, flags in [
    ("dropless", []), ("once", ONCE), ("once_ovl", ONCE + OVERLAP),
    ("once_capacity", ONCE + CAPACITY), ("once_capacity_ovl", ONCE + CAPACITY + OVERLAP),
    ("once_tiny_budget", ONCE + TINY_BUDGET),
    ("once_tiny_budget_ovl", ONCE + TINY_BUDGET + OVERLAP),
    ("capacity", CAPACITY), ("capacity_ovl", CAPACITY + OVERLAP),
    ("padded", PADDED), ("padded_ovl", PADDED + OVERLAP),
    ("budget", ["--moe-dispatch-budget", "2.0"]),
    ("tiny_budget", TINY_BUDGET), ("tiny_budget_ovl", TINY_BUDGET + OVERLAP),
    ("tiny_budget_memory", TINY_BUDGET + ["--moe-dispatch-budget-memory", "3"])]]
STEPS = 3


@pytest.fixture(scope="module")
def mode_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("modes")
    return out_dir, run_ranks(mode_runs, 2, 2, str(out_dir), STEPS, RUNS, timeout_s=600)


def _bits(grads):
    return [g.view(torch.int32) for g in grads]


@pytest.mark.parametrize("mode", ["capacity", "padded", "tiny_budget", "once",
                                  "once_capacity", "once_tiny_budget"])
def test_overlap_is_bitwise_equal_to_sequential_in_each_dispatch_mode(mode_results, mode):
    out_dir, per_rank = mode_results
    records = read_run_record(out_dir, mode), read_run_record(out_dir, f"{mode}_ovl")
    assert_schedules_differ(*records)
    assert_paths_differ(*records, "delayed wgrad")
    for per_run in per_rank:
        (sequential, seq_steps), (overlapped, ovl_steps) = per_run[mode], per_run[f"{mode}_ovl"]
        assert all(torch.equal(a, b) for a, b in zip(_bits(sequential), _bits(overlapped)))
        assert seq_steps == ovl_steps  # losses (bitwise), drops, reruns, budgets


def test_capacity_modes_drop_and_count_the_same_tokens(mode_results):
    steps = mode_results[1][0]
    capacity, padded = steps["capacity"][1], steps["padded"][1]
    assert all(dropped > 0 for _, dropped, _, _ in capacity)
    assert [d for _, d, _, _ in capacity] == [d for _, d, _, _ in padded]
    assert [loss for loss, *_ in capacity] == [loss for loss, *_ in padded]  # pad rows: prob 0
    assert all(dropped is None for _, dropped, _, _ in steps["dropless"][1])


def test_once_per_rank_trains_as_the_dispatch_per_expert(mode_results):
    """Sending a token once per rank changes the combine's rounding order only: the losses
    stay within rounding of the dispatch per expert's, the same pairs are dropped at a
    capacity, and the expert grads (reduced) differ at most by rounding too."""
    for per_run in mode_results[1]:
        for once, plain in (("once", "dropless"), ("once_capacity", "capacity")):
            once_steps, plain_steps = per_run[once][1], per_run[plain][1]
            assert [d for _, d, _, _ in once_steps] == [d for _, d, _, _ in plain_steps]
            for (loss, *_), (plain_loss, *_) in zip(once_steps, plain_steps):
                assert loss == pytest.approx(plain_loss, rel=1e-5)
            for mine, other in zip(per_run[once][0], per_run[plain][0]):
                torch.testing.assert_close(mine, other, rtol=1e-4, atol=1e-6)


def test_overflowing_budget_reruns_and_gives_the_dropless_losses(mode_results):
    """Every step of the tiny budget overflows, is rerun at a budget that holds its routing,
    and ends with exactly the dropless run's loss; the generous budget never reruns."""
    for per_run in mode_results[1]:
        dropless = [loss for loss, *_ in per_run["dropless"][1]]
        tiny = per_run["tiny_budget"][1]
        assert all(reruns >= 1 and budget > 0.25 for _, _, reruns, budget in tiny)
        assert [loss for loss, *_ in tiny] == dropless
        assert all(reruns == 0 and budget == 2.0 for _, _, reruns, budget in
                   per_run["budget"][1])
        assert [loss for loss, *_ in per_run["budget"][1]] == dropless
        dropless_grads = _bits(per_run["dropless"][0])
        assert all(torch.equal(a, b) for a, b in zip(_bits(per_run["tiny_budget"][0]),
                                                      dropless_grads))
        # once per rank: the budget reruns too, and ends with the dropless once-per-rank run's
        # losses and grads, bit for bit (the same rows, the same sums, padding left out)
        once_tiny = per_run["once_tiny_budget"][1]
        assert all(reruns >= 1 and budget > 0.25 for _, _, reruns, budget in once_tiny)
        assert [loss for loss, *_ in once_tiny] == [loss for loss, *_ in per_run["once"][1]]
        assert all(torch.equal(a, b) for a, b in zip(_bits(per_run["once_tiny_budget"][0]),
                                                      _bits(per_run["once"][0])))


def test_a_budget_with_memory_starts_where_the_last_steps_ended(mode_results):
    """With --moe-dispatch-budget-memory a step starts at the level the steps before needed
    (here the first too: `mode_runs` runs one forward-backward before training): fewer reruns
    than the tiny budget's one or more every step, never the base budget, the same losses."""
    for per_run in mode_results[1]:
        tiny, remembered = per_run["tiny_budget"][1], per_run["tiny_budget_memory"][1]
        assert [loss for loss, *_ in remembered] == [loss for loss, *_ in tiny]
        assert sum(r for _, _, r, _ in remembered) < sum(r for _, _, r, _ in tiny)
        assert all(budget > 0.25 for *_, budget in remembered)


LEVELS = [0.25, 0.5, 1.0, 2.0]  # the budget levels of TINY_BUDGET on 2 ranks
LAYER_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe"]
FULL_GRAPH = ["--cuda-graph-impl", "full_iteration"]
GRAPH_RUNS = [("eager", TINY_BUDGET), ("layer_graphs", TINY_BUDGET + LAYER_GRAPHS),
              ("eager_ovl", TINY_BUDGET + OVERLAP),
              ("full_ovl", TINY_BUDGET + OVERLAP + FULL_GRAPH),
              ("padded", PADDED), ("padded_full", PADDED + FULL_GRAPH),
              ("once", ONCE + TINY_BUDGET), ("once_layer_graphs", ONCE + TINY_BUDGET + LAYER_GRAPHS),
              ("once_ovl", ONCE + TINY_BUDGET + OVERLAP),
              ("once_full_ovl", ONCE + TINY_BUDGET + OVERLAP + FULL_GRAPH)]


def test_graph_banks_serve_the_overflow_reruns(tmp_path):
    """Graphs that hold the dispatch (the whole MoE layer; the full iteration with the overlap)
    under a budget that overflows every step: the last warmup step records the base budget's
    bank and, in its rerun, the larger budget's; both are captured after it and the later
    steps replay them, with exactly the eager losses. A padded capacity needs one bank. The
    same with --moe-dispatch-once-per-rank (whole-layer graphs; the full iteration with the
    overlap)."""
    for rank, runs in enumerate(run_ranks(graphed_training, 2, 2, 3, GRAPH_RUNS,
                                          timeout_s=600)):
        for graphed, eager in (("layer_graphs", "eager"), ("full_ovl", "eager_ovl"),
                               ("padded_full", "padded"), ("once_layer_graphs", "once"),
                               ("once_full_ovl", "once_ovl")):
            steps, banks, lines = runs[graphed]
            assert_paths_differ(lines, runs[eager][2], "graphs")
            assert steps == runs[eager][0], (rank, graphed)
            assert runs[eager][1] is None
            summary = next(line for line in lines if line.startswith("done: "))
            if graphed == "padded_full":
                assert banks == [0]
                assert " | dropped " in summary and " | reruns " not in summary, summary
                continue
            assert all(reruns >= 1 for _, reruns, _ in steps)
            total = sum(reruns for _, reruns, _ in steps)
            assert summary.endswith(f" | reruns {total} (in {len(steps)} steps)"), summary
            finals = {LEVELS.index(budget) for _, _, budget in steps}  # the levels that held
            assert banks[0] == 0 and finals <= set(banks), (rank, graphed, banks)
            if graphed.startswith("once"):  # a rerun whose blocks hold every row can still
                # overflow the experts' budget (its first try saw only the rows sent): again
                assert len(banks) <= 1 + total, (rank, graphed, banks)
            else:
                assert len(banks) == 1 + len(finals), (rank, graphed, banks)
            assert any("CUDA graphs (budget 0.25)" in line for line in lines), lines


PROBED_FULL_RUNS = [("full_ovl", TINY_BUDGET + OVERLAP + FULL_GRAPH),
                    ("probed_full_ovl", TINY_BUDGET + OVERLAP + FULL_GRAPH
                     + ["--overlap-probe-steps", "2"])]


def test_probe_with_full_iteration_graphs_captures_a_graph_per_schedule_and_keeps_the_bits():
    """The deprecated --overlap-probe-steps (the tuner over two paths, the overlap plan and
    sequential) with --cuda-graph-impl full_iteration (2 gloo ranks, capture emulated, a budget
    that overflows every step): the overlap's graphs are captured after the warm-up step, one
    untimed sequential step records the sequential path's (its base budget's and its rerun
    level's), steps 3-6 alternate replays, and after the decision only the kept path's banks
    are left, on every rank. Every loss equals the untuned graphed run's."""
    per_rank = run_ranks(graphed_training, 2, 2, 8, PROBED_FULL_RUNS, timeout_s=600)
    lines = per_rank[0]["probed_full_ovl"][2]
    decision = next(line for line in lines if line.startswith("tune: steps 3-6, "))
    kept = decision.split("(ms): ")[1].split(" for the rest")[0]
    assert kept in ("combined_1f1b", "sequential")
    assert any(line.startswith("tune: the other paths' CUDA graphs released") for line in lines)
    for rank, runs in enumerate(per_rank):
        steps, banks, lines = runs["probed_full_ovl"]
        assert steps == runs["full_ovl"][0], rank  # loss, reruns, budget of every step
        assert all(reruns >= 1 for _, reruns, _ in steps)
        both = next(line for line in lines if "bank ('sequential', 0)" in line)
        assert "bank ('combined_1f1b', 0)" in both, both  # a full graph per path, then
        assert len(banks) == 2 and {key[0] for key in banks} == {kept}, (rank, banks)
        assert (kept, 0) in banks  # the base budget's bank and the rerun level's are left
