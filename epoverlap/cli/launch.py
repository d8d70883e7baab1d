"""The main job launcher: `epoverlap-launch [--nproc N] [--nnodes N --rdzv-endpoint HOST:PORT
[--rdzv-id ID] [--node-rank R]] [TRAIN FLAGS...]`.

Owns the quick-start defaults: it starts torchrun (in this process) with one
rank per visible GPU (NCCL), or 2 CPU ranks (gloo) when there is none, and runs
`epoverlap.train` with a small MoE model sized for the machine (`--preset tiny` on CPU ranks,
`--preset small` on GPUs). The rest of the defaults (expert parallelism over all ranks, the EP
overlap, bf16 and partial CUDA graphs on GPUs) are the training command's own, the same under
plain torchrun (`config.resolve`). Any flag given is passed through; `--nproc N` overrides the
rank count per node.

One node (no `--nnodes`, or 1) is `torchrun --standalone`. Several nodes run the same command
on every node, with torchrun's c10d rendezvous at `--rdzv-endpoint` (on one of the nodes,
reachable from all): `--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID`.
The rendezvous numbers the nodes itself (torchrun ignores a node rank under c10d), so
`--node-rank R` is only checked to lie in [0, N), not passed on. The flags are checked against
the whole world, N x ranks per node (examples/slurm/train.sbatch, docs/multinode.md).

Every flag is parsed and checked (the training command's own checks, memory estimate
included) before a rank is started, so bad input is one line and exit status 2. When ranks
fail, their own lines say why, and the launcher ends with one line naming the first rank that
failed and its exit status (torchrun's error report and its traceback are not printed); the
launcher's status is that rank's.

A SIGTERM or SIGINT (Ctrl-C reaches the launcher only: torchrun starts the ranks in sessions of
their own) before torchrun has started the ranks ends the launcher with one line naming it;
after, torchrun forwards that same signal to the ranks, and the launcher exits with 128 + the
signal as soon as they have.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NamedTuple, Optional

from epoverlap.cli.process_end import exit_now, spawn_with_stops_held, stop_at_once

if __name__ == "__main__":  # a signal while the heavy modules load: one line, no traceback
    stop_at_once("epoverlap-launch", printing=True, when="before the ranks started")

import torch

from epoverlap.config import build_parser
from epoverlap.errors import ConfigError
from epoverlap.cli.train import checked_config, error_lines
from epoverlap.training.setup.data import open_data_source

PROG = "epoverlap-launch"
LAUNCHER_FLAGS = {  # the launcher's own flags (not passed to training): metavar, help
    "--nproc": ("N", "ranks to start on this machine (default: one per visible GPU, or 2 on "
                     "CPU)"),
    "--nnodes": ("N", "nodes in the job, each running this command (default: 1, torchrun "
                      "--standalone); flags are checked for N x --nproc ranks"),
    "--rdzv-endpoint": ("HOST:PORT", "with --nnodes > 1, required: torchrun's c10d "
                                     "rendezvous, on one of the nodes (the first), reachable "
                                     "from every node"),
    "--rdzv-id": ("ID", "the job's name at the rendezvous, the same on every node (default: "
                        "epoverlap; under Slurm the job id)"),
    "--node-rank": ("R", "this node's index, checked to be in [0, --nnodes); the c10d "
                         "rendezvous numbers the nodes itself, so it is not passed on"),
}


def _has(flag: str, args: list[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def default_train_args(on_gpu: bool, user_args: list[str]) -> list[str]:
    """The quick-start model, unless the user gave a preset: `tiny` on CPU ranks, `small` on
    GPUs, each a run of a minute or less. Everything else (EP size, overlap, bf16, CUDA graphs)
    the training command resolves itself (`config.resolve`), as under plain torchrun."""
    if _has("--preset", user_args):
        return user_args
    return ["--preset", "small" if on_gpu else "tiny"] + user_args


def split_launcher_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """({launcher flag: its value as typed, the last one given}, the training command's
    arguments)."""
    values: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        flag, equals, value = argv[i].partition("=")
        if flag in LAUNCHER_FLAGS and (equals or i + 1 < len(argv)):
            if not equals:
                i += 1
                value = argv[i]
            values[flag] = value
        else:
            rest.append(argv[i])
        i += 1
    return values, rest


def launch_parser():
    """The training command's parser plus the launcher's flags (so --help lists every flag)."""
    parser = build_parser(prog=PROG)
    parser.usage = ("%(prog)s [--nproc N] [--nnodes N --rdzv-endpoint HOST:PORT] "
                    "[--preset NAME] [FLAG VALUE ...]   (--help lists every flag)")
    parser.description = ("Start the main job: torchrun --standalone with one rank per GPU\n"
                          "(--preset small) or 2 CPU ranks (--preset tiny); flags given win.\n"
                          "Several nodes: the same command on every node, with --nnodes and\n"
                          "--rdzv-endpoint (torchrun's c10d rendezvous).\n"
                          "Defaults marked auto below are resolved as under plain torchrun.")
    for flag, (metavar, text) in LAUNCHER_FLAGS.items():
        parser.add_argument(flag, default=None, metavar=metavar, help=text)
    return parser


class Nodes(NamedTuple):
    """The job's nodes: one (`--standalone`) or several meeting at a c10d rendezvous."""
    count: int = 1
    endpoint: Optional[str] = None
    rdzv_id: str = "epoverlap"

    def torchrun_args(self, nproc: int) -> list[str]:
        if self.count == 1:
            return ["--standalone", f"--nproc-per-node={nproc}"]
        return [f"--nnodes={self.count}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.rdzv_id}"]


