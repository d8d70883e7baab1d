"""benchmarks/harness/bench_peer.py: the FLOP count both systems are rated by, against a hand count; the
report (derived figures, tables, JSON; ours against Megatron-core's and torchtitan's best
modes); the one-line refusals before any process group; our
side end to end on two CPU ranks; Megatron-core's model as the tool translates our config,
against ours (needs the peer extra; built on the CPU); the whole benchmark on one and two GPUs
(markers `gpu`, `multigpu`)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from epoverlap.config import parse_config
from epoverlap.model.flops import training_flops_per_token
from benchmarks.harness import bench_peer
from benchmarks.harness.bench_overlap import SHAPES

from dist_helpers import run_ranks
from job_control import job_env
from peer_workers import megatron_and_our_parameters

REPO = Path(__file__).resolve().parents[2]
has_megatron = bench_peer.megatron_installed()  # `megatron.core`, not a leftover folder
needs_megatron = pytest.mark.skipif(not has_megatron, reason="megatron-core is not installed "
                                    "(pip install -e '.[peer]')")


def test_flop_count_matches_a_hand_count():
    """One layer, hidden 8, 2 heads of 4 with 1 key/value group, sequence 4, 4 experts top-2 of
    width 6, vocabulary 16 (unpadded): every matmul of one token's forward, counted by hand."""
    cfg = parse_config(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
                        "--num-query-groups", "1", "--seq-length", "4", "--num-experts", "4",
                        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "6",
                        "--make-vocab-size-divisible-by", "16"]).with_vocab_size(16)
    qkv = 2 * 8 * (2 * 4 + 2 * 1 * 4)  # 8 -> q (2 heads x 4) + k, v (1 group x 4 each)
    proj = 2 * (2 * 4) * 8
    router = 2 * 8 * 4
    experts = 2 * (2 * 8 * (2 * 6) + 2 * 6 * 8)  # 2 routed copies: gate+up 8 -> 12, down 6 -> 8
    attention = 2 * (2 * 4 * 4 + 2 * 4 * 4) // 2  # 2 heads: QK^T and PV over 4 keys, causal half
    head = 2 * 8 * 16
    forward = qkv + proj + router + experts + attention + head
    assert forward == 1344
    # backward: twice the forward
    assert training_flops_per_token(cfg.model, cfg.moe) == 3 * forward


def _run(step_ms, tokens, loss=(5.5, 5.0)):
    """A run as summarize writes it: three timed steps whose median is `step_ms`."""
    return {"step_ms": step_ms, "step_ms_samples": [step_ms * 1.2, step_ms, step_ms * 0.9],
            "tokens_per_s_per_gpu": tokens, "tflops_per_gpu": 1.0, "peak_gib": 2.0,
            "loss_first": loss[0], "loss_last": loss[1], "steps": 8}


def test_report_figures_tables_and_json(tmp_path):
    runs = {"megatron": {"seq": _run(400.0, 80e3), "ovl": _run(500.0, 64e3)},
            "epoverlap": {"seq": _run(200.0, 160e3), "ovl": _run(160.0, 200e3)}}
    d = bench_peer.derived(runs)
    assert d["best_mode_megatron"] == "seq" and d["best_mode_epoverlap"] == "ovl"
    assert d["overlap_gain_megatron"] == 0.8 and d["overlap_gain_epoverlap"] == 1.25
    assert d["epoverlap_seq_over_megatron_best"] == 2.0
    assert d["epoverlap_ovl_over_megatron_best"] == 2.5
    skipped = {"megatron": {"seq": _run(400.0, 80e3), "ovl": {"skipped": "EP = 1"}}}
    assert bench_peer.derived(skipped) == {"best_mode_megatron": "seq"}
    results = [{"shape": "quick", "runs": runs, "derived": d},
               {"shape": "tiny", "runs": skipped, "derived": bench_peer.derived(skipped)}]
    table = bench_peer.markdown(results)
    assert ("| quick | epoverlap | ovl | 160.0 | 144.0 - 192.0 (3) | 200.0k | 1.0 | 2.00 | "
            "5.500 | 5.000 |") in table
    assert "| quick | seq | 2.00 | 2.50 | 1.25 | 0.80 |" in table
    assert "| tiny | megatron | ovl | not run (see above) | - | - | - | - | - | - |" in table
    assert "| tiny | seq | - | - | - | - |" in table
    report = {"world": 1, "systems": ["megatron"], "warmup": 3, "steps": 8, "device": "x",
              "nccl_p2p_disable": "0", "results": results}
    header = bench_peer.header(report)
    assert header[0].endswith("eager; NCCL environment: NCCL's defaults")
    assert header[1:3] == [f"note: {caveat}" for caveat in bench_peer.CAVEATS]
    with_settings = bench_peer.header({**report, "nccl_env": {"NCCL_BUFFSIZE": "33554432"}})
    assert with_settings[0].endswith("eager; NCCL environment: NCCL_BUFFSIZE=33554432")
    assert header[-1] == "not run: tiny megatron ovl: EP = 1"
    path = bench_peer.write_report(report, str(tmp_path / "out"))
    assert json.loads(path.read_text()) == report


