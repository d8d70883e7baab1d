"""The training command: parse and validate flags before any process-group work, set up the
process environment, build the groups, train, and tear down on every exit path.

`epoverlap-train` and `python -m epoverlap.train` both end here (`main`). Exit status:
  0    done;
  2    bad input: one line naming the flag, before any process group exists, printed by the
       first rank of each node; the others exit quietly with the same status a few seconds
       later, so that torchrun, which stops the job once a rank exits, does not stop the one
       that prints;
  3    a peer rank died or stalled: one line naming the step, the process group and the
       silent rank(s), no traceback;
  143  stopped by SIGTERM with no silent peer;
  1    anything else (with its traceback).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Optional

import torch

from epoverlap.config import RunConfig, parse_config, validate_config, world_size_from_env
from epoverlap.errors import ConfigError
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.parallel.watch import PeerFailure, route_sigterm
from epoverlap.training.memory import check_memory
from epoverlap.training.trainer import Trainer


def setup_environment(cfg: RunConfig, warn: Callable[[str], None]) -> None:
    """Process-wide settings that must precede CUDA init: stream connections, determinism,
    NCCL's error handling (its watchdog tears a rank down when a collective exceeds the
    timeout; the liveness monitor of parallel/watch.py names the silent peer just before)."""
    on_gpu = cfg.resolved_device(torch.cuda.is_available()) == "cuda"
    if on_gpu:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    if on_gpu and cfg.overlap.overlap_moe_expert_parallel_comm:
        connections = os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8")
        if connections == "1":
            warn("CUDA_DEVICE_MAX_CONNECTIONS=1 puts both streams on one hardware queue: "
                 "the EP overlap gain roughly halves; unset it or set it > 1")
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        if on_gpu:
            torch.backends.cudnn.benchmark = False
    torch.manual_seed(cfg.train.seed)


def _printer(enabled: bool, stream=sys.stdout) -> Callable[[str], None]:
    def emit(message: str) -> None:
        if enabled:
            print(message, file=stream, flush=True)
    return emit


def _bad_input(printing: bool) -> int:
    """Status 2; a quiet rank first gives the printing one time to print (torchrun's SIGTERM,
    once that one has exited, ends the wait with the same status)."""
    if not printing and QUIET_RANK_PAUSE_S > 0:
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(2))
        time.sleep(QUIET_RANK_PAUSE_S)
    return 2


def checked_config(argv: Optional[list[str]], world_size: int, cuda_available: bool,
                   local_ranks: int, printing: bool, prog: str = "epoverlap-train",
                   before_cuda: Callable[[RunConfig], None] = lambda cfg: None
                   ) -> tuple[RunConfig, list[str]]:
    """Parse and check everything that can be checked before the first collective (flags,
    paths, the memory estimate). Raises ConfigError; argparse errors exit with status 2.
    `before_cuda` runs between the checks that touch no CUDA and the memory check, which
    reads the GPU's size (process settings such as CUDA_DEVICE_MAX_CONNECTIONS go first).
    Returns the config and its deprecation warnings (to print once it is accepted)."""
    notes: list[str] = []
    cfg = parse_config(argv, warn=notes.append, printing=printing)
    validate_config(cfg, world_size, cuda_available)
    before_cuda(cfg)
    check_memory(cfg, world_size, cfg.resolved_device(cuda_available), local_ranks)
    return cfg, [f"{prog}: warning: {note}" for note in notes]


QUIET_RANK_PAUSE_S = 5.0  # how long a rank that does not print waits before exiting 2


def main(argv: Optional[list[str]] = None) -> int:
    printing = os.environ.get("LOCAL_RANK", "0") == "0"  # one voice per node for bad input
    warn = _printer(printing, sys.stderr)
    cuda = torch.cuda.is_available()

    def environment(cfg: RunConfig) -> None:
        setup_environment(cfg, lambda msg: warn(f"epoverlap-train: warning: {msg}"))
    try:
        cfg, warnings = checked_config(argv, world_size_from_env(), cuda,
                                       int(os.environ.get("LOCAL_WORLD_SIZE", "1")), printing,
                                       before_cuda=environment)
    except ConfigError as error:
        warn(f"epoverlap-train: error: {error}")
        return _bad_input(printing)
    except SystemExit as stop:  # argparse: usage and error printed (or --help)
        if stop.code:
            _bad_input(printing)
        raise
    for line in warnings:
        warn(line)
    groups = init_distributed(cfg.parallel.expert_model_parallel_size, cfg.resolved_device(cuda),
                              cfg.parallel.distributed_timeout_minutes)
    if groups.world_size > 1:
        route_sigterm(groups.watch)
    trainer = None
    try:
        trainer = Trainer(cfg, groups, log=_printer(groups.is_first()))
        trainer.log(trainer.describe())
        trainer.train()
    except PeerFailure as failure:
        groups.watch.report(failure)  # one line, then the process exits (status 3)
    finally:
        if trainer is not None:
            trainer.close()
        destroy_distributed(groups)
    return 0
