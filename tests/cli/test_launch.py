"""Launch tier: the main job under torchrun on 2 CPU ranks, a two-node launch on one machine,
CLI errors, the loss-comparison tool and the timeline tool on a real profiled run.

The torchrun launches are the slow tier (`-m slow`) but one: overlap + delayed wgrad against
the sequential schedule through the CLI, bit for bit in loss and grad norm, runs by default."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import free_port
from epoverlap.config.resolve import SEQUENTIAL_FLAG

REPO = Path(__file__).resolve().parents[2]
QUICK = ["--preset", "tiny", "--hidden-size", "64", "--seq-length", "64",
         "--num-microbatches", "2", "--train-iters", "12", "--lr-warmup-iters", "2",
         "--distributed-timeout-minutes", "3"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # the main job picks the torch backend on CPU itself
    return env


def _run(cmd, timeout=300, cwd=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=cwd or REPO)


def _torchrun(nproc, *flags):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "epoverlap.train", *flags]


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_main_job_on_two_cpu_ranks_reduces_the_loss(tmp_path):
    log = tmp_path / "losses.jsonl"
    result = _run(_torchrun(2, *QUICK, "--expert-model-parallel-size", "2",
                            "--overlap-moe-expert-parallel-comm", "--log-json", str(log)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step   12/12" in result.stdout
    losses = _losses(log)
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def test_launcher_defaults_pass_through_user_flags():
    from epoverlap.cli.launch import default_train_args, split_launcher_flags
    # the launcher adds only the quick-start model; the training command resolves the rest
    args = default_train_args(False, ["--preset", "small", "--train-iters", "3"])
    assert args == ["--preset", "small", "--train-iters", "3"]
    assert default_train_args(True, []) == ["--preset", "small"]
    assert default_train_args(False, ["--cuda-graph-impl", "none"]) == \
        ["--preset", "tiny", "--cuda-graph-impl", "none"]
    assert split_launcher_flags(["--nproc", "4", "--bf16"]) == ({"--nproc": "4"}, ["--bf16"])


@pytest.mark.slow
def test_two_node_launch_on_one_machine_runs_to_the_end(tmp_path):
    port = free_port()
    common = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
              "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              "--rdzv-id=epoverlap-test", "-m", "epoverlap.train", *QUICK,
              "--train-iters", "4", "--expert-model-parallel-size", "2",
              "--overlap-moe-expert-parallel-comm"]
    nodes = [subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env(), cwd=REPO) for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    assert any("step    4/4" in out for out, _ in outputs)


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--expert-model-parallel-size", "4"], "--expert-model-parallel-size=4: must divide"),
    (["--moe-router-topk", "99"], "--moe-router-topk=99: must be in [1, --num-experts=8]"),
    (["--delay-wgrad-compute"], "--delay-wgrad-compute=True: requires"),
    (["--data-path", "/no/such", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"],
     "--data-path=/no/such: /no/such.idx: no such file"),
])
def test_bad_flags_exit_2_with_one_line_and_no_traceback(flags, message):
    result = _run([sys.executable, "-m", "epoverlap.train", "--preset", "tiny", *flags])
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_overlap_on_and_off_write_identical_losses_per_compare_tool(tmp_path):
    """Default tier. 4 microbatches (with 2, a schedule that ran the second backward before the
    first summed the same two grads, a + b = b + a, and passed), and the grad norms compared
    beside the losses: a swapped backward shows in step 1's grad norm (a plan that ran the
    backwards in the order 0, 2, 1, 3 changed every step's grad norm and no loss in 4 steps).
    Mock data: reading the stdlib sources would add ~6 s per run and nothing to the check."""
    logs = []
    for name, extra in (("off", [SEQUENTIAL_FLAG]), ("on", ["--overlap-moe-expert-parallel-comm",
                                             "--delay-wgrad-compute"])):
        log = tmp_path / f"{name}.jsonl"
        result = _run(_torchrun(2, *QUICK, "--num-microbatches", "4", "--train-iters", "4",
                                "--deterministic-mode", "--expert-model-parallel-size", "2",
                                "--mock-data", "--log-json", str(log), *extra))
        assert result.returncode == 0, result.stderr[-3000:]
        plan = "sequential" if name == "off" else "combined_1f1b + delayed wgrad"
        assert f"| plan {plan} |" in result.stdout, result.stdout[-2000:]
        logs.append(str(log))
    compare = _run(["epoverlap-compare-losses", *logs])
    assert compare.returncode == 0, compare.stdout + compare.stderr
    assert compare.stdout.strip() == "identical (4 steps): losses and grad norms"


@pytest.mark.slow
def test_profiled_run_gives_trace_png_and_table(tmp_path):
    spans, out = tmp_path / "spans", tmp_path / "timeline"
    result = _run(_torchrun(2, *QUICK, "--train-iters", "3", "--expert-model-parallel-size", "2",
                            "--overlap-moe-expert-parallel-comm", "--profile-steps", "2:3",
                            "--profile-dir", str(spans)))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]  # the end-of-run line
    assert summary.startswith("done: 3 steps in ") and " tok/s | loss " in summary, summary
    assert "GiB per rank (RSS, max over ranks)" in summary and "TFLOP/s per rank" in result.stdout
    assert "| exposed comm " in summary and "(profiled steps 2:3, max over ranks)" in summary
    assert sorted(p.name for p in spans.iterdir()) == ["spans-rank00000.json",
                                                       "spans-rank00001.json"]
    timeline = _run(["epoverlap-timeline", str(spans), "--out-dir", str(out)])
    assert timeline.returncode == 0, timeline.stdout + timeline.stderr
    trace = json.loads((out / "timeline_trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e.get("name") for e in events}
    assert "F1.dispatch.L0" in names and "B0.combine.L1" in names
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "timeline_summary.json").read_text())
    assert summary
    assert "exposed" in timeline.stdout.lower()


@pytest.mark.slow
def test_bench_overlap_on_two_cpu_ranks_reports_every_mode_and_the_timeline(tmp_path,
                                                                            monkeypatch):
    """The overlap benchmark end to end on gloo: every mode timed, the comm replay, and the
    profiled steps' timeline figures beside the benchmark's exposed comm; the NCCL settings
    of the environment recorded with them."""
    monkeypatch.setenv("NCCL_BUFFSIZE", "33554432")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "benchmarks.harness.bench_overlap", "--shapes", "quick", "--profile-shapes",
           "quick", "--out-dir", str(tmp_path), "--iters", "1", "--warmup", "0",
           "--profile-steps", "2", "--rounds", "2"]
    result = _run(cmd, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "bench_overlap.json").read_text())
    assert report["world"] == 2
    assert report["nccl_env"]["NCCL_BUFFSIZE"] == "33554432"
    assert "NCCL_DEBUG" not in report["nccl_env"]  # logging, not a setting
    assert "; NCCL environment: " in result.stdout and "NCCL_BUFFSIZE=33554432" in result.stdout
    shape = report["results"][0]
    for mode in ("seq", "ovl", "ovl_wgrad", "comp"):
        assert shape[mode]["fb_ms"] > 0
        assert len(list((tmp_path / "spans" / "quick" / mode).glob("*"))) == 2  # one per rank
        figures = shape["timeline"][mode]
        assert 0 <= figures["exposed_ms"] <= figures["exposed_max_rank_ms"] <= figures["step_ms"]
        assert figures["comm_ms"] > 0
    assert shape["comm"]["fb_ms"] > 0
    for timed in ("seq", "ovl", "comm"):  # --rounds 2: every mode and the replay, medians
        rounds = shape[timed]["fb_ms_rounds"]
        assert len(rounds) == 2 and shape[timed]["fb_ms"] == statistics.median(rounds)
    derived = shape["derived"]
    assert derived["timeline_net_exposed_ovl_ms"] == (shape["timeline"]["ovl"]["exposed_ms"]
                                                   - shape["timeline"]["comp"]["exposed_ms"])
    assert derived["ratio"] == shape["comm"]["fb_ms"] / shape["comp"]["fb_ms"]
    seq, ovl = shape["seq"]["fb_ms"], shape["ovl"]["fb_ms"]
    best = max(shape["comp"]["fb_ms"], shape["comm"]["fb_ms"])
    if seq > best:
        assert abs(derived["realized_ovl"] - (seq - ovl) / (seq - best)) < 1e-9
    assert "| quick | ovl |" in result.stdout and "| quick | off |" in result.stdout
    # the compute lane's own time, waits apart: seq against itself is 1 exactly
    assert shape["timeline"]["seq"]["compute_slowdown_vs_seq"] == 1.0
    assert shape["timeline"]["ovl"]["compute_wait_ms"] > 0  # ovl waits on the comm thread
    # the comm lane against seq's, and its share of the step
    assert shape["timeline"]["seq"]["comm_slowdown_vs_seq"] == 1.0
    ovl_figures = shape["timeline"]["ovl"]
    assert ovl_figures["comm_slowdown_vs_seq"] == (ovl_figures["comm_ms"]
                                                   / shape["timeline"]["seq"]["comm_ms"])
    assert ovl_figures["comm_busy_share"] == ovl_figures["comm_ms"] / ovl_figures["step_ms"]
    assert 0 < ovl_figures["comm_busy_share"] <= 1
    compare = _run([sys.executable, "-m", "epoverlap.cli.timeline", "--compare",
                    str(tmp_path / "spans" / "quick" / "seq"),
                    str(tmp_path / "spans" / "quick" / "ovl_wgrad"), "--out-dir", str(tmp_path)])
    assert compare.returncode == 0, compare.stdout + compare.stderr
    rows = json.loads((tmp_path / "timeline_compare.json").read_text())["rows"]
    labels = [row["row"] for row in rows]
    assert "0 mlp wgrad" in labels and "L1 all" in labels and labels[-1] == "all layers"
    total = rows[-1]
    assert total["slowdown"] == total["other_compute_us"] / total["base_compute_us"]
    assert shape["timeline"]["ovl_wgrad"]["compute_slowdown_vs_seq"] == \
        pytest.approx(total["slowdown"])


def test_nccl_environment_keeps_the_settings_and_leaves_out_the_logging():
    from benchmarks.harness.bench_overlap import nccl_environment, nccl_environment_text
    environ = {"NCCL_P2P_PCI_CHUNKSIZE": "2097152", "NCCL_DEBUG": "INFO",
               "NCCL_DEBUG_SUBSYS": "ENV", "NCCL_P2P_DISABLE": "1", "PATH": "/bin",
               "TORCH_NCCL_BLOCKING_WAIT": "1"}
    settings = nccl_environment(environ)
    assert settings == {"NCCL_P2P_DISABLE": "1", "NCCL_P2P_PCI_CHUNKSIZE": "2097152"}
    assert nccl_environment_text(settings) == "NCCL environment: NCCL_P2P_PCI_CHUNKSIZE=2097152"
    assert nccl_environment_text({}) == "NCCL environment: NCCL's defaults"


def test_bench_overlap_budget_rows_take_the_budgets_own_comp_and_comm():
    """--sync-free's rows (the budget eager, and under one full-iteration graph) are read
    against their own T_comp and the budget's all-to-alls replayed alone, not the eager
    dropless ones; hand-made timings, the ratios worked out here."""
    from benchmarks.harness.bench_overlap import derived, markdown

    def mode(ms):
        return {"fb_ms": ms, "step_ms": ms + 1.0, "peak_gib": 2.0, "static_gib": 1.0,
                "peak_reserved_gib": 3.0, "tokens_per_s_per_gpu": 1e3}
    result = {"shape": "s", "comm": {"fb_ms": 20.0}, "comm_budget": {"fb_ms": 30.0}}
    for suffix, (seq, ovl, wgrad, comp) in {"": (300.0, 330.0, 340.0, 280.0),
                                            "_budget": (320.0, 360.0, 350.0, 300.0),
                                            "_full": (150.0, 140.0, 138.0, 120.0)}.items():
        for name, ms in (("seq", seq), ("ovl", ovl), ("ovl_wgrad", wgrad), ("comp", comp)):
            result[name + suffix] = mode(ms)
    result["derived"] = out = derived(result)
    assert out["ratio"] == 20.0 / 280.0 and out["ratio_full"] == 30.0 / 120.0
    assert out["seq_over_ovl_full"] == 150.0 / 140.0
    assert out["ovl_full_over_ideal"] == 140.0 / 120.0
    assert out["realized_ovl_full"] == (150.0 - 140.0) / (150.0 - 120.0)
    assert out["realized_ovl_wgrad_budget"] == (320.0 - 350.0) / (320.0 - 300.0)
    rows = {line.split(" | ")[1]: line for line in markdown([result], 2).splitlines()
            if line.startswith("| s |")}
    assert set(rows) == {"off", "budget, eager", "budget, full"}
    assert " | 30.00 | " in rows["budget, full"] and " | 20.00 | " in rows["off"]


@pytest.mark.slow
def test_bench_overlap_graphs_need_cuda_in_one_line():
    result = _run([sys.executable, "-m", "benchmarks.harness.bench_overlap", "--graphs"])
    assert result.returncode == 2
    assert "needs a CUDA device" in result.stderr and "Traceback" not in result.stderr


def _scalars(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_main_job_trains_from_converted_indexed_data_and_writes_tensorboard(tmp_path):
    """The README's two commands (convert, then train from PREFIX.bin/.idx), with TensorBoard
    scalars and one profiled step's exposed comm read back from the event file."""
    pytest.importorskip("tensorboard", reason="the 'tensorboard' extra is not installed")
    prefix, board = tmp_path / "data" / "epoverlap-src", tmp_path / "tb"
    convert = _run([sys.executable, "-m", "epoverlap.cli.convert_data", "--input",
                    str(REPO / "epoverlap"), "--output-prefix", str(prefix), "--append-eod"])
    assert convert.returncode == 0, convert.stderr
    assert f"--data-path {prefix} --tokenizer-type NullTokenizer --vocab-size 256" \
        in convert.stdout
    result = _run(_torchrun(2, *QUICK, "--train-iters", "4", "--expert-model-parallel-size", "2",
                            "--overlap-moe-expert-parallel-comm", "--data-path", str(prefix),
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
                            "--tensorboard-dir", str(board), "--profile-steps", "3:3",
                            "--profile-dir", str(tmp_path / "spans")))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: indexed" in result.stdout and "vocabulary 257" in result.stdout
    assert "ETA" in result.stdout and "exposed comm" in result.stdout
    scalars = _scalars(board)
    for tag in ("lm loss", "learning-rate", "grad-norm", "load-imbalance", "tokens-per-sec",
                "iteration-time", "load_balancing_loss"):
        assert sorted(scalars[tag]) == [1, 2, 3, 4], tag
    assert sorted(scalars["comm/exposed-comm-ms"]) == [3]
    assert 0 < scalars["comm/exposed-comm-ms"][3] <= scalars["comm/comm-ms"][3]
    assert scalars["lm loss"][1] > 4.0
