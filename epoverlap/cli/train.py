"""The training command: parse and validate flags and find what --load resumes from before
any process-group work, set up the process environment, build the groups, train, and tear down
on every exit path.

`epoverlap-train` and `python -m epoverlap.train` both end here (`main`). Exit status:
  0    done;
  2    bad input: one line naming the flag (or the data or checkpoint file), before any
       process group exists, printed by the first rank of each node; the others exit quietly
       with the same status a few seconds later, so that torchrun, which stops the job once a
       rank exits, does not stop the one that prints (a checkpoint found unusable while loading:
       the same, from rank 0);
  1    a NaN/Inf loss or gradient under --check-for-nan-in-loss-and-grad (one line naming the
       step, rank and parameter), or anything else (with its traceback);
  3    a peer rank died or stalled: one line naming the step, the process group and the
       silent rank(s), no traceback;
  130, 143  stopped by SIGINT or SIGTERM with every peer alive: every rank stops after the same
       step (saving a checkpoint first with --exit-signal-handler) and rank 0 says in one line
       which step the last checkpoint holds; before the training loop, at once. (The time
       limits --exit-duration-in-mins and --exit-interval stop the same way with status 0.)
`kill -USR1 <pid>` makes a rank print every thread's Python stack to stderr and go on (for a
hang: where the main thread and the liveness monitor are).
"""

from __future__ import annotations

import faulthandler
import io
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from epoverlap.cli.process_end import stop_at_once
from epoverlap.config import (RunConfig, resolve_config, validate_config,
                              world_size_from_env)
from epoverlap.config.parse import (accepted_notes, flags_text, raise_refusals,
                                    read_command_line)
from epoverlap.config.resolve import path_text
from epoverlap.errors import ConfigError
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.parallel.watch import ROUTED_SIGNALS, PeerFailure, route_signals
from epoverlap.training.checkpoints.checkpoint_files import CheckpointRef, find_resume_checkpoint
from epoverlap.training.setup.data import open_data_source
from epoverlap.training.setup.memory import check_memory
from epoverlap.training.setup.environment import ep_cta_budget, setup_environment
from epoverlap.training.loop.stop import exit_status
from epoverlap.training.loop.trainer import Trainer


def _printer(enabled: bool, to_stderr: bool = False) -> Callable[[str], None]:
    """Print lines when `enabled`, to the stream in use at each line (with --log-dir, the
    rank's tee: see `_keep_rank_log`)."""
    def emit(message: str) -> None:
        if enabled:
            print(message, file=sys.stderr if to_stderr else sys.stdout, flush=True)
    return emit


QUIET_RANK_PAUSE_S = 5.0  # how long a rank that does not print waits before exiting


def _quiet_exit(status: int, printing: bool) -> int:
    """`status`; a rank that does not print first gives the printing one time to print
    (torchrun stops the job once a rank exits; its SIGTERM, once the printing rank has exited,
    ends the wait with the same status)."""
    if not printing and QUIET_RANK_PAUSE_S > 0:
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(status))
        time.sleep(QUIET_RANK_PAUSE_S)
    return status


def error_lines(prog: str, error: Exception) -> list[str]:
    """`PROG: error: ...`, one line per problem (several refused flags are several)."""
    return [f"{prog}: error: {line}" for line in str(error).splitlines()]


def _fail(error: Exception, status: int, printing: bool) -> int:
    """One line per problem (from the printing rank) and `status`, for a failure every rank
    meets alike."""
    for line in error_lines("epoverlap-train", error):
        _printer(printing, to_stderr=True)(line)
    return _quiet_exit(status, printing)


class _Tee(io.TextIOBase):
    """Writes to the stream it wraps and to this rank's log file (--log-dir)."""

    def __init__(self, stream, log_file):
        self.stream, self.log_file = stream, log_file

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.log_file.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log_file.flush()

    def fileno(self) -> int:  # faulthandler's stack dumps go to the terminal's descriptor
        return self.stream.fileno()


