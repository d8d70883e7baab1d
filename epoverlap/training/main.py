"""The training command: parse and validate flags before any process-group work, set up the
process environment, build the groups, train, and tear down on every exit path.

`epoverlap-train` and `python -m epoverlap.train` both end here (`main`).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import torch

from epoverlap.config import RunConfig, parse_config, validate_config, world_size_from_env
from epoverlap.errors import ConfigError
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.data import open_data_source
from epoverlap.training.stage_memory import check_stages_fit, memory_per_rank
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


def main(argv: Optional[list[str]] = None) -> int:
    rank_zero = os.environ.get("RANK", "0") == "0"
    warn = _printer(rank_zero, sys.stderr)
    try:
        cfg = parse_config(argv, warn=lambda msg: warn(f"epoverlap-train: warning: {msg}"))
        world = world_size_from_env()
        validate_config(cfg, world, torch.cuda.is_available())
        cfg = cfg.for_world(world)
        data = open_data_source(cfg, cfg.data_parallel_size(world))  # checked before any group
        setup_environment(cfg, lambda msg: warn(f"epoverlap-train: warning: {msg}"))
        # after the environment: reading the GPU's memory size initializes CUDA
        check_stages_fit(cfg.with_vocab_size(data.vocab_size), memory_per_rank(cfg))
    except ConfigError as error:
        warn(f"epoverlap-train: error: {error}")  # every rank fails alike; rank 0 says it
        return 2
    device_kind = cfg.resolved_device(torch.cuda.is_available())
    groups = init_distributed(cfg.parallel.expert_model_parallel_size, device_kind,
                              cfg.parallel.dist_timeout_minutes,
                              pp_size=cfg.parallel.pipeline_model_parallel_size)
    trainer = None
    try:
        trainer = Trainer(cfg, groups, log=_printer(groups.is_first()), data=data)
        trainer.log(trainer.describe())
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        destroy_distributed()
    return 0