def test_tables_take_each_median_from_the_steps_samples():
    """A run whose stored step_ms is not its samples' median: the tables, the derived figures
    and the log line use the samples' (tokens/s/GPU scaled to it)."""
    ours = {**_run(200.0, 160e3), "step_ms_samples": [100.0, 400.0, 300.0, 250.0]}  # median 275
    runs = {"megatron": {"seq": _run(550.0, 160e3 * 200 / 550)}, "epoverlap": {"seq": ours}}
    d = bench_peer.derived(runs)
    assert d["epoverlap_seq_over_megatron_best"] == pytest.approx(550.0 / 275.0)
    table = bench_peer.markdown([{"shape": "quick", "runs": runs, "derived": d}])
    assert "| quick | epoverlap | seq | 275.0 | 100.0 - 400.0 (4) | 116.4k | 0.7 |" in table
    assert bench_peer.run_line(ours).startswith("step 275.0 ms (median of 4), 116.4k tok/s/GPU")


def _fake_runner(seconds):
    """A system's runner that times no model: each step takes the next of `seconds`."""
    def runner(cfg, groups, data, steps, **kwargs):
        return {"samples": [bench_peer.StepSample(s, 5.0, None) for s in seconds[:steps]]}
    return runner


def test_json_holds_every_timed_step_of_every_system(tmp_path, monkeypatch):
    """bench_shape and the JSON on one gloo rank, each system's runner replaced by one with
    known step times (Megatron-core's side needs a GPU, torchtitan's a long CPU run): every
    system's every mode keeps its timed steps' samples after the warmup, and its step_ms is
    their median."""
    times = {"megatron": [9.0, 0.5, 0.7, 0.6], "epoverlap": [9.0, 0.2, 0.4, 0.3],
             "torchtitan": [9.0, 0.3, 0.6, 0.5]}
    monkeypatch.setattr(bench_peer, "RUNNERS", {name: _fake_runner(times[name])
                                                for name in ("megatron", "epoverlap")})
    monkeypatch.setattr(bench_peer, "run_epoverlap", bench_peer.RUNNERS["epoverlap"])  # flags
    monkeypatch.setattr(bench_peer, "run_torchtitan", _fake_runner(times["torchtitan"]))
    args = bench_peer.parse_args(["--shapes", "quick", "--warmup", "1", "--iters", "3",
                                  "--systems", "megatron,epoverlap,torchtitan",
                                  "--ours-ovl-flags=--delay-wgrad-compute"])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # init_distributed sets them for one rank
    groups = bench_peer.init_distributed(1, "cpu")
    try:
        result = bench_peer.bench_shape("quick", args.systems, groups, args, lambda msg: None)
    finally:
        bench_peer.destroy_distributed(groups)
    path = bench_peer.write_report(bench_peer.full_report(args, 1, [result]), str(tmp_path))
    runs = json.loads(path.read_text())["results"][0]["runs"]
    from benchmarks.harness.peer_torchtitan import MODES as TORCHTITAN_MODES
    assert set(runs) == {"megatron", "epoverlap", "torchtitan"}
    assert set(runs["torchtitan"]) == set(TORCHTITAN_MODES)
    assert set(runs["epoverlap"]) == {"seq", "ovl", "ovl_flags"}
    for system, modes in runs.items():
        for mode, run in modes.items():
            expected = [1e3 * s for s in times[system][1:]]
            assert run["step_ms_samples"] == pytest.approx(expected), (system, mode)
            assert run["step_ms"] == pytest.approx(sorted(expected)[1])