def _keep_rank_log(cfg: RunConfig) -> None:
    """--log-dir: everything this rank prints goes to DIR/rank-NNNNN.log too."""
    if cfg.log.log_dir is None:
        return
    folder = Path(cfg.log.log_dir)
    folder.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    log_file = open(folder / f"rank-{rank:05d}.log", "a")
    log_file.write(f"epoverlap-train: rank {rank} of {world} on {socket.gethostname()}, pid "
                   f"{os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    sys.stdout, sys.stderr = _Tee(sys.stdout, log_file), _Tee(sys.stderr, log_file)


def _write_resolved_config(cfg: RunConfig, world_size: int, device: str,
                           log: Callable[[str], None]) -> None:
    """The resolved configuration, once: a compact line, and JSON beside --log-json, in --save
    and in --tensorboard-dir (rank 0)."""
    flags = flags_text(cfg)
    log(f"config: {flags}")
    log(path_text(cfg, device))
    record = {"flags": flags, "world_size": world_size, "config": cfg.to_dict(),
              "torch": torch.__version__}
    places = [Path(cfg.checkpoint.save) / "config.json" if cfg.checkpoint.save else None,
              Path(cfg.log.tensorboard_dir) / "config.json" if cfg.log.tensorboard_dir else None,
              Path(cfg.log.log_json).with_suffix(".config.json") if cfg.log.log_json else None]
    for path in filter(None, places):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")


def checked_config(argv: Optional[list[str]], world_size: int, cuda_available: bool,
                   local_ranks: int = 1, printing: bool = True, prog: str = "epoverlap-train",
                   before_cuda: Callable[[RunConfig], None] = lambda cfg: None,
                   settings: Callable[[RunConfig], RunConfig] = lambda cfg: cfg
                   ) -> tuple[RunConfig, Optional[CheckpointRef], list[str]]:
    """Everything decided from the flags before the first collective: their rules, paths, what
    --load resumes from, the memory estimate. -> (config for this world, checkpoint to resume or
    None, deprecation warnings to print once accepted). Raises ConfigError naming every refusal
    of the command line, one line each (or a checkpoint file); with arguments no flag takes,
    argparse's usage line and the same lines (SystemExit, status 2). `before_cuda` runs between the checks
    that touch no CUDA and the memory check, which reads the GPU's size (process settings such
    as CUDA_DEVICE_MAX_CONNECTIONS go first). `settings` adds what a caller sets beside the
    flags (the benchmark harness's all-to-all stand-in, `main`) before the rules run. The data
    files are opened next, by `open_data_source`, also before any process group."""
    notes: list[str] = []
    cfg, refusals = read_command_line(argv, warn=notes.append, printing=printing)
    if cfg is not None:  # the rules' refusals beside the flags' own, in one run
        try:
            cfg = resolve_config(settings(cfg), world_size, cuda_available)
            validate_config(cfg, world_size, cuda_available)
        except ConfigError as error:
            refusals.append(error)
    raise_refusals(refusals, printing, prog)
    resume = find_resume_checkpoint(cfg.checkpoint.load, cfg.checkpoint.save)
    before_cuda(cfg)
    check_memory(cfg, world_size, cfg.resolved_device(cuda_available), local_ranks)
    return cfg, resume, [f"{prog}: warning: {note}" for note in notes]


def main(argv: Optional[list[str]] = None,
         settings: Callable[[RunConfig], RunConfig] = lambda cfg: cfg) -> int:
    """The training command (see the module docstring); the signal handlers and the --log-dir
    streams it installs are the process's only while it runs. `settings`: config fields that
    are no flags, set by a caller (`benchmarks.harness.train_bench`: the all-to-alls'
    stand-in)."""
    handlers = {signum: signal.getsignal(signum) for signum in ROUTED_SIGNALS}
    streams = sys.stdout, sys.stderr
    try:
        return _train(argv, settings)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
        if isinstance(sys.stdout, _Tee):
            sys.stdout.flush()
            sys.stdout.log_file.close()
        sys.stdout, sys.stderr = streams


def _train(argv: Optional[list[str]], settings: Callable[[RunConfig], RunConfig]) -> int:
    printing = os.environ.get("LOCAL_RANK", "0") == "0"  # one voice per node for bad input
    stop_at_once("epoverlap-train", printing)  # until route_signals hands them to the watch
    warn = _printer(printing, to_stderr=True)
    cuda = torch.cuda.is_available()

    def environment(cfg: RunConfig) -> None:
        setup_environment(cfg, lambda msg: warn(f"epoverlap-train: warning: {msg}"))
    world = world_size_from_env()
    try:
        cfg, resume, warnings = checked_config(
            argv, world, cuda, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), printing,
            before_cuda=environment, settings=settings)
        data = open_data_source(cfg, cfg.data_parallel_size(world))  # files, before any group
    except ConfigError as error:
        return _fail(error, 2, printing)
    except SystemExit as stop:  # --help (status 0), or argparse exiting by itself
        if stop.code:
            _quiet_exit(2, printing)
        raise
    _keep_rank_log(cfg)
    for line in warnings:
        warn(line)
    notes = accepted_notes(cfg)
    if notes:
        _printer(printing)("accepted from Megatron-LM, no effect here: " + "; ".join(notes))
    if cfg.checkpoint.load is not None and resume is None:
        _printer(printing)(f"checkpoint: none in {cfg.checkpoint.load} yet; starting at step 1")
    groups = init_distributed(cfg.parallel.expert_model_parallel_size, cfg.resolved_device(cuda),
                              cfg.parallel.distributed_timeout_minutes,
                              pp_size=cfg.parallel.pipeline_model_parallel_size,
                              ep_budget=ep_cta_budget(cfg),
                              cp_size=cfg.parallel.context_parallel_size)
    route_signals(groups.watch)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    trainer, status = None, 0
    try:
        log = _printer(groups.is_first())
        trainer = Trainer(cfg, groups, log=log, data=data, resume=resume)
        log(trainer.describe())
        unaligned = trainer.unaligned_line()
        if unaligned is not None:
            log(unaligned)
        if groups.is_first():
            _write_resolved_config(trainer.cfg, groups.world_size, groups.device.type, log)
        trainer.train()
        status = exit_status(trainer.stopped_by)
    except PeerFailure as failure:
        groups.watch.report(failure)  # one line, then the process exits (status 3)
    except ConfigError as error:  # a checkpoint that cannot be loaded: every rank alike
        return _fail(error, 2, groups.is_first())
    except FloatingPointError as error:  # NaN/Inf: every rank raises the same message
        return _fail(error, 1, groups.is_first())
    finally:
        if trainer is not None:
            trainer.close()
        destroy_distributed(groups)
    return status
