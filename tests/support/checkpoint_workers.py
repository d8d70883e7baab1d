"""Per-rank bodies of the checkpoint and NaN-check gloo tests (importable, so spawn can pickle
them), and helpers shared with the in-process tests."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from epoverlap.config import parse_config
from epoverlap.errors import NonFiniteError
from epoverlap.parallel.groups import destroy_distributed, expert_parallel_groups, init_distributed
from epoverlap.training.checkpoints.checkpoint_files import iter_name, read_checkpoint
from epoverlap.training.loop.faults import ENV
from epoverlap.training.loop.trainer import Trainer
from gloo_workers import TINY

# Expert bias and the router's balancing generator are on, so their restore is tested too.
FLAGS = TINY + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-force-load-balancing", "--train-iters", "4"]
OVERLAP = ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]


def run(groups, argv: list[str], resume_from: Optional[Path] = None,
        save_at_start: bool = False) -> list[float]:
    """Train (resuming from a checkpoint folder if given); the mean loss of each step."""
    ref = read_checkpoint(resume_from, str(resume_from)) if resume_from else None
    trainer = Trainer(parse_config(argv), groups, log=lambda msg: None, resume=ref)
    try:
        if save_at_start:  # the state just loaded, written back (at another EP size)
            trainer.parts.checkpointer.save(trainer.start_step)
        return [r.loss for r in trainer.train()]
    finally:
        trainer.close()


def checkpoint_tensors(path: Path, prefixes=("model/", "optim/", "buffer/")) -> dict:
    """Every tensor of a checkpoint folder under `prefixes`, read in this process."""
    index = FileSystemReader(str(path)).read_metadata()
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in index.state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata) and key.startswith(prefixes)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        dcp.load(tensors, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return tensors


def two_rank_suite(rank, world_size, out_dir, faults):
    """Every 2-rank scenario of test_checkpoint in one process group (a spawn costs ~10 s on
    the loaded CI machines): resume at every layout, then the NaN faults."""
    ep2 = init_distributed(2, "cpu", timeout_minutes=3)
    try:
        return {"losses": resume_at_every_layout(ep2, Path(out_dir)),
                "nan": nan_is_caught_before_the_optimizer(ep2, faults)}
    finally:
        destroy_distributed()


def resume_at_every_layout(ep2, out: Path) -> dict:
    """A: EP 2, overlap + delayed wgrad, 4 steps, checkpoint at 2. R: resume A@2 the same way.
    B: resume A@2 at EP 1 and save at once. D: resume B@2 (EP 1) at EP 2 and save at once."""
    ep1 = expert_parallel_groups(1, ep2.device, watch=ep2.watch)
    a2 = out / "A" / iter_name(2)
    losses = {"A": run(ep2, FLAGS + OVERLAP + ["--save", str(out / "A"), "--save-interval",
                                               "2", "--log-json", str(out / "A.jsonl")])}
    if ep2.rank == 0:  # the resumed run must keep steps 1-2 of this log and append 3-4
        shutil.copy(out / "A.jsonl", out / "R.jsonl")
    torch.distributed.barrier()
    losses["R"] = run(ep2, FLAGS + OVERLAP + ["--log-json", str(out / "R.jsonl"),
                                              "--save", str(out / "R")], a2)
    losses["B"] = run(ep1, FLAGS + ["--save", str(out / "B")], a2, save_at_start=True)
    losses["D"] = run(ep2, FLAGS + OVERLAP + ["--save", str(out / "D")],
                      out / "B" / iter_name(2), save_at_start=True)
    return losses


def _adam_state(trainer: Trainer) -> list[torch.Tensor]:
    state = [m.detach().clone() for m in trainer.parts.optimizer.masters]
    for master in trainer.parts.optimizer.masters:
        state += [v.clone() for v in trainer.parts.optimizer.state_of(master).values()]
    return state + [r.expert_bias.clone() for r in trainer.model.routers()]


def nan_is_caught_before_the_optimizer(groups, faults: list[str]) -> list:
    """For each fault (at step 3): two clean steps, then the faulty one. Every rank must raise
    the same NonFiniteError, and the optimizer state and expert biases must be those after
    step 2. Returns (message, state unchanged) per fault."""
    results = []
    for fault in faults:
        os.environ[ENV] = fault
        trainer = Trainer(parse_config(FLAGS + OVERLAP + ["--check-for-nan-in-loss-and-grad"]),
                          groups, log=lambda msg: None)
        try:
            results.append(_step_with_fault(trainer))
        finally:
            trainer.close()
            del os.environ[ENV]
    return results


def _step_with_fault(trainer: Trainer) -> tuple[Optional[str], bool]:
    for step in (1, 2):
        trainer.step(step)
    before = _adam_state(trainer)
    message = None
    try:
        trainer.step(3)
    except NonFiniteError as error:
        message = str(error)
    after = _adam_state(trainer)
    return message, all(torch.equal(a, b) for a, b in zip(before, after))