def _refusal(monkeypatch, capsys, argv):
    monkeypatch.delenv("RANK", raising=False)
    assert bench_peer.main(argv) == 2
    assert not dist.is_initialized()
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_without_megatron_core_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "megatron", None)  # `import megatron.core` fails
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    assert _refusal(monkeypatch, capsys, ["--shapes", "quick"]) == bench_peer.INSTALL_HINT
    assert "pip install -e '.[peer]'" in bench_peer.INSTALL_HINT


def test_without_torchtitan_it_says_how_to_install_it(monkeypatch, capsys):
    from benchmarks.harness import peer_torchtitan
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # `import torchtitan...` fails
    monkeypatch.setitem(sys.modules, "torchtitan.models.common", None)
    assert _refusal(monkeypatch, capsys, ["--shapes", "quick", "--systems",
                                          "epoverlap,torchtitan"]) == peer_torchtitan.INSTALL_HINT


def test_report_rates_ours_against_torchtitans_best_mode():
    runs = {"epoverlap": {"seq": _run(200.0, 160e3), "ovl": _run(160.0, 200e3)},
            "torchtitan": {"a2a": _run(400.0, 80e3), "a2a_compile": _run(320.0, 100e3),
                           "masync": {"skipped": "torchtitan refuses it: EP 1"}}}
    d = bench_peer.derived(runs)
    assert d["best_mode_torchtitan"] == "a2a_compile"
    assert d["epoverlap_seq_over_torchtitan_best"] == 1.6
    assert d["epoverlap_ovl_over_torchtitan_best"] == 2.0
    table = bench_peer.markdown([{"shape": "quick", "runs": runs, "derived": d}])
    assert "| quick | torchtitan | masync | not run (see above) |" in table
    assert table.splitlines()[-1] == "| quick | a2a_compile | 320.0 | 1.60 | 2.00 |"


@pytest.mark.parametrize("argv, says", [
    (["--shapes", "quick,nope", "--systems", "epoverlap"], "--shapes quick,nope: allowed: "),
    (["--systems", "epoverlap,deepspeed"], "--systems epoverlap,deepspeed: allowed: "),
    (["--systems", "epoverlap", "--iters", "0"], "the timed steps >= 1"),
])
def test_bad_flags_are_one_line_before_any_process_group(monkeypatch, capsys, argv, says):
    assert says in _refusal(monkeypatch, capsys, argv)


@needs_megatron
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_megatron_side_needs_a_gpu_in_one_line(monkeypatch, capsys):
    err = _refusal(monkeypatch, capsys, ["--shapes", "quick"])
    assert "runs on CUDA GPUs only" in err and "--systems epoverlap" in err


