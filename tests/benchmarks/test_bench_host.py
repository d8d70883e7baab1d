"""benchmarks/harness/bench_host.py's call-site attribution, on a one-process CPU trainer (torch kernels):
every call of a named op is counted once, at the project line that issued it, forward and
backward; its A/B modes; benchmarks/harness/bench_launch.py refuses cleanly without a GPU; and
benchmarks/harness/bench_a2a_host.py times every piece of an all-to-all over gloo."""

from __future__ import annotations

import os
import time
from unittest import mock

import pytest
import torch

from dist_helpers import single_rank_groups
from epoverlap.config import parse_config
from epoverlap.training.loop.trainer import Trainer
from benchmarks.harness import bench_a2a_host, bench_host, bench_launch

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "8", "--num-experts", "4",
        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--micro-batch-size", "1",
        "--num-microbatches", "2", "--kernel-backend", "torch", "--mock-data",
        "--skip-optimizer-step", "--train-iters", "10", "--moe-aux-loss-coeff", "0.01"]


def test_call_sites_count_each_call_at_its_project_line():
    trainer = Trainer(parse_config(TINY), single_rank_groups(), log=lambda msg: None)
    try:
        inputs = trainer.microbatches(1)
        trainer.run_microbatches(1, inputs)
        found = bench_host.call_sites(trainer, inputs, ["aten::mm", "aten::full_like"])
    finally:
        trainer.close()
    mm_sites = dict((site, calls) for site, calls, _ in found["aten::mm"])
    # 2 layers x 2 microbatches x (qkv, proj, router) forward linears + the head, each with an
    # input-grad and a weight-grad mm in the backward
    forward = [calls for site, calls in mm_sites.items() if site.endswith(" forward")]
    assert sum(forward) == 2 * 2 * 3 + 2, mm_sites
    assert any(site.startswith("model/linear.py:") and site.endswith(" backward")
               for site in mm_sites), mm_sites
    full_like = dict((site, calls) for site, calls, _ in found["aten::full_like"])
    # the loss seed of each microbatch's backward, issued by the executor
    assert sum(calls for site, calls in full_like.items()
               if site.startswith("schedule/executor.py:")) == 2, full_like
    assert all(mean_us > 0 for rows in found.values() for _, _, mean_us in rows)


