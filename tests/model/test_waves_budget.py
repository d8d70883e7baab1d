"""--moe-a2a-waves K over the budget dispatch (issue 46; `model.waves_budget`). Pure CPU: the
wave indices against an index-by-index reference, the group budget's sizes and reruns. gloo
(2 CPU ranks, EP 2, 3 local experts): training in waves over the budget gives the unsplit
dropless sequential run's grads, losses and grad norms bit for bit, sequential and overlapped
with delayed wgrad, with a budget that overflows every step (reruns) and one that never does;
under the emulated CUDA graphs, one graph over the whole iteration gives the eager losses,
its banks serving the reruns."""

from __future__ import annotations

from pathlib import Path

import torch

from epoverlap.model.budget import DispatchBudget
from epoverlap.model.dispatch.rows import block_indices

from dispatch_workers import graphed_training, mode_runs
from dist_helpers import run_ranks


def test_wave_indices_put_each_run_in_its_wave_and_cut_the_overflow():
    """Runs (rank r, wave k) of send[r][k] rows; wave k holds rows_K[k] slots per rank:
    each slot names its row (or -1), each row its slot in the buffers end to end (or -1)."""
    send_RK, rows_K = [[2, 0], [1, 3], [0, 2]], [2, 2]
    send, ret = block_indices(torch.tensor(send_RK), rows_K, 9)
    expected_send, expected_ret, row, base = [[], []], [-1] * 9, 0, [0, 3 * rows_K[0]]
    for r in range(3):
        for k in range(2):
            for i in range(send_RK[r][k]):
                if i < rows_K[k]:
                    expected_ret[row] = base[k] + r * rows_K[k] + i
                row += 1
    for k in range(2):
        expected_send[k] = [-1] * (3 * rows_K[k])
    for row, slot in enumerate(expected_ret):
        if slot >= 0:
            k = 0 if slot < base[1] else 1
            expected_send[k][slot - base[k]] = row
    assert [s.tolist() for s in send] == expected_send
    assert ret.tolist() == expected_ret  # row 5 (rank 1's 3rd row of wave 1) is cut


def test_group_budget_sizes_per_group_and_joins_the_reruns():
    """2 ranks, 6 experts (groups of 2 and 1 local experts), 16 tokens top-2: waves of
    F x the group's balanced share, the top level all a rank can route a group; a group's
    demand past its wave makes the step rerun at the first level that holds it."""
    budget = DispatchBudget.for_dispatch(0.5, 2, 16, 2, 6, False, torch.device("cpu"))
    group = budget.group_budget([2, 1], 2, 6)
    assert budget.group_budget([2, 1], 2, 6) is group
    assert [group.rows_at(level) for level in range(len(budget.levels))] == [
        [6, 3], [11, 6], [32, 16]]  # 0.5, 1.0 x 16 x 2 x G / 6; then 16 x min(2, G)
    group.note(torch.tensor([[4, 2], [7, 3]]))
    assert budget.demand().tolist() == [0, 0, 7, 3]
    assert budget.rerun_level(budget.demand().tolist()) == 1
    group.note(torch.tensor([[0, 9], [0, 0]]))
    assert budget.rerun_level(budget.demand().tolist()) == 2
    budget.reset_demand()
    assert budget.rerun_level(budget.demand().tolist()) is None


SIX_EXPERTS = ["--num-experts", "6"]  # 3 local experts on each of 2 ranks
SEQ = ["--no-overlap-moe-expert-parallel-comm"]
OVERLAP = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
TINY_BUDGET = ["--moe-dispatch-budget", "0.25"]  # overflows every step
ROOMY_BUDGET = ["--moe-dispatch-budget", "4.0"]  # one level, holding all: never overflows
RUNS = [("dropless", SEQ + SIX_EXPERTS),
        ("tiny_k2", SEQ + SIX_EXPERTS + TINY_BUDGET + ["--moe-a2a-waves", "2"]),
        ("tiny_k3_ovl", OVERLAP + SIX_EXPERTS + TINY_BUDGET + ["--moe-a2a-waves", "3"]),
        ("roomy_k2_ovl", OVERLAP + SIX_EXPERTS + ROOMY_BUDGET + ["--moe-a2a-waves", "2"])]


def test_waves_budget_training_is_bitwise_the_dropless_sequential(tmp_path):
    from epoverlap.cli.compare_losses import compare_loss_logs
    per_rank = run_ranks(mode_runs, 2, 2, str(tmp_path), 3, RUNS, timeout_s=600)
    for rank, runs in enumerate(per_rank):
        ref_grads = runs["dropless"][0]
        for name, _ in RUNS[1:]:
            grads, steps = runs[name]
            for mine, ref in zip(grads, ref_grads):
                assert torch.equal(mine.view(torch.int32), ref.view(torch.int32)), (rank, name)
            reruns = [step[2] for step in steps]
            assert all(reruns) if name.startswith("tiny") else not any(reruns), (name, reruns)
    for name, _ in RUNS[1:]:
        comparison = compare_loss_logs(Path(tmp_path) / "dropless.jsonl",
                                       Path(tmp_path) / f"{name}.jsonl")
        assert comparison.identical, (name, comparison.message)
        assert comparison.steps_compared == comparison.grad_norms_compared == 3


FULL_GRAPH = ["--cuda-graph-impl", "full_iteration"]
WAVES_TINY = OVERLAP + SIX_EXPERTS + TINY_BUDGET + ["--moe-a2a-waves", "2"]
GRAPH_RUNS = [("eager", WAVES_TINY), ("full", WAVES_TINY + FULL_GRAPH)]


def test_full_iteration_graph_of_the_budget_in_waves_gives_the_eager_losses():
    """Capture emulated, a budget that overflows every step: the base bank and the rerun
    levels' banks are captured and replayed, every step's loss, reruns and budget the eager
    run's."""
    for rank, runs in enumerate(run_ranks(graphed_training, 2, 2, 3, GRAPH_RUNS,
                                          timeout_s=600)):
        steps, banks, lines = runs["full"]
        assert steps == runs["eager"][0], rank
        assert all(reruns >= 1 for _, reruns, _ in steps)
        assert banks and banks[0] == 0 and len(banks) >= 2, banks