def _bench(tmp_path, nproc, *flags, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "benchmarks.harness.bench_peer", "--shapes",
           "quick", "--out-dir", str(tmp_path), *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env(),
                            cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((tmp_path / "bench_peer.json").read_text()), result.stdout


def _check_run(run, steps):
    assert run["step_ms"] > 0 and run["tokens_per_s_per_gpu"] > 0 and run["steps"] == steps
    assert math.isfinite(run["loss_first"]) and math.isfinite(run["loss_last"])
    assert 0 < run["loss_last"] < 2 * math.log(256)  # a byte-vocabulary LM, mean cross-entropy
    cfg = parse_config(SHAPES["quick"]).with_vocab_size(256)
    tokens = bench_peer.tokens_per_step_per_gpu(cfg)
    assert math.isclose(run["tokens_per_s_per_gpu"], tokens / (run["step_ms"] / 1e3))
    assert math.isclose(run["tflops_per_gpu"], training_flops_per_token(cfg.model, cfg.moe)
                        * tokens / (run["step_ms"] / 1e3) / 1e12)


@pytest.mark.slow
def test_our_side_on_two_cpu_ranks(tmp_path):
    """`--systems epoverlap` on gloo: both modes, the overlap with `--ours-ovl-flags` and the
    sequential step with `--ours-seq-flags`, train 3 steps on the same batches (the same init:
    the same losses, to the once-per-rank dispatch's rounding), the report's figures and the
    table printed last."""
    once = "--moe-dispatch-once-per-rank"
    report, stdout = _bench(tmp_path, 2, "--systems", "epoverlap", "--warmup", "1", "--iters",
                            "2", f"--ours-ovl-flags=--delay-wgrad-compute {once}",
                            f"--ours-seq-flags={once}")
    assert report["world"] == 2 and report["steps"] == 3 and report["device"] == "cpu (gloo)"
    assert report["ours_ovl_flags"] == ["--delay-wgrad-compute", once]
    assert report["ours_seq_flags"] == [once]
    runs = report["results"][0]["runs"]["epoverlap"]
    for mode in ("seq", "ovl", "seq_flags", "ovl_flags"):
        _check_run(runs[mode], 3)
        assert runs[mode]["peak_gib"] is None  # not measured on CPU
        assert abs(runs["seq"]["loss_last"] - runs[mode]["loss_last"]) < 1e-4
    derived = report["results"][0]["derived"]
    assert derived["overlap_gain_epoverlap"] == runs["seq"]["step_ms"] / runs["ovl"]["step_ms"]
    assert derived["overlap_gain_epoverlap_flags"] == (runs["seq_flags"]["step_ms"]
                                                       / runs["ovl_flags"]["step_ms"])
    assert runs["seq_flags"]["loss_last"] == runs["ovl_flags"]["loss_last"]  # the contract
    assert "best_mode_megatron" not in derived
    assert stdout.rstrip().splitlines()[-1].startswith("| quick | - | - | - | ")


@needs_megatron
@pytest.mark.slow
def test_megatron_core_builds_the_same_model_as_ours():
    """bench_peer's translation of our config (grouped-query attention with query/key norms, a
    dense layer, a shared expert) gives Megatron-core's GPTModel the same parameters as ours:
    every non-expert tensor's shape and the expert elements; Megatron-core refuses its overlap
    at EP 1."""
    flags = SHAPES["quick"] + ["--num-query-groups", "2", "--moe-layer-freq", "[0,1]",
                               "--moe-shared-expert-intermediate-size", "128",
                               "--ffn-hidden-size", "384", "--qk-layernorm"]
    [result] = run_ranks(megatron_and_our_parameters, 1, flags, timeout_s=240)
    assert result["megatron"] == result["epoverlap"]
    assert result["megatron"][1] == 8 * 3 * 256 * 256  # one MoE layer: 8 experts, SwiGLU
    cfg = parse_config(flags)
    assert result["config"] == {name: getattr(cfg.moe, name)
                                for name in bench_peer.SHARED_MOE_FIELDS}
    assert "only supported with expert model parallelism" in result["ep1_overlap_refusal"]


def _check_gpu_report(report, world):
    shape = report["results"][0]
    assert report["world"] == world and report["steps"] == 3
    assert report["caveats"] == list(bench_peer.CAVEATS)
    for system in ("megatron", "epoverlap"):
        run = shape["runs"][system]["seq"]
        _check_run(run, 3)
        assert run["peak_gib"] > 0
    return shape


@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_both_systems_on_one_gpu(tmp_path):
    """World 1: both sequential runs train; both overlapped modes are refused with the
    systems' own reasons (EP 1: nothing to hide)."""
    report, stdout = _bench(tmp_path, 1, "--warmup", "1", "--iters", "2")
    runs = _check_gpu_report(report, 1)["runs"]
    assert "megatron-core refuses it" in runs["megatron"]["ovl"]["skipped"]
    assert "epoverlap refuses it" in runs["epoverlap"]["ovl"]["skipped"]
    assert "note: Megatron-core 0.16.1 as it installs here" in stdout


@pytest.mark.multigpu
@needs_megatron
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
def test_both_systems_both_modes_on_two_gpus(tmp_path):
    """EP 2: all four runs train on the same batches; the comparison figures are there."""
    report, _ = _bench(tmp_path, 2, "--warmup", "1", "--iters", "2")
    shape = _check_gpu_report(report, 2)
    for system in ("megatron", "epoverlap"):
        _check_run(shape["runs"][system]["ovl"], 3)
    derived = shape["derived"]
    for key in ("overlap_gain_megatron", "overlap_gain_epoverlap",
                "epoverlap_seq_over_megatron_best", "epoverlap_ovl_over_megatron_best"):
        assert derived[key] > 0
