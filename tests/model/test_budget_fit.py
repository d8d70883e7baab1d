"""--moe-dispatch-budget-fit: when the fitted base budget changes (`BudgetFit`), the least
factor that holds a demand (`needed_factor`, checked against `fits`, the rule the reruns use),
the rows the fixed blocks send beside the dropless dispatch's (`note_wire`), and its flag's
rule. A training run that fits (2 gloo ranks, graphs emulated) is at the end (slow tier)."""

from __future__ import annotations

import math

import pytest
import torch

from epoverlap.config import parse_config, validate_config
from epoverlap.config.dispatch import budget_levels
from epoverlap.errors import ConfigError
from epoverlap.model.budget import (FIT_GRID, FIT_MARGIN, FIT_SHRINK_STEPS, ByHostBudget,
                                    DispatchBudget)

from dispatch_workers import graphed_training
from dist_helpers import run_ranks

CPU = torch.device("cpu")


def fitted(budget: DispatchBudget, needs: list[float]) -> list:
    """The base budget before each step, each step needing `needs[i]`; -> [(base, fit)]."""
    bases = []
    for need in needs:
        bases.append((budget.levels[0], budget.refit()))
        budget.fit.observe(need)
    return bases


def test_the_first_step_fits_the_base_then_only_an_overflow_grows_it():
    budget = DispatchBudget(1.25, 4, 4096, CPU, memory_steps=3, fit=True)
    budget.fit.observe(1.07)
    base = budget.refit()
    assert base == pytest.approx(1.07 * (1 + FIT_MARGIN), abs=1 / FIT_GRID)
    assert base * FIT_GRID == int(base * FIT_GRID) and base >= 1.07 * (1 + FIT_MARGIN)
    assert budget.levels == budget_levels(base, 4) and budget.level == 0
    budget.remember(1)
    assert fitted(budget, [1.05, 1.12])[1] == (base, None)  # within the base: kept
    grown = budget.refit()  # 1.12 overflowed the base: grown before the next step
    assert grown == pytest.approx(1.12 * (1 + FIT_MARGIN), abs=1 / FIT_GRID)
    assert budget.start_level() == 0  # the remembered levels named the old ladder


def test_the_base_shrinks_only_after_its_steps_and_by_more_than_the_margin():
    budget = DispatchBudget(2.0, 2, 1024, CPU, memory_steps=4, fit=True)
    budget.fit.observe(1.5)
    base = budget.refit()
    steps = fitted(budget, [1.0] * (FIT_SHRINK_STEPS - 1))
    assert all(fit is None for _, fit in steps)
    budget.fit.observe(1.0)
    assert budget.refit() == math.ceil((1.0 + FIT_MARGIN) * FIT_GRID) / FIT_GRID and base > 1.5
    again = DispatchBudget(2.0, 2, 1024, CPU, memory_steps=4, fit=True)
    again.fit.observe(1.0)
    again.refit()
    fitted(again, [0.995] * FIT_SHRINK_STEPS)
    assert again.refit() is None  # less than the margin to gain


def test_the_fit_stays_within_one_and_every_row():
    ranks = 4
    budget = DispatchBudget(1.25, ranks, 4096, CPU, memory_steps=2, fit=True)
    budget.fit.observe(0.5)
    assert budget.refit() == 1.0
    budget.fit.observe(9.0)
    assert budget.refit() == float(ranks) and budget.levels == (float(ranks),)
    assert DispatchBudget(1.25, 2, 64, CPU).refit() is None  # no fit without the flag


def _tuned_budget() -> DispatchBudget:
    """A fitted budget after four tuning steps: steps 1 and 3 (the path chosen later) needed
    1.1 and 1.08, steps 2 and 4 (a waved candidate's) 1.5 and 1.45."""
    budget = DispatchBudget(1.25, 2, 1024, CPU, memory_steps=20, fit=True)
    for step, need in enumerate([1.1, 1.5, 1.08, 1.45], start=1):
        budget.refit()
        budget.fit.observe(need, step)
    assert budget.refit() is None  # 1.5 grew the base before the third step, 1.45 fits it
    assert budget.levels[0] == pytest.approx(1.5 * (1 + FIT_MARGIN), abs=1 / FIT_GRID)
    return budget


def test_the_tuners_choice_leaves_the_fit_with_its_paths_steps_alone():
    """At the decision the window forgets the demand of the steps other paths ran, and the
    base shrinks to the chosen path's before the next step, not 100 steps later."""
    budget = _tuned_budget()
    budget.keep_steps({1, 3})
    assert list(budget.fit.needs) == [1.1, 1.08] and list(budget.fit.steps) == [1, 3]
    assert budget.refit() == math.ceil(1.1 * (1 + FIT_MARGIN) * FIT_GRID) / FIT_GRID
    in_waves = _tuned_budget()
    in_waves.keep_steps({2, 4})  # the path in waves chosen: its demand holds the base
    assert list(in_waves.fit.needs) == [1.5, 1.45] and in_waves.refit() is None
    other = _tuned_budget()
    other.keep_steps({7})  # a path without a step in the window: the window stays
    assert len(other.fit.needs) == 4 and other.refit() is None


