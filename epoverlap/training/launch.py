"""The main job launcher: `epoverlap-launch [TRAIN FLAGS...]`.

Owns the quick-start defaults: it starts `torchrun --standalone` with one rank per visible GPU
(NCCL), or 2 CPU ranks (gloo) when there is none, and runs `epoverlap.train` with a small MoE
model (`--preset tiny`), expert parallelism over all ranks and the EP overlap on (when there is
more than one rank), bf16 on GPUs. Any flag given is passed through and wins over these
defaults; `--nproc N` overrides the rank count. For multi-node runs call torchrun directly
(see the README).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

import torch


def _has(flag: str, args: list[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def default_train_args(nproc: int, on_gpu: bool, user_args: list[str]) -> list[str]:
    """Quick-start flags, skipping any the user gave."""
    defaults: list[tuple[str, Optional[str]]] = [("--preset", "tiny"),
                                                 ("--expert-model-parallel-size", str(nproc))]
    if nproc > 1:
        defaults.append(("--overlap-moe-expert-parallel-comm", None))
    if on_gpu:
        defaults.append(("--bf16", None))
        # partial CUDA graphs of the pre-dispatch segments: bitwise equal to eager and faster
        # on every GPU measured (benchmarks/cuda_graphs.md); --cuda-graph-impl none: off
        defaults.append(("--cuda-graph-impl", "local"))
        if not _has("--cuda-graph-impl", user_args):
            defaults.append(("--cuda-graph-modules", "attn moe_router moe_preprocess"))
    args: list[str] = []
    for flag, value in defaults:
        if not _has(flag, user_args):
            args += [flag] if value is None else [flag, *value.split()]
    return args + user_args


def split_nproc(argv: list[str]) -> tuple[Optional[int], list[str]]:
    for i, arg in enumerate(argv):
        if arg == "--nproc" and i + 1 < len(argv):
            return int(argv[i + 1]), argv[:i] + argv[i + 2:]
        if arg.startswith("--nproc="):
            return int(arg.split("=", 1)[1]), argv[:i] + argv[i + 1:]
    return None, argv


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    nproc, user_args = split_nproc(argv)
    gpus = torch.cuda.device_count()
    on_gpu = gpus > 0 and not _has("--device", user_args)
    nproc = nproc or (gpus if on_gpu else 2)
    train_args = default_train_args(nproc, on_gpu, user_args)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "epoverlap.train"] + train_args
    where = f"{nproc} GPU rank(s), NCCL" if on_gpu else f"{nproc} CPU rank(s), gloo"
    print(f"epoverlap-launch: {where}: {' '.join(command[2:])}", flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
