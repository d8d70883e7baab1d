"""Context parallelism's GPU recipes (benchmarks/gpu/recipes_context.py) and the loss-gap tool
they read the losses with (benchmarks/harness/loss_gap.py), on CPU: CP 2 and 4, over NVLink
and with NCCL_P2P_DISABLE=1 on every step; each training command (the one-GPU CP 1 run
included) passes the config's rules at its world, the CP N and CP 1 loss runs read the same
sequences and every timed side the same global batch; the simulate step's flags build a
scenario; the recipes dry-run; the loss gaps worked out by hand."""

from __future__ import annotations

import json
import shlex

import pytest

from benchmarks.gpu import recipes, run
from benchmarks.gpu.recipes_context import CONTEXT_RECIPES
from benchmarks.harness import loss_gap
from epoverlap.config import validate
from epoverlap.config.parse import parse_config
from epoverlap.config.resolve import resolve_config, validate_config

NAMES = {"python": "PY", "torchrun": "TR", "gpus": 0, "out": "/o"}


def _train_argv(command: str) -> tuple[int, list]:
    """(world, training flags) of a step that runs `-m epoverlap.train` under torchrun: the
    recipe's (TR) or one GPU's."""
    words = shlex.split(command)
    at = next(i for i in range(len(words) - 1) if words[i:i + 2] == ["-m", "epoverlap.train"])
    world = 1 if "--nproc-per-node=1" in words[:at] else None
    return world, words[at + 2:]


def _sides(command: str) -> list:
    """A bench_train_rounds step's training flags, one list per side."""
    words = shlex.split(command)
    base = words[words.index("--") + 1:]
    at = base.index("epoverlap.train")
    return [base[at + 1:] + shlex.split(words[j + 1].partition("=")[2])
            for j, word in enumerate(words) if word == "--side"]


def _config(argv: list, world: int):
    """The run's config as a GPU machine resolves it (bf16 on by default there)."""
    cfg = parse_config(argv, printing=False)
    validate_config(cfg, world_size=world, cuda_available=True)
    return resolve_config(cfg, world, cuda_available=True)


def _sequences_per_step(cfg, world: int) -> int:
    return cfg.train.micro_batch_size * cfg.train.num_microbatches * \
        cfg.data_parallel_size(world)


def test_cp2_and_cp4_over_nvlink_and_with_p2p_off():
    table = {recipe.name: recipe for recipe in recipes.RECIPES}
    for cp in (2, 4):
        for over, p2p in (("nvlink", None), ("nop2p", "1")):
            recipe = table[f"context_parallel_cp{cp}_{over}"]
            assert recipe.gpus == cp
            assert all(step.env.get("NCCL_P2P_DISABLE") == p2p for step in recipe.steps)
    assert len(CONTEXT_RECIPES) == 4


@pytest.mark.parametrize("recipe", CONTEXT_RECIPES, ids=lambda r: r.name)
def test_every_run_validates_and_compares_like_with_like(recipe, monkeypatch):
    monkeypatch.setattr(validate, "nccl_config_unavailable", lambda: None)
    cp = recipe.gpus
    steps = {step.name: step.command.format(**NAMES) for step in recipe.steps}
    losses = {}
    for name in ("loss_cp1", f"loss_cp{cp}_p2p", f"loss_cp{cp}_allgather"):
        world, argv = _train_argv(steps[name])
        world = world or cp
        cfg = _config(argv, world)
        assert cfg.parallel.context_parallel_size == (1 if name == "loss_cp1" else cp)
        assert cfg.data_parallel_size(world) == 1 and cfg.train.bf16 is False  # fp32, same data
        losses[name] = cfg, world
    assert {cfg.model for cfg, _ in losses.values()} == {losses["loss_cp1"][0].model}
    assert len({_sequences_per_step(cfg, world) for cfg, world in losses.values()}) == 1
    assert f"loss_cp1.jsonl /o/loss_cp{cp}_p2p.jsonl" in steps["loss_gap"]
    sides = _sides(steps["rounds_rounds"])
    assert len(sides) == 4
    timed = [_config(argv, cp) for argv in sides]
    assert [c.parallel.context_parallel_size for c in timed] == [cp, cp, cp, 1]
    assert [tuple(c.parallel.cp_comm_type) for c in timed[:3]] == [("p2p",), ("allgather",),
                                                                   ("allgather",)]
    assert len({_sequences_per_step(c, cp) for c in timed}) == 1 and timed[0].train.bf16
    world, argv = _train_argv(steps["spans"])
    assert _config(argv, cp).log.profile_steps


@pytest.mark.parametrize("recipe", CONTEXT_RECIPES[::2], ids=lambda r: r.name)
def test_the_simulate_steps_flags_build_a_scenario(recipe):
    """The replay step's training flags (after `--`), on FLOP counts here: the layout has the
    gathers, the EP group is the recipe's GPUs."""
    from epoverlap.cli import simulate as sim
    [command] = [s.command for s in recipe.steps if s.name == "simulate"]
    flags = shlex.split(command.format(**NAMES))
    train = flags[flags.index("--") + 1:]
    scenario = sim.build_scenario(sim.parse_args(["--flops", "--", *train]))
    assert scenario.ep == recipe.gpus
    assert [kind.name for kind in scenario.layout[0]][:3] == ["qkv", "kv_gather", "attn"]


def test_the_recipes_dry_run(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "machine", lambda env: {"gpus": 0, "nvidia_smi": [], "date": "d"})
    names = [recipe.name for recipe in CONTEXT_RECIPES]
    out = tmp_path / "out"
    assert run.main([*names, "--dry-run", "--out", str(out), "--work", str(tmp_path / "w")]) == 0
    summary = (out / "summary.md").read_text()
    for name in names:
        assert f"| {name} | dry run (here it would be skipped: needs" in summary
        assert (out / f"{name}.tgz").is_file()


def _log(path, losses: dict) -> str:
    path.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items()))
    return str(path)


def test_loss_gaps_by_hand(tmp_path, capsys):
    ref = _log(tmp_path / "ref.jsonl", {1: 10.0, 2: 8.0, 3: 4.0})
    near = _log(tmp_path / "near.jsonl", {1: 10.0, 2: 8.004, 3: 4.004})  # gaps 0, 5e-4, 1e-3
    far = _log(tmp_path / "far.jsonl", {2: 8.08, 4: 1.0})  # 1e-2 at step 2; step 4 not in ref
    out = tmp_path / "gaps.json"
    assert loss_gap.main([ref, near, "--rtol", "1e-3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["runs"]
    assert rows[0]["steps"] == 3 and rows[0]["max_gap_step"] == 3
    assert rows[0]["max_gap"] == pytest.approx(1e-3) and rows[0]["first_step_gap"] == 0.0
    assert loss_gap.main([ref, near, far, "--rtol", "1e-3"]) == 1
    printed = capsys.readouterr().out
    assert "far.jsonl: 1 steps, largest gap 1.00e-02 at step 2" in printed
    assert "PAST --rtol" in printed
    none = _log(tmp_path / "none.jsonl", {9: 1.0})
    assert loss_gap.main([ref, none]) == 1
    assert loss_gap.main([ref, str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("loss_gap: error: ")
