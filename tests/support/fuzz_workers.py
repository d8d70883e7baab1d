"""The fuzzers' case generators and per-rank bodies (importable, so spawn can pickle them).

Config fuzz: random flag combinations drawn from the CLI itself (the parser's flags and their
kinds, `config.CHOICES` for names, `PRESETS`) and edge values (0, -1, 2**63, nan, inf, empty,
wrong type, paths that are files, folders or missing). Each combination goes through
`checked_config`, what the training command does before any process group; a sample of the
accepted ones then runs one step (and saves, when asked) in one process or on 2 gloo ranks.

Routing fuzz: forced adversarial routings (through the router's `logit_bias` test seam) run
under every overlap mode and must equal the sequential reference bit for bit.
"""

from __future__ import annotations

import contextlib
import io

import random
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

from epoverlap.config import CHOICES, RunConfig, build_parser, parse_config
from epoverlap.errors import ConfigError
from epoverlap.parallel.groups import destroy_distributed, expert_parallel_groups, init_distributed
from epoverlap.cli.train import checked_config
from epoverlap.training.loop.trainer import Trainer
from gloo_workers import MODES, TINY

INTS = ["-1", "0", "1", "2", "3", "4", "8", "16", str(2**63)]
FLOATS = ["-1", "0", "1e-8", "0.5", "1", "2.5", "nan", "inf", "-inf"]
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--ffn-hidden-size", "64", "--seq-length", "16", "--num-experts", "4",
        "--moe-ffn-hidden-size", "32", "--micro-batch-size", "2", "--num-microbatches", "2",
        "--mock-data", "--log-interval", "1000"]
EP2_OVERLAP = ["--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"]
# Flags whose values are not numbers or names: paths, step ranges, layer lists.
_FREE_FORM = {
    "--data": lambda p: ["stdlib", str(p / "small.txt"), str(p / "text.txt"),
                         str(p), str(p / "empty"), str(p / "missing")],
    "--log-json": lambda p: [str(p / "log.jsonl"), str(p)],
    "--profile-steps": lambda p: ["1:1", "1:3", "2:1", "0:1", "x", ""],
    "--profile-dir": lambda p: [str(p / "spans"), str(p / "small.txt")],
    "--moe-layer-freq": lambda p: ["1", "2", "0", "1,0", "0,1", "1,1,1", "[1,1]", "x"],
    "--save": lambda p: [str(p / "ckpt"), str(p / "small.txt"), ""],
    "--load": lambda p: [str(p / "ckpt"), str(p / "empty"), str(p / "small.txt")],
}


