"""Host time of one expert-parallel all-to-all call, piece by piece (one process).

    python tools/bench_a2a_host.py [--rows 1024] [--hidden 512] [--calls 200] [--repeats 15]
    python tools/bench_a2a_host.py --device cpu      # gloo, the same pieces

Each all-to-all of the MoE layer (the dispatch's tokens and probs, the combine, and their
backwards: six a layer and microbatch, plus the split-size exchange) goes through these layers,
timed here from the bottom up at a host-bound size ([rows, hidden] bf16 on CUDA, fp32 on CPU):

  - `backend`: the process group's own call and the work's wait (`groups.blocking_all_to_all`,
    what the short path calls): the floor, NCCL's (or gloo's) enqueue;
  - `dist.all_to_all_single`: torch's Python wrapper around it (checks, options, group lookup);
  - `watch.collective + dist`: the path every EP all-to-all took before the short path (the
    watch's generator context, an f-string description per call, a CUDA event);
  - `Group.all_to_all_single`: the short path (the backend call inside the watch's `begin` /
    `end` with a description made once; `parallel/groups.py`);
  - `ExpertComm.all_to_all`: plus the output's allocation and the split sum;
  - `AllToAll.apply`: plus the autograd Function (the input requires grad), the call the
    dispatcher makes.

The process is a world of one rank (NCCL on the GPU, gloo on CPU) with splits [rows], so the
all-to-all is a local copy issued through the real backend. The `ExpertComm` is given size 2:
past its one-rank shortcut (a clone), so the call reaches the backend as it does with EP > 1.
Each figure is the median over --repeats of the mean host wall time per call of --calls calls
issued back to back after a device synchronize (on CUDA the GPU keeps up: these copies take a
few microseconds). Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch
import torch.distributed as dist

from epoverlap_tools.bench_launch import host_us


def pieces(groups, send: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> one all-to-all of `send` through that many layers, the bottom first; each
    returns what it received."""
    from epoverlap.parallel.comm import AllToAll, ExpertComm
    from epoverlap.parallel.groups import blocking_all_to_all

    group = groups.ep
    recv = torch.empty_like(send)
    send_grad = send.clone().requires_grad_(True)
    splits = [send.shape[0]]
    pg = group.pg if group.pg is not None else dist.distributed_c10d._get_default_group()
    backend_call = blocking_all_to_all(pg)
    comm = ExpertComm(group, size=2)  # size 2: past the one-rank shortcut (module docstring)

    def backend():
        backend_call(recv, send, splits, splits)
        return recv

    def dist_call():
        dist.all_to_all_single(recv, send, splits, splits, group=group.pg)
        return recv

    def watched_dist():
        with group.watch.collective(group.name, group.ranks, "all_to_all"):
            dist.all_to_all_single(recv, send, splits, splits, group=group.pg)
        return recv

    def short_path():
        group.all_to_all_single(recv, send, splits, splits)
        return recv

    return {
        "backend (ProcessGroup call + wait)": backend,
        "dist.all_to_all_single": dist_call,
        "watch.collective + dist (the path before)": watched_dist,
        "Group.all_to_all_single (short path)": short_path,
        "ExpertComm.all_to_all (+ output, split sum)": lambda: comm.all_to_all(
            send, splits, splits),
        "AllToAll.apply (+ autograd Function)": lambda: AllToAll.apply(
            comm, send_grad, splits, splits),
    }


def check_copy(name: str, fn: Callable[[], torch.Tensor], sent: torch.Tensor) -> None:
    """A one-rank all-to-all is a copy: the piece's output must equal what it sent, bit for
    bit, or the timing means nothing."""
    out = fn()
    if not torch.equal(out.detach(), sent):
        raise SystemExit(f"bench_a2a_host: {name}: the all-to-all did not copy its input")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: NCCL on GPU 0; cpu: gloo; auto: cuda when there is one")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    from epoverlap.parallel.groups import destroy_distributed, init_distributed

    kind = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    groups = init_distributed(1, kind, timeout_minutes=5)
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    try:
        dtype = torch.bfloat16 if kind == "cuda" else torch.float32
        send = torch.randn(args.rows, args.hidden, device=groups.device, dtype=dtype)
        rows = {}
        for name, fn in pieces(groups, send).items():
            print(f"bench_a2a_host: timing {name}", flush=True)
            check_copy(name, fn, send)
            rows[name] = host_us(fn, args.calls, args.repeats, sync)
    finally:
        destroy_distributed(groups)
    where = torch.cuda.get_device_name() if kind == "cuda" else "CPU"
    print(f"\nbench_a2a_host: {where}, {groups.backend}, torch {torch.__version__}, "
          f"[{args.rows}, {args.hidden}], host us per call (median of {args.repeats} x "
          f"{args.calls})")
    print("| piece | host us per call | over the piece above |\n| --- | --- | --- |")
    previous = None
    for name, us in rows.items():
        delta = "" if previous is None else f"{us - previous:+.1f}"
        print(f"| {name} | {us:.1f} | {delta} |")
        previous = us
    return 0


if __name__ == "__main__":
    sys.exit(main())
