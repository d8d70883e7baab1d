"""The one-GPU torchtitan peer (benchmarks/harness/peer_titan_1gpu.py, peer_titan_rounds.py,
titan_shapes.py): its log parser, its commands and figures without torchtitan; with the carry
(`.titan/`, or EPOVERLAP_TITAN_CARRY; absent in CI, where those tests skip), torchtitan
d84e83dc4 imported from it, its configs parsed by its own ConfigManager, its model at the
presets' structure with epoverlap's parameter count, one forward and backward, the random
tokens, and its Trainer training from the runner's command line on the CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import peer_titan_1gpu as titan
from benchmarks.harness import peer_titan_rounds as rounds

REPO = Path(__file__).resolve().parents[2]

# torchtitan's step lines as it prints them with colors (the configs turn them off), a
# validation line and the lines around them
SAMPLE_LOG = """\
[rank0]:[titan] 2026-11-29 10:00:00,000 - root - INFO - Building qwen3 qwen3-30b-a3b-proxy
[rank0]:[titan] 2026-11-29 10:00:05,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.10513  \
\x1b[33mgrad_norm:  3.2101  \x1b[36mmemory: 80.12GiB(57.06%)  \x1b[34mtps: 1,234  \
\x1b[36mtflops: 31.09  \x1b[35mmfu: 3.14%\x1b[39m
[rank0]:[titan] 2026-11-29 10:00:05,300 - root - INFO - step:  2  loss: 12.00000  \
grad_norm:  2.0000  memory: 90.50GiB(64.45%)  tps: 40,960  tflops: 159.97  mfu: 16.17%
[rank0]:[titan] 2026-11-29 10:00:05,500 - root - INFO - validate step:  2  loss: 11.9000  \
memory: 90.50GiB(64.45%)  tps: 99,999
[rank0]:[titan] 2026-11-29 10:00:05,700 - root - INFO - step: 10  loss:     nan  \
grad_norm:     nan  memory: 91.00GiB(64.80%)  tps: 32,768  tflops: 1,279.20  mfu: N/A
[rank0]:[titan] 2026-11-29 10:00:06,000 - root - INFO - Training completed
"""


def test_the_parser_reads_every_training_step_line_and_no_other():
    samples = titan.parse_titan_log(SAMPLE_LOG)
    assert [s["step"] for s in samples] == [1, 2, 10]
    first, second, last = samples
    assert (first["loss"], first["grad_norm"], first["tokens_per_s"]) == (12.10513, 3.2101, 1234)
    assert (first["peak_reserved_gib"], first["peak_reserved_pct"]) == (80.12, 57.06)
    assert (first["titan_tflops"], first["titan_mfu_pct"]) == (31.09, 3.14)
    assert second["step_ms"] == pytest.approx(1e3 * 8192 / 40960)  # 200 ms
    assert math.isnan(last["loss"]) and last["titan_mfu_pct"] is None
    assert last["titan_tflops"] == 1279.2
    assert titan.parse_titan_log("no step here\nstep: x") == []


def test_torchtitans_command_is_its_run_train_sh_for_one_gpu():
    eager = titan.titan_command("dsv3", "eager", 30, "/tmp/dump")
    compiled = titan.titan_command("dsv3", "compiled", 30, "/tmp/dump", ["--x.y", "1"])
    assert eager[1:4] == ["-m", "torch.distributed.run", "--nproc_per_node=1"]
    entry = eager.index("torchtitan.train")
    assert eager[entry - 1] == "-m" and eager[entry + 1:entry + 5] == [
        "--module", "benchmarks.harness.titan_shapes", "--config", "dsv3_proxy"]
    assert eager[eager.index("--training.steps") + 1] == "30"
    assert "--debug.moe_force_load_balance" in eager and "--compile.enable" not in eager
    assert compiled[-3:] == ["--compile.enable", "--x.y", "1"]
    assert {shape.config for shape in titan.SHAPES.values()} == {
        "qwen3_proxy", "mixtral_proxy", "dsv3_proxy"}


def test_the_carry_goes_first_on_the_path_and_the_standin_raises(tmp_path):
    standin = titan.write_standin(tmp_path / "standin")
    env = titan.titan_env(standin, tmp_path / "carry", tmp_path / "site")
    path = env["PYTHONPATH"].split(os.pathsep)
    assert path[:4] == [str(tmp_path / "carry" / "src"), str(standin), str(tmp_path / "site"),
                        str(REPO)]
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    spec = importlib.util.spec_from_file_location("standin_datasets",
                                                  standin / "datasets" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(RuntimeError, match="random tokens"):
        module.load_dataset("c4")
    assert "no torchtitan source" in titan.carry_problem(tmp_path / "carry")


def _run(steps_tps: list, warmup_reserved: float = 100.0) -> dict:
    """A run's record of (step, tokens/s) pairs; step 1 reserves the most memory."""
    steps = [{"step": step, "tokens_per_s": tps, "step_ms": 8192e3 / tps,
              "peak_reserved_gib": warmup_reserved if step == 1 else 50.0}
             for step, tps in steps_tps]
    return {"rc": 0, "seconds": 1.0, "steps": steps}


def test_figures_leave_the_warmup_out_and_compare_with_torchtitans_best():
    runs = {"epoverlap": [_run([(1, 1.0), (2, 30.0), (3, 50.0)]), _run([(1, 1.0), (2, 40.0)])],
            "titan_eager": [_run([(1, 1.0), (2, 20.0), (3, 20.0)])],
            "titan_compiled": [_run([(1, 1.0), (2, 25.0)])]}
    flops = {"epoverlap": 2e12, "titan_eager": 1e12, "titan_compiled": 1e12}
    found = rounds.figures(runs, 1, flops)
    ours = found["sides"]["epoverlap"]
    assert (ours["tokens_per_s"], ours["steps_timed"]) == (40.0, 3)  # median of 30, 50, 40
    assert (ours["tokens_per_s_min"], ours["tokens_per_s_max"]) == (30.0, 50.0)
    assert ours["mfu"] == pytest.approx(2 * 40.0 / rounds.PEAK_TFLOPS)
    assert ours["peak_reserved_gib"] == 100.0  # the largest of every step, warmup included
    assert found["ratios"] == pytest.approx({"epoverlap_over_titan_eager": 2.0,
                                             "epoverlap_over_titan_compiled": 1.6,
                                             "epoverlap_over_titan_best": 1.6})
    failed = rounds.figures({**runs, "titan_compiled": [{"rc": 1, "steps": []}]}, 1, flops)
    assert failed["sides"]["titan_compiled"] == {"steps_timed": 0}
    assert failed["ratios"]["epoverlap_over_titan_best"] == 2.0
    report = {"shape": "qwen3", "preset": "p", "rounds": 1, "warmup": 1, "figures": failed}
    table = rounds.markdown(report)
    assert "| titan_compiled | - |" in table and "epoverlap_over_titan_best 2.00x" in table


def test_epoverlaps_run_keeps_every_step_of_its_log_json(tmp_path, monkeypatch):
    def fake_run(command, env, log, timeout_s):
        path = Path(command[command.index("--log-json") + 1])
        path.write_text("".join(json.dumps({"step": step, "loss": 5.0, "step_time_s": 0.25,
                                            "tokens_per_s": 32768.0, "peak_reserved_gib": 70.0,
                                            "peak_mem_gib": 60.0, "mfu": 0.13}) + "\n"
                                for step in (1, 2)))
        return 0

    monkeypatch.setattr(rounds, "run_logged", fake_run)
    run = rounds.run_epoverlap("mixtral", 2, tmp_path, "epoverlap_1", 60)
    assert run["rc"] == 0 and "--preset mixtral-1gpu-proxy" in run["command"]
    assert [(s["step"], s["step_ms"], s["peak_reserved_gib"]) for s in run["steps"]] == [
        (1, 250.0, 70.0), (2, 250.0, 70.0)]


def test_rounds_rotate_the_sides_and_report_after_every_run(tmp_path, monkeypatch):
    calls = []

    def fake_side(side, shape, steps, logs, round_index, timeout_s):
        calls.append((round_index, side))
        reported = json.loads((tmp_path / "peer_titan.json").read_text()) \
            if len(calls) > 1 else None
        if reported:  # the run before this one is in the report already
            assert sum(len(runs) for runs in reported["runs"].values()) == len(calls) - 1
        tps = {"epoverlap": 30.0, "titan_eager": 20.0, "titan_compiled": 25.0}[side]
        return {**_run([(1, 1.0), (2, tps), (3, tps)]), "round": round_index}

    monkeypatch.setattr(rounds, "run_side", fake_side)
    assert rounds.main(["--shape", "qwen3", "--rounds", "3", "--warmup", "1",
                        "--out", str(tmp_path)]) == 0
    assert [side for _, side in calls[:3]] == list(rounds.SIDES)
    assert [side for _, side in calls[3:6]] == list(rounds.SIDES[1:] + rounds.SIDES[:1])
    report = json.loads((tmp_path / "peer_titan.json").read_text())
    assert report["figures"]["ratios"]["epoverlap_over_titan_best"] == pytest.approx(1.2)
    assert report["megatron_flops_per_token"]["epoverlap"] > \
        report["megatron_flops_per_token"]["titan_eager"]  # NullTokenizer's row
    assert "| epoverlap | 30 |" in (tmp_path / "summary.md").read_text()
    calls.clear()
    assert rounds.main(["--shape", "qwen3", "--rounds", "3", "--warmup", "1", "--once",
                        "titan_eager", "--out", str(tmp_path)]) == 0
    assert [r for r, side in calls if side == "titan_eager"] == [1]  # the first round only
    assert len(calls) == 7
    with pytest.raises(SystemExit):
        rounds.main(["--shape", "qwen3", "--once", "titan", "--out", str(tmp_path)])
    monkeypatch.setattr(rounds, "run_side", lambda *args: {"rc": 1, "seconds": 1.0, "steps": [],
                                                            "round": 1})
    assert rounds.main(["--shape", "qwen3", "--rounds", "1", "--out", str(tmp_path)]) == 1


def test_each_shapes_epoverlap_command_validates_and_fits_one_h200(monkeypatch):
    """The epoverlap side's command (a typo would cost a device call) at one GPU, and its
    memory estimate under 100 GiB of the H200's 139."""
    from epoverlap.config import parse_config, resolve_config, validate, validate_config
    from epoverlap.training.setup.memory import GIB, GPU_RESERVE_BYTES, estimate_memory
    monkeypatch.setattr(validate, "nccl_config_unavailable", lambda: None)
    for shape in titan.SHAPES.values():
        argv = rounds.epoverlap_command(shape.preset, 30, Path("/tmp/x.jsonl"))
        cfg = parse_config(argv[argv.index("epoverlap.train") + 1:], printing=False)
        validate_config(cfg, world_size=1, cuda_available=True)
        t = cfg.train
        assert t.micro_batch_size * t.num_microbatches * cfg.model.seq_length == 8192
        assert cfg.moe.moe_router_force_load_balancing and cfg.data.mock_data
        resolved = resolve_config(cfg.with_vocab_size(cfg.data.vocab_size + 1), 1, True)
        estimate = estimate_memory(resolved, 1)
        total = estimate.states + estimate.activations + estimate.transient + GPU_RESERVE_BYTES
        assert total < 100 * GIB, (shape.preset, total / GIB)


# ------------------------------------------------------------------ with the carry
def _why_not_here():
    problem = titan.carry_problem()
    if problem:
        return f"{problem}; absent in CI"
    if importlib.util.find_spec("tokenizers") is None:
        return "torchtitan imports tokenizers, not installed here (the GPU image has it)"
    return None


WHY_NOT = _why_not_here()
needs_carry = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@pytest.fixture(scope="module")
def carry_env(tmp_path_factory) -> dict:
    """The environment of a process on the carry's path (the wheels in a folder of the test's)
    with tests/support beside it."""
    site = tmp_path_factory.mktemp("titan-site")
    titan.install_wheels(site=site)
    standin = titan.write_standin(tmp_path_factory.mktemp("standin"))
    env = titan.titan_env(standin, site=site)
    env["PYTHONPATH"] += os.pathsep + str(REPO / "tests" / "support")
    return {**os.environ, **env, "DUMP": str(tmp_path_factory.mktemp("dump"))}


def _titan_checks(env: dict, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tests/support/titan_checks.py"), *argv],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=900)


@pytest.fixture(scope="module")
def checks(carry_env):
    """tests/support/titan_checks.py's every check, in one process on the carry's path."""
    found = _titan_checks(carry_env, "every")
    assert found.returncode == 0, found.stderr[-3000:]
    return json.loads(found.stdout.strip().splitlines()[-1])


@needs_carry
def test_torchtitan_imports_from_the_carry(checks):
    assert checks["imports"]["file"].startswith(str(titan.CARRY / "src"))


@needs_carry
def test_its_config_manager_reads_each_shape_with_the_runners_flags(checks):
    for shape, found in checks["configs"].items():
        cfg = titan.epoverlap_config(titan.SHAPES[shape].preset)
        assert (found["steps"], found["compile"], found["ac"]) == (7, True, "none")
        assert found["balanced"] and found["router_balanced"]
        assert found["loader"] == "RandomTokens.Config"
        assert found["vocab"] == found["loader_vocab"] == cfg.data.vocab_size
        assert found["local_batch"] * found["seq"] == 8192
        assert Path(found["tokenizer"], "tokenizer.json").is_file()
    assert checks["configs"]["dsv3"]["dense_layers"] == 1


@needs_carry
def test_its_model_has_epoverlaps_parameters_but_nulltokenizers_row(checks):
    """The same elements in all but one vocabulary row in the embedding and the output
    (epoverlap's NullTokenizer end-of-document id), and the same in routed and shared experts
    and in which layers are MoE."""
    for shape, found in checks["counts"].items():
        assert found["titan"] == found["ours"] - 2 * found["hidden"], shape
        assert found["titan_routed"] == found["ours_routed"] > 0, shape
        assert found["titan_shared"] == found["ours_shared"], shape
        assert found["titan_moe_layers"] == found["ours_moe_layers"], shape
    assert checks["counts"]["dsv3"]["titan_shared"] > 0
    assert checks["counts"]["dsv3"]["titan_moe_layers"][:2] == [False, True]


@needs_carry
def test_one_forward_and_backward_of_each_shape(checks):
    for shape, found in checks["forward"].items():
        assert found["logits"] == [2, 32, 300], shape
        assert abs(found["loss"] - found["ln_vocab"]) < 1.5 and found["all_grads"], shape


@needs_carry
def test_the_random_tokens(checks):
    found = checks["loader"]
    assert found["input"] == found["labels"] == [2, 16] and found["shifted"]
    assert 0 <= found["low"] and found["high"] < 300
    assert found["seeded"] and found["fresh"] and found["state"] == {"batches": 2}


@needs_carry
def test_its_trainer_trains_the_shared_expert_shape_from_the_runners_command(carry_env):
    """torchtitan's own Trainer built from the runner's command line (dsv3: a dense first
    layer, shared experts) at small sizes on one CPU process: 3 step lines, as the parser reads
    them (titan_checks.trainer names the CPU's stand-ins for the GPU)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    found = _titan_checks({**carry_env, "PORT": port}, "trainer", "dsv3")
    log = found.stdout + found.stderr
    assert found.returncode == 0 and "Training completed" in log, log[-3000:]
    steps = titan.parse_titan_log(log, tokens_per_step=2 * 32)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(math.isfinite(s["loss"]) and s["tokens_per_s"] > 0 for s in steps)