def _needs_hold(budget, demand):
    need = budget.needed_factor(demand)
    budget.levels = budget_levels(need, budget.ranks)
    assert budget.fits(0, demand), (need, demand)
    return need


@pytest.mark.parametrize("once_per_rank", [False, True])
def test_the_needed_factor_is_the_least_that_holds_the_demand(once_per_rank):
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        budget = DispatchBudget.for_dispatch(1.25, 4, 512, 4, 16, once_per_rank, CPU)
        budget.group_budget([2, 2], 4, 16)
        rows = torch.randint(budget.rows // 4, budget.rows // 2, (1,), generator=generator)
        pairs = torch.randint(512, 2048, (1,), generator=generator)
        groups = torch.randint(100, 600, (2,), generator=generator)
        demand = [int(rows), int(pairs)] + groups.tolist()
        need = _needs_hold(budget, demand)
        budget.levels = budget_levels(need * 0.97, budget.ranks)
        assert not budget.fits(0, demand)


def test_the_needed_factor_of_the_dispatch_by_host():
    budget = ByHostBudget(1.25, 2, 2, 1024, 8, 64, CPU)
    for demand in ([700, 900, 2500], [300, 1900, 2100], [400, 500, 6000]):
        need = _needs_hold(budget, demand)
        budget.levels = budget_levels(need * 0.97, budget.ranks)
        assert not budget.fits(0, demand)


def test_wire_rows_count_the_blocks_and_the_dropless_rows_to_other_ranks():
    budget = DispatchBudget(1.25, 3, 30, CPU, rank=1)
    budget.reset_wire()
    budget.note_wire(torch.tensor([4, 20, 6]), 12)  # 20 rows stay on this rank
    budget.note_wire(torch.tensor([9, 1, 2]), 12)
    assert budget.wire_rows.tolist() == [48, 21]
    budget.reset_demand()  # a rerun: its exact rows replace the first attempt's
    budget.note_wire(torch.tensor([4, 20, 6]), 24)
    assert budget.wire_rows.tolist() == [96, 10]


def test_the_flag_needs_a_budget():
    with pytest.raises(ConfigError) as info:
        validate_config(parse_config(["--moe-dispatch-budget-fit"]), 2, False)
    assert str(info.value).startswith("--moe-dispatch-budget-fit=") and \
        "needs --moe-dispatch-budget" in str(info.value)


TINY_BUDGET = ["--moe-dispatch-budget", "0.25"]
OVERLAP = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
FULL_GRAPH = ["--cuda-graph-impl", "full_iteration"]
FIT = ["--moe-dispatch-budget-fit", "--moe-dispatch-budget-memory", "4"]
FIT_RUNS = [("eager", TINY_BUDGET + OVERLAP), ("full_fit", TINY_BUDGET + OVERLAP + FULL_GRAPH
                                               + FIT)]


@pytest.mark.slow
def test_a_fitted_budget_recaptures_its_graph_and_keeps_the_bits():
    """A budget a quarter of the balanced share, fitted after the first step (2 gloo ranks,
    the overlap in one graph of the iteration, capture emulated, warmup 1): the first step
    records and captures the base's bank, its rerun runs eagerly (no bank for a level the fit
    leaves at once); the fit grows the base before the second, which releases the bank,
    records and captures the fitted base's; every loss equals the unfitted eager run's, fewer
    steps rerun."""
    for rank, runs in enumerate(run_ranks(graphed_training, 2, 2, 4, FIT_RUNS,
                                          timeout_s=600)):
        (eager, _, _), (steps, banks, lines) = runs["eager"], runs["full_fit"]
        assert [loss for loss, *_ in steps] == [loss for loss, *_ in eager], rank
        assert steps[0][1] >= 1 and all(budget > 0.25 for *_, budget in steps[1:])
        assert sum(reruns for _, reruns, _ in steps) < sum(reruns for _, reruns, _ in eager)
        assert banks == [0], banks  # the banks of step 1 released, the fitted base's left
        captures = [line for line in lines if line.startswith("CUDA graphs (budget ")]
        assert len(captures) == 2 and captures[0].startswith(
            "CUDA graphs (budget 0.25): 1 captured after step 1"), captures  # not the rerun's
        assert captures[-1].startswith(f"CUDA graphs (budget {steps[1][2]:g}): 1 captured "
                                       "after step 2"), captures
        if rank == 0:  # the run's report
            assert any(line.startswith("dispatch budget: before step 2, fitted to the demand, "
                                       "0.25 -> ") and line.endswith(" are recaptured")
                       for line in lines), lines  # step 1 had captured the base's bank
            last = next(line for line in lines if line.startswith("step    4/4 "))
            sent = float(last.split(" | a2a rows ")[1].split("x exact")[0])
            assert 1.0 <= sent <= 2.0, last  # no rerun: the blocks hold every row sent
