"""The main job launcher: `epoverlap-launch [--nproc N] [TRAIN FLAGS...]`.

Owns the quick-start defaults: it starts torchrun (`--standalone`, in this process) with one
rank per visible GPU (NCCL), or 2 CPU ranks (gloo) when there is none, and runs
`epoverlap.train` with a small MoE model sized for the machine (`--preset tiny` on CPU ranks,
`--preset small` on GPUs), expert parallelism over all ranks and the EP overlap on (when there
is more than one rank), bf16 and partial CUDA graphs on GPUs. Any flag given is
passed through and wins over these defaults; `--nproc N` overrides the rank count. For
multi-node runs call torchrun directly (see the README).

Every flag is parsed and checked (the training command's own checks, memory estimate
included) before a rank is started, so bad input is one line and exit status 2. When ranks
fail, their own lines say why, and the launcher ends with one line naming the first rank that
failed and its exit status (torchrun's error report and its traceback are not printed); the
launcher's status is that rank's.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional

import torch

from epoverlap.config import build_parser
from epoverlap.errors import ConfigError
from epoverlap.cli.train import checked_config, error_lines
from epoverlap.training.data import open_data_source

PROG = "epoverlap-launch"


def _has(flag: str, args: list[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def default_train_args(nproc: int, on_gpu: bool, user_args: list[str]) -> list[str]:
    """Quick-start flags, skipping any the user gave: a model sized for the machine (`tiny` on
    CPU ranks, `small` on GPUs, each a run of a minute or less)."""
    preset = "small" if on_gpu else "tiny"
    defaults: list[tuple[str, Optional[str]]] = [("--preset", preset),
                                                 ("--expert-model-parallel-size", str(nproc))]
    if nproc > 1 and not _has("--no-overlap-moe-expert-parallel-comm", user_args):
        defaults.append(("--overlap-moe-expert-parallel-comm", None))
    if on_gpu:
        defaults.append(("--bf16", None))
        # partial CUDA graphs of the pre-dispatch segments: the same bits as eager, with the
        # host's launch work of those segments replayed at once; --cuda-graph-impl none: off
        defaults.append(("--cuda-graph-impl", "local"))
        if not _has("--cuda-graph-impl", user_args):
            defaults.append(("--cuda-graph-modules", "attn moe_router moe_preprocess"))
    args: list[str] = []
    for flag, value in defaults:
        if not _has(flag, user_args):
            args += [flag] if value is None else [flag, *value.split()]
    return args + user_args


def split_nproc(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """(the --nproc value as typed, or None; the other arguments)."""
    for i, arg in enumerate(argv):
        if arg == "--nproc" and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith("--nproc="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def launch_parser():
    """The training command's parser plus --nproc (so --help lists every flag)."""
    parser = build_parser(prog=PROG)
    parser.usage = ("%(prog)s [--nproc N] [--preset NAME] [FLAG VALUE ...]   "
                    "(--help lists every flag)")
    parser.description = ("Start the main job: torchrun --standalone with one rank per GPU\n"
                          "(--preset small, bf16, partial CUDA graphs) or 2 CPU ranks (--preset\n"
                          "tiny), EP over all ranks, the EP overlap on; flags given win over\n"
                          "these defaults.")
    parser.add_argument("--nproc", default=None, metavar="N",
                        help="ranks to start on this machine (default: one per visible GPU, "
                             "or 2 on CPU)")
    return parser


def _nproc(text: Optional[str], gpus: int, on_gpu: bool) -> int:
    if text is None:
        return gpus if on_gpu else 2
    try:
        nproc = int(text)
    except ValueError:
        raise ConfigError("--nproc", text, "a positive integer (ranks to start)") from None
    if nproc < 1:
        raise ConfigError("--nproc", text, "must be >= 1")
    if on_gpu and nproc > gpus:
        raise ConfigError("--nproc", text, f"only {gpus} GPU(s) are visible (one rank per GPU)")
    return nproc


