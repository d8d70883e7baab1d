"""The training command: parse and validate flags and find what --load resumes from before
any process-group work, set up the process environment, build the groups, train, and tear down
on every exit path.

Exit status: 0 done; 2 a bad flag or an unusable checkpoint (one line naming the flag or file,
from rank 0); 1 a NaN/Inf loss or gradient (one line naming the step, rank and parameter).

`epoverlap-train` and `python -m epoverlap.train` both end here (`main`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional

import torch

from epoverlap.config import RunConfig, parse_config, validate_config, world_size_from_env
from epoverlap.errors import ConfigError
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.data import open_data_source
from epoverlap.training.checkpoint_files import CheckpointRef, find_resume_checkpoint
from epoverlap.training.trainer import Trainer


def setup_environment(cfg: RunConfig, warn: Callable[[str], None]) -> None:
    """Process-wide settings that must precede CUDA init: stream connections, determinism."""
    on_gpu = cfg.resolved_device(torch.cuda.is_available()) == "cuda"
    if on_gpu and cfg.overlap.overlap_moe_expert_parallel_comm:
        connections = os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8")
        if connections == "1":
            warn("CUDA_DEVICE_MAX_CONNECTIONS=1 puts both streams on one hardware queue: "
                 "the EP overlap gain roughly halves; unset it or set it > 1")
    if cfg.train.deterministic_mode:
        make_deterministic(on_gpu)
    torch.manual_seed(cfg.train.seed)


def make_deterministic(on_gpu: bool) -> None:
    """--deterministic: every op of the training path deterministic, or the run fails loudly.

    `use_deterministic_algorithms(True)` without warn_only: an op with no deterministic
    implementation raises instead of warning, and scaled-dot-product attention leaves cuDNN
    attention out of its choice (nondeterministic backward) and runs flash attention's
    deterministic backward. cuBLAS gets a fixed workspace; NCCL's all-reduce a fixed algorithm
    (ring: each element reduced in ring order, the same in every run). The Triton kernels and
    the all-to-alls are deterministic by construction (no float atomics, copies only).
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if on_gpu:
        os.environ.setdefault("NCCL_ALGO", "Ring")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


def _printer(rank_zero: bool, stream=sys.stdout) -> Callable[[str], None]:
    def emit(message: str) -> None:
        if rank_zero:
            print(message, file=stream, flush=True)
    return emit


# Under torchrun the agent stops every worker as soon as one exits non-zero. Every rank fails
# alike and only rank 0 prints the line, so the other ranks wait this long first: the line is
# out before they exit (rank 0 exits first and the agent stops them at once).
LINE_GRACE_S = 5.0


def _fail(error: Exception, status: int, rank_zero: bool, warn: Callable[[str], None]) -> int:
    warn(f"epoverlap-train: error: {error}")
    if not rank_zero and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(LINE_GRACE_S)
    return status


def checked_config(argv: Optional[list[str]], world_size: int, cuda_available: bool,
                   warn: Callable[[str], None] = lambda msg: None):
    """Everything decided before any process group: flags, their rules, the data files, what
    --load resumes from. -> (config for this world, checkpoint to resume or None, data source).
    Raises ConfigError (one line naming a flag, a data file or a checkpoint file)."""
    cfg = parse_config(argv, warn=warn)
    validate_config(cfg, world_size, cuda_available)
    cfg = cfg.for_world(world_size)
    data = open_data_source(cfg, world_size)
    return cfg, find_resume_checkpoint(cfg.checkpoint.load, cfg.checkpoint.save), data


def main(argv: Optional[list[str]] = None) -> int:
    rank_zero = os.environ.get("RANK", "0") == "0"
    warn = _printer(rank_zero, sys.stderr)
    try:
        cfg, resume, data = checked_config(argv, world_size_from_env(), torch.cuda.is_available(),
                                           lambda msg: warn(f"epoverlap-train: warning: {msg}"))
    except ConfigError as error:
        return _fail(error, 2, rank_zero, warn)
    if cfg.checkpoint.load is not None and resume is None:
        _printer(rank_zero)(f"checkpoint: none in {cfg.checkpoint.load} yet; starting at step 1")
    setup_environment(cfg, lambda msg: warn(f"epoverlap-train: warning: {msg}"))
    device_kind = cfg.resolved_device(torch.cuda.is_available())
    groups = init_distributed(cfg.parallel.expert_model_parallel_size, device_kind,
                              cfg.parallel.dist_timeout_minutes)
    trainer = None
    try:
        trainer = Trainer(cfg, groups, log=_printer(groups.is_first()), data=data,
                          resume=resume)
        trainer.log(trainer.describe())
        trainer.train()
    except ConfigError as error:  # a checkpoint that cannot be loaded: every rank alike
        return _fail(error, 2, rank_zero, warn)
    except FloatingPointError as error:  # NaN/Inf: every rank raises the same message
        return _fail(error, 1, rank_zero, warn)
    finally:
        if trainer is not None:
            trainer.close()
        destroy_distributed()
    return 0

