"""The training command with the benchmark-only flags, which are not the product's: the
all-to-alls' stand-in that measurements need and training never does.

    torchrun --standalone --nproc-per-node N -m benchmarks.harness.train_bench \\
        [--comm-mode local_copy] [--local-copy-hold-us N] FLAG ...

  --comm-mode real|local_copy   local_copy replaces each all-to-all by a local copy of its bytes:
                                the compute-only step (T_comp of bench_overlap, realized_share's
                                --comp, the simulator's compute inputs); default real
  --local-copy-hold-us N        with local_copy: each all-to-all node, after its copy, holds the
                                comm lane N us (GPU: a sleep kernel on the lane's stream; CPU:
                                the lane's thread sleeps), as a real all-to-all would, so the
                                host queues the compute behind it and the compute spans time the
                                device's work, not the host's launches; 0 (default): no hold

Every other flag is the training command's (`python -m epoverlap.train --help`), checked as
there; the two set the config's `overlap.comm_mode` and `overlap.local_copy_hold_us`, whose
rules (`config.validate`) refuse a hold without local copies in one line, and the span files
record the hold (docs/span-format.md). `parse_config` gives the same config in process.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Optional

from epoverlap.config import RunConfig
from epoverlap.config import parse_config as product_parse_config
from epoverlap.config.sections import COMM_MODES

PARSER = argparse.ArgumentParser(prog="benchmarks.harness.train_bench", add_help=False,
                                 allow_abbrev=False)
PARSER.add_argument("--comm-mode", choices=COMM_MODES, default="real")
PARSER.add_argument("--local-copy-hold-us", type=int, default=0, metavar="N")


def split(argv: list) -> tuple:
    """(the benchmark-only flags as a namespace, the training command's own arguments)."""
    return PARSER.parse_known_args(argv)


def settings(bench: argparse.Namespace) -> Callable[[RunConfig], RunConfig]:
    """The config with the benchmark-only fields set (the flags' rules still apply)."""
    def apply(cfg: RunConfig) -> RunConfig:
        overlap = dataclasses.replace(cfg.overlap, comm_mode=bench.comm_mode,
                                      local_copy_hold_us=bench.local_copy_hold_us)
        return dataclasses.replace(cfg, overlap=overlap)
    return apply


def parse_config(argv: list) -> RunConfig:
    """The training command's config for `argv`, the benchmark-only flags included."""
    bench, rest = split(list(argv))
    return settings(bench)(product_parse_config(rest))


def main(argv: Optional[list] = None) -> int:
    from epoverlap.cli.train import main as train_main

    bench, rest = split(sys.argv[1:] if argv is None else list(argv))
    return train_main(rest, settings(bench))


if __name__ == "__main__":
    sys.exit(main())