def plan_launch(argv: list[str]) -> tuple[int, bool, list[str]]:
    """(ranks, on GPU, the training command's flags) after every check; raises ConfigError,
    argparse errors exit with status 2."""
    args = launch_parser().parse_args(argv)
    nproc_text, user_args = split_nproc(argv)
    gpus = torch.cuda.device_count()
    on_gpu = gpus > 0 and args.device in (None, "auto", "cuda")
    nproc = _nproc(nproc_text, gpus, on_gpu)
    train_args = default_train_args(nproc, on_gpu, user_args)
    cfg, _, _ = checked_config(train_args, nproc, torch.cuda.is_available(), nproc,
                               printing=True, prog=PROG)
    if cfg.data.data_path:  # the dataset files, as the ranks will open them
        open_data_source(cfg, cfg.data_parallel_size(nproc))
    return nproc, on_gpu, train_args


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        nproc, on_gpu, train_args = plan_launch(argv)
    except ConfigError as error:
        print("\n".join(error_lines(PROG, error)), file=sys.stderr, flush=True)
        return 2
    torchrun_args = ["--standalone", f"--nproc-per-node={nproc}", "-m", "epoverlap.train",
                     *train_args]
    where = f"{nproc} GPU rank(s), NCCL" if on_gpu else f"{nproc} CPU rank(s), gloo"
    print(f"{PROG}: {where}: torchrun {' '.join(torchrun_args)}", flush=True)
    return run_torchrun(torchrun_args)


def run_torchrun(torchrun_args: list[str]) -> int:
    """torchrun in this process; one line for failed ranks; the first failure's status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _quiet_torch_elastic()
    _stop_workers_within_the_shutdown_timeout()
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as error:
        print(f"{PROG}: {_failures_line(error.failures)}", file=sys.stderr, flush=True)
        _, first = error.get_first_failure()
        return first.exitcode if first.exitcode > 0 else 128 - first.exitcode
    except SignalException as stop:  # the ranks got it forwarded; rank 0 said where they stopped
        return 128 + int(stop.sigval)
    return 0


def _quiet_torch_elastic() -> None:
    """torch elastic's loggers print warnings and tracebacks of their own beside the ranks'
    one-line reports; the launcher says what happened in its own line."""
    for name in list(logging.root.manager.loggerDict) + ["torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


FAILED_RANK_GRACE_S = 5  # after a rank fails, the others report their line within ~3 s


def _stop_workers_within_the_shutdown_timeout() -> None:
    """After a rank fails, torch elastic stops the others with its own fixed 30 s grace (the
    process context's `_poll` closes them with `close()`'s default, and the agent's
    `_stop_workers` calls `_shutdown()` without its configured timeout), so a stopped rank
    (SIGSTOP) held the job 30 s past the line naming it. Here both take
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT when set, else FAILED_RANK_GRACE_S; a signal to the launcher
    keeps torch's own grace (time for --exit-signal-handler's save)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext
    grace = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", FAILED_RANK_GRACE_S))
    close = getattr(PContext.close, "__wrapped__", PContext.close)

    def close_within_grace(self, death_sig=None, timeout: int = grace) -> None:
        close(self, death_sig, timeout)
    close_within_grace.__wrapped__ = close

    def stop_workers(self, worker_group) -> None:
        self._shutdown(timeout=grace)
    PContext.close = close_within_grace
    LocalElasticAgent._stop_workers = stop_workers


def _failures_line(failures: dict) -> str:
    """`rank 1 was killed by SIGKILL; rank 0 exited with status 3`, first failure first."""
    parts = []
    for rank, failure in sorted(failures.items(), key=lambda item: item[1].timestamp):
        if failure.exitcode < 0:
            parts.append(f"rank {rank} was killed by {signal.Signals(-failure.exitcode).name}")
        else:
            parts.append(f"rank {rank} exited with status {failure.exitcode}")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