def test_call_sites_refuses_names_that_are_not_aten_ops(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_host.main(["--call-sites", "aten::fill_", "cudaMemcpyAsync"])
    assert exit_info.value.code == 2
    assert "--call-sites: ['cudaMemcpyAsync'] are not aten ops" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_bench_launch_needs_a_gpu(capsys):
    assert bench_launch.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


def test_fusion_ab_runs_both_sides_in_one_process(monkeypatch):
    """The A/B's unfused side really turns both fusions off (its routers and its grad
    buffers), both sides train the same model to nearly the same loss, and every round
    yields a step time and a per-node table for each side."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)  # CPU trainers
    built = []
    real_trainer = bench_host.Trainer

    def remember(*args, **kwargs):
        built.append(real_trainer(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(bench_host, "Trainer", remember)
    results = bench_host.fusion_ab(single_rank_groups(), TINY, rounds=2, iters=1, warmup=1)
    unfused, fused = built
    assert {getattr(m, "aux_loss_in_op", None) for m in unfused.model.modules()} == {None, False}
    assert {getattr(m, "aux_loss_in_op", None) for m in fused.model.modules()} == {None, True}
    assert {p.fuse_grad_accumulation for p in unfused.model.parameters()} == {False}
    assert {p.fuse_grad_accumulation for p in fused.model.parameters()} == {True}
    for side in ("unfused", "fused"):
        assert len(results[side]["cpu_ms"]) == 2 and len(results[side]["nodes"]) == 2
        assert "F attn" in results[side]["nodes"][0]
    assert abs(results["fused"]["loss"] - results["unfused"]["loss"]) < 1e-3 * abs(
        results["unfused"]["loss"])


def test_schedule_ab_runs_the_three_schedules_to_the_same_bits(monkeypatch, capsys):
    """The schedule A/B builds the sequential step, the combined 1F1B, the combined 1F1B with
    delayed wgrad at EP 1 (overlap lanes over local-copy all-to-alls) and the combined order on
    serial lanes, times each round, and their losses are bit-identical (the overlap contract);
    the table prints every side."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)  # CPU trainers
    results = bench_host.schedule_ab(single_rank_groups(), TINY, rounds=2, iters=1, warmup=1,
                                     top=5)
    assert list(results) == ["sequential", "combined_1f1b", "combined_1f1b_wgrad",
                             "combined_1f1b_one_stream"]
    losses = {side: r["loss"] for side, r in results.items()}
    assert len(set(losses.values())) == 1, losses
    for side, r in results.items():
        assert len(r["cpu_ms"]) == 2 and "F dispatch" in r["nodes"][0], side
        assert bench_host.SPLIT_READ in r["nodes"][0], side  # the dropless dispatch's read
        assert len(r["profile"]["api"]) >= 5 and "function calls" in r["profile"]["python"]
    assert "W " in " ".join(results["combined_1f1b_wgrad"]["nodes"][0])  # the delayed wgrads
    bench_host.print_ab(results)
    table = capsys.readouterr().out
    assert "combined_1f1b_wgrad / sequential: host CPU" in table
    if os.path.exists("/proc/self/task"):  # Linux: the main thread's counters each round
        assert all(len(r["threads"]) == 2 for r in results.values())
        assert any(table[2] >= 0 and table[3] > 0 for table in
                   results["sequential"]["threads"][0].values())
        assert "threads (CPUs this process may use" in table
    two = bench_host.schedule_ab(single_rank_groups(), TINY, rounds=1, iters=1, warmup=1, top=0,
                                 names=["combined_1f1b_one_stream", "sequential"])
    assert list(two) == ["combined_1f1b_one_stream", "sequential"]
    assert two["sequential"]["loss"] == two["combined_1f1b_one_stream"]["loss"] == losses[
        "sequential"]


def test_thread_table_sums_per_name_and_step_and_drops_idle_threads():
    """Two threads of one name sum; counts are per step; a thread that started between the
    readings counts from zero; one that did nothing is left out."""
    before = {"1": ("python", 10, 1, 0, 100.0), "2": ("pt_autograd_0", 5, 0, 1, 20.0),
              "3": ("pt_autograd_0", 0, 0, 0, 0.0), "4": ("idle", 3, 3, 3, 3.0)}
    after = {"1": ("python", 30, 1, 2, 140.0), "2": ("pt_autograd_0", 9, 2, 1, 30.0),
             "3": ("pt_autograd_0", 4, 0, 0, 6.0), "4": ("idle", 3, 3, 3, 3.0),
             "5": ("pt_nccl_watchdg", 2, 0, 0, 1.0)}
    table = bench_host.thread_table(before, after, steps=2)
    assert table == {"python": [10.0, 0.0, 1.0, 20.0], "pt_autograd_0": [4.0, 1.0, 0.0, 8.0],
                     "pt_nccl_watchdg": [1.0, 0.0, 0.0, 0.5]}


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's /proc")
def test_thread_counters_see_a_live_thread_run():
    """Linux's counters of a thread that spins between two readings move: its CPU ms grows
    and it switched (it waited on an event before)."""
    import threading

    go, stop = threading.Event(), threading.Event()

    def work():
        go.wait()
        sum(range(300_000))
        stop.wait()
    worker = threading.Thread(target=work)
    worker.start()
    try:
        before = bench_host.thread_counters()
        go.set()
        tid = str(worker.native_id)
        deadline = time.monotonic() + 10
        def moved(now):  # it ran, and blocked again after its spin (on `stop`)
            return now[tid][4] > before[tid][4] and now[tid][1] >= before[tid][1] + 1
        while not moved(bench_host.thread_counters()) and time.monotonic() < deadline:
            time.sleep(0.01)
        after = bench_host.thread_counters()
    finally:
        stop.set()
        worker.join()
    tid = str(worker.native_id)
    assert after[tid][4] > before[tid][4] and after[tid][1] >= before[tid][1] + 1


def test_cpu_list_reads_ranges_and_refuses_what_is_not_one():
    assert bench_host.cpu_list("3") == {3}
    assert bench_host.cpu_list("2,3") == {2, 3}
    assert bench_host.cpu_list("2-4,8") == {2, 3, 4, 8}
    for bad in ("", "a", "3-", "1,,2"):
        with pytest.raises(Exception, match="CPU list|names no CPU"):
            bench_host.cpu_list(bad)


def test_a2a_host_times_every_piece_and_checks_each_copies(capsys):
    """On one gloo rank every piece of the all-to-all path runs, copies its input (checked by
    the tool), and gets a row; a piece that does not copy stops the tool."""
    with mock.patch.dict(os.environ):  # init_distributed sets RANK, MASTER_PORT, ...
        assert bench_a2a_host.main(["--device", "cpu", "--rows", "8", "--hidden", "4",
                                    "--calls", "2", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    body = rows[2:]  # under the header and its rule
    assert len(body) == 6 and body[3].startswith("| Group.all_to_all_single (short path) |")
    sent = torch.arange(4.0)
    with pytest.raises(SystemExit, match="did not copy"):
        bench_a2a_host.check_copy("a broken piece", lambda: torch.zeros(4), sent)


def test_autograd_share_times_every_node_forward_both_ways(monkeypatch):
    """Every node kind of the tiny model gets a with-autograd and a no_grad time, and the
    pass leaves the trainer able to run a step (the same loss as a fresh trainer's)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)  # CPU trainer
    trainer = Trainer(parse_config(TINY), single_rank_groups(), log=lambda msg: None)
    try:
        inputs = trainer.microbatches(1)
        share = bench_host.autograd_share(trainer, inputs, iters=2)
        assert {"F embed", "F attn", "F mlp", "F combine", "F loss"} <= set(share)
        assert "F dispatch" not in share  # it reads the split exchange: run once, not compared
        segments = {key for key in share if key.startswith("F attn: ")}
        assert segments == {"F attn: attn", "F attn: moe_router", "F attn: moe_preprocess",
                            "F attn: moe_split_exchange"}
        assert all(share[key][1] is None for key in segments)
        assert all(with_grad > 0 and (without is None or without > 0)
                   for with_grad, without in share.values())
        loss = float(sum(trainer.run_microbatches(1, inputs)))
    finally:
        trainer.close()
    fresh = Trainer(parse_config(TINY), single_rank_groups(), log=lambda msg: None)
    try:
        assert float(sum(fresh.run_microbatches(1, fresh.microbatches(1)))) == loss
    finally:
        fresh.close()