def _count(flag: str, text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(flag, text, f"an integer ({what})") from None


def _check_endpoint(text: str) -> str:
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [IPv6]:PORT
        host = host[1:-1]
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError("--rdzv-endpoint", text,
                          "HOST:PORT, a host every node reaches and a port in 1..65535 "
                          "(e.g. node001:29500)")
    return text


def plan_nodes(values: dict[str, str]) -> Nodes:
    """The checked --nnodes, --node-rank, --rdzv-endpoint and --rdzv-id (texts as typed);
    raises ConfigError."""
    text = values.get("--nnodes")
    count = 1 if text is None else _count("--nnodes", text, "nodes in the job")
    if count < 1:
        raise ConfigError("--nnodes", text, "must be >= 1")
    rank = values.get("--node-rank")  # checked only: the c10d rendezvous numbers the nodes
    if rank is not None and not 0 <= _count("--node-rank", rank, "this node's index") < count:
        raise ConfigError("--node-rank", rank, f"must be in [0, --nnodes={count})")
    endpoint = values.get("--rdzv-endpoint")
    if endpoint is not None:
        _check_endpoint(endpoint)
    elif count > 1:
        raise ConfigError("--nnodes", count, "needs --rdzv-endpoint HOST:PORT, the c10d "
                          "rendezvous on one of the nodes (the first), reachable from every node")
    rdzv_id = values.get("--rdzv-id", "epoverlap")
    if not rdzv_id:
        raise ConfigError("--rdzv-id", "(empty)", "a name, the same on every node")
    return Nodes(count, endpoint, rdzv_id)


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


def plan_launch(argv: list[str], nodes: Optional[Nodes] = None) -> tuple[int, bool, list[str]]:
    """(ranks per node, on GPU, the training command's flags) after every check, the flags
    checked for the whole world (nodes x ranks per node); raises ConfigError, argparse errors
    exit with status 2."""
    args = launch_parser().parse_args(argv)
    values, user_args = split_launcher_flags(argv)
    nodes = plan_nodes(values) if nodes is None else nodes
    gpus = torch.cuda.device_count()
    on_gpu = gpus > 0 and args.device in (None, "auto", "cuda")
    nproc = _nproc(values.get("--nproc"), gpus, on_gpu)
    world = nodes.count * nproc
    train_args = default_train_args(on_gpu, user_args)
    cfg, _, _ = checked_config(train_args, world, torch.cuda.is_available(), nproc,
                               printing=True, prog=PROG)
    if cfg.data.data_path:  # the dataset files, as the ranks will open them
        open_data_source(cfg, cfg.data_parallel_size(world))
    return nproc, on_gpu, train_args


def main(argv: Optional[list[str]] = None) -> int:
    """The command (`argv` None: sys.argv, and the process exits once torchrun has returned)
    or, given `argv`, its status."""
    as_command = argv is None
    if as_command:  # until torchrun takes the signals, as it starts the ranks
        stop_at_once(PROG, printing=True, when="before the ranks started")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        nodes = plan_nodes(split_launcher_flags(argv)[0])
        nproc, on_gpu, train_args = plan_launch(argv, nodes)
    except ConfigError as error:
        print("\n".join(error_lines(PROG, error)), file=sys.stderr, flush=True)
        return 2
    torchrun_args = [*nodes.torchrun_args(nproc), "-m", "epoverlap.train", *train_args]
    print(f"{PROG}: {_where(nodes, nproc, on_gpu)}: torchrun {' '.join(torchrun_args)}",
          flush=True)
    status = run_torchrun(torchrun_args)
    if as_command:
        exit_now(status)
    return status


def _where(nodes: Nodes, nproc: int, on_gpu: bool) -> str:
    """`2 GPU rank(s), NCCL`, or `2 nodes x 8 GPU rank(s) = world 16, NCCL`."""
    ranks = f"{nproc} {'GPU' if on_gpu else 'CPU'} rank(s)"
    backend = "NCCL" if on_gpu else "gloo"
    if nodes.count == 1:
        return f"{ranks}, {backend}"
    return f"{nodes.count} nodes x {ranks} = world {nodes.count * nproc}, {backend}"


def run_torchrun(torchrun_args: list[str]) -> int:
    """torchrun in this process; one line for failed ranks; the first failure's status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _quiet_torch_elastic()
    start = getattr(SubprocessContext._start, "__wrapped__", SubprocessContext._start)
    SubprocessContext._start = spawn_with_stops_held(start)
    _stop_workers_within_the_shutdown_timeout()
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as error:
        print(f"{PROG}: {_failures_line(error.failures)}", file=sys.stderr, flush=True)
        _, first = min(error.failures.items(), key=_failure_order)
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


def _failure_order(item: tuple) -> tuple:
    """First failure first: torch elastic stamps failures in whole seconds, so a rank that
    exited with a status and the rank the launcher killed after it often share a second;
    there the exit status comes first (the kill was its consequence), then the lower rank."""
    rank, failure = item
    return failure.timestamp, failure.exitcode < 0, rank


def _failures_line(failures: dict) -> str:
    """`rank 0 exited with status 3; rank 1 was killed by SIGKILL`, first failure first."""
    parts = []
    for rank, failure in sorted(failures.items(), key=_failure_order):
        if failure.exitcode < 0:
            parts.append(f"rank {rank} was killed by {signal.Signals(-failure.exitcode).name}")
        else:
            parts.append(f"rank {rank} exited with status {failure.exitcode}")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