def prepare_paths(folder: Path) -> None:
    (folder / "small.txt").write_text("tiny")
    (folder / "text.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    (folder / "empty").mkdir(exist_ok=True)


def flag_values(folder: Path) -> dict[str, list[Optional[list[str]]]]:
    """Every flag of the parser -> the argv pieces to draw from (None: leave the flag out)."""
    values: dict[str, list] = {}
    for action in build_parser()._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or flag == "--help":
            continue
        if action.nargs == 0:  # store_true
            values[flag] = [[flag]]
            continue
        type_name = getattr(action.type, "__name__", "str")
        if action.choices:
            choices = list(action.choices) + ["bogus"]
        elif flag in CHOICES:
            choices = list(CHOICES[flag]) + ["bogus", ""]
        elif flag in _FREE_FORM:
            choices = _FREE_FORM[flag](folder)
        elif "int" in type_name:
            choices = INTS + (["none"] if type_name.startswith("_opt") else []) + ["x"]
        elif "float" in type_name:
            choices = FLOATS + (["none"] if type_name.startswith("_opt") else []) + ["x"]
        else:  # free text: a path, if anything, inside the test's folder (never the cwd)
            choices = [str(folder / "x"), ""]
        if action.nargs in ("*", "+"):
            values[flag] = [[flag, *random.Random(i).sample(choices, k)]
                            for i, k in enumerate([0, 1, 2, 1, 2])]
        else:
            values[flag] = [[flag, c] for c in choices]
    return values


def config_cases(seed: int, count: int, folder: Path) -> list[tuple[list[str], int]]:
    """`count` (argv, world size) pairs: 60% start from a tiny valid base (half of them with EP 2
    and the overlap) and add 1-4 random flags with random values, the rest are 1-8 random flags
    alone."""
    rng, table = random.Random(seed), flag_values(folder)
    flags, cases = sorted(table), []
    for _ in range(count):
        on_base = rng.random() < 0.6
        argv = list(rng.choice([BASE, BASE + EP2_OVERLAP])) if on_base else []
        for flag in rng.sample(flags, rng.randint(1, 4 if on_base else 8)):
            argv += rng.choice(table[flag])
        cases.append((argv, rng.choice([1, 1, 2, 2, 4, 8])))
    return cases


def outcome(argv: list[str], world: int) -> tuple[str, str]:
    """("ok", "") or ("refused", the one-line message); anything else raises."""
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            checked_config(argv, world, cuda_available=False)
    except ConfigError as error:
        return "refused", str(error)
    except SystemExit as stop:  # argparse's complaint: a usage line, then one error line
        if stop.code != 2:
            raise
        return "refused", usage.getvalue().splitlines()[-1].split(": error: ", 1)[1]
    return "ok", ""


def small_enough_to_run(cfg: RunConfig) -> bool:
    m, moe, t = cfg.model, cfg.moe, cfg.train
    widths = [m.hidden_size, m.ffn_hidden_size, moe.moe_ffn_hidden_size or 0,
              moe.moe_shared_expert_intermediate_size or 0]
    return (max(widths) <= 256 and m.num_layers <= 4 and m.seq_length <= 64
            and (moe.num_experts or 0) <= 16 and t.micro_batch_size * t.num_microbatches <= 16
            and cfg.data.data != "stdlib" and cfg.log.profile_steps is None)


def run_one_step(argv: list[str], world_size: int, groups_of: Callable[[int], object]) -> str:
    """Run `argv` for one step (it was accepted); "ok", or a refusal's one line, or the
    traceback of anything else (a failure). `groups_of(ep)`: the groups of that EP size."""
    try:
        cfg, resume, _ = checked_config(argv + ["--train-iters", "1"], world_size,
                                        cuda_available=False)
        trainer = Trainer(cfg, groups_of(cfg.parallel.expert_model_parallel_size),
                          log=lambda msg: None, resume=resume)
        try:
            trainer.train()
        finally:
            trainer.close()
        return "ok"
    except ConfigError as error:
        return f"refused: {error}"
    except Exception:
        return "error: " + traceback.format_exc()


# ----------------------------------------------------------------------------- routing fuzz
E, BIG = 4, 100.0  # TINY has 4 experts: 0, 1 on EP rank 0; 2, 3 on EP rank 1


def _bias(logits_TE: torch.Tensor, experts: list[int], rows=None) -> torch.Tensor:
    bias_TE = torch.zeros_like(logits_TE)
    for rank_order, expert in enumerate(experts):
        bias_TE[rows if rows is not None else slice(None), expert] = BIG - rank_order
    return bias_TE


def _skewed(logits_TE, rank, microbatch):
    gen = torch.Generator().manual_seed(1000 * rank + microbatch)
    bias_TE = torch.randn(logits_TE.shape, generator=gen) * 5
    bias_TE[torch.rand(logits_TE.shape[0], generator=gen) < 0.9, 3] += BIG
    return bias_TE


def _one_token_elsewhere(logits_TE, rank, microbatch):
    bias_TE = _bias(logits_TE, [0])
    bias_TE[microbatch % logits_TE.shape[0]] = 0
    bias_TE[microbatch % logits_TE.shape[0], 3] = BIG
    return bias_TE


# name -> (top-k, bias of (logits, rank, microbatch))
ROUTINGS = {
    "all_tokens_to_expert_0": (1, lambda lg, r, mb: _bias(lg, [0])),
    "ep_rank_1_receives_everything": (2, lambda lg, r, mb: _bias(lg, [2, 3])),
    "each_rank_sends_only_to_the_other": (2, lambda lg, r, mb: _bias(lg, [2, 3] if r == 0
                                                                      else [0, 1])),
    "no_cross_traffic": (2, lambda lg, r, mb: _bias(lg, [0, 1] if r == 0 else [2, 3])),
    "one_expert_per_microbatch": (1, lambda lg, r, mb: _bias(lg, [mb % E])),
    "one_token_elsewhere": (1, _one_token_elsewhere),
    "skewed_random": (2, _skewed),
}


def force_routing(trainer: Trainer, rank: int, bias_of) -> None:
    """Install a forced routing on every router; microbatch = call index modulo microbatches."""
    microbatches = trainer.cfg.train.num_microbatches
    for router in trainer.model.routers():
        calls = [0]

        def bias(logits_TE, calls=calls):
            microbatch = calls[0] % microbatches
            calls[0] += 1
            return bias_of(logits_TE, rank, microbatch).to(logits_TE.dtype)
        router.logit_bias = bias


def routed_grads(groups, name: str, mode: str) -> tuple:
    """One step of `mode` under routing `name`: raw bits of losses and reduced grads, and the
    expert token counts (so the test can check the routing was really forced)."""
    topk, bias_of = ROUTINGS[name]
    argv = TINY + ["--expert-model-parallel-size", "2", "--moe-router-topk", str(topk)]
    trainer = Trainer(parse_config(argv + MODES[mode]), groups, log=lambda msg: None)
    try:
        force_routing(trainer, groups.rank, bias_of)
        losses = trainer.run_microbatches(step=1)
        counts = [r.step_counts.tolist() for r in trainer.model.routers()]
        trainer.grads.reduce()
        return (torch.stack(losses).view(torch.int32), trainer.grads.dense_flat.view(torch.int32),
                trainer.grads.expert_flat.view(torch.int32), counts)
    finally:
        trainer.close()


def fuzz_on_two_ranks(rank, world_size, config_argvs: list[list[str]]):
    """Routing fuzz (every routing x mode), then the sampled config cases, one step each."""
    ep2 = init_distributed(2, "cpu", timeout_minutes=2)
    try:
        routing = {(name, mode): routed_grads(ep2, name, mode)
                   for name in ROUTINGS for mode in MODES}
        layouts = {1: expert_parallel_groups(1, ep2.device, watch=ep2.watch), 2: ep2}
        configs = [run_one_step(argv, world_size, layouts.__getitem__) for argv in config_argvs]
        return routing, configs
    finally:
        destroy_distributed()
