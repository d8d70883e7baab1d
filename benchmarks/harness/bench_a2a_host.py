"""Host time of one expert-parallel all-to-all call, piece by piece (one process).

    python -m benchmarks.harness.bench_a2a_host [--rows 1024] [--hidden 512] [--calls 200] [--repeats 15]
    python -m benchmarks.harness.bench_a2a_host --device cpu      # gloo, the same pieces

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
few microseconds). Prints a markdown table last; on CUDA a second one: the dropless
dispatch's split-size exchange (`ExpertComm.start_split_exchange` and its read) whole and the
calls it is made of (checked to read the sizes it was sent first).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch
import torch.distributed as dist

from benchmarks.harness.bench_launch import host_us


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


def exchange_pieces(groups, experts: int) -> dict[str, Callable[[], object]]:
    """CUDA: name -> the dropless dispatch's split-size exchange (`ExpertComm.
    start_split_exchange`, then `SplitExchange.read`) whole, and the calls it is made of, for
    counts of `experts` experts over an `ExpertComm` of size 2 on this one-rank group (the
    exchange then goes through NCCL as with EP > 1)."""
    from epoverlap.parallel.comm import ExpertComm

    comm = ExpertComm(groups.ep, size=2, counts_group=groups.ep)
    counts_E = torch.arange(experts, device=groups.device, dtype=torch.int64)
    send_RL = counts_E.view(2, -1)
    recv_RL = torch.empty_like(send_RL)
    stream = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    host = torch.empty((2,) + tuple(send_RL.shape), dtype=send_RL.dtype, pin_memory=True)

    def stream_context():
        with torch.cuda.stream(stream):
            pass

    def set_stream_and_back():
        current = torch.cuda.current_stream()
        torch.cuda.set_stream(stream)
        torch.cuda.set_stream(current)

    def event_record():
        event = torch.cuda.Event()
        event.record(stream)
        return event

    return {
        "start + read (what the dispatch pays)": lambda: comm.start_split_exchange(
            counts_E).read(),
        "start": lambda: comm.start_split_exchange(counts_E),
        "side stream waits on the current one (`wait_stream`)": lambda: stream.wait_stream(
            torch.cuda.current_stream()),
        "`with torch.cuda.stream(side)` (enter, exit)": stream_context,
        "`set_stream` to the side stream and back": set_stream_and_back,
        "counts all-to-all (`Group.all_to_all_single`)": lambda: groups.ep.all_to_all_single(
            recv_RL, send_RL),
        "pinned `torch.empty` [2, R, L]": lambda: torch.empty(
            (2,) + tuple(send_RL.shape), dtype=send_RL.dtype, pin_memory=True),
        "copy of [R, L] to pinned memory (non-blocking)": lambda: host[0].copy_(
            send_RL, non_blocking=True),
        "`torch.cuda.Event()` + record": event_record,
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
    parser.add_argument("--experts", type=int, default=16,
                        help="CUDA: the split-size exchange's expert count (even)")
    args = parser.parse_args(argv)
    if args.experts < 2 or args.experts % 2:
        parser.error(f"--experts: {args.experts} must be even and >= 2 (two ranks' layout)")
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
        exchange = {}
        if kind == "cuda":
            local = args.experts // 2  # one rank's view of counts 0..E-1: received = sent
            rows_R = [sum(range(local)), sum(range(local, args.experts))]
            expected = (rows_R, rows_R, [e + local + e for e in range(local)])
            read = exchange_pieces(groups, args.experts)["start + read (what the dispatch pays)"]()
            if read != expected:
                raise SystemExit(f"bench_a2a_host: the split exchange read {read}, "
                                 f"expected {expected}")
            for name, fn in exchange_pieces(groups, args.experts).items():
                print(f"bench_a2a_host: timing the split exchange: {name}", flush=True)
                exchange[name] = host_us(fn, args.calls, args.repeats, sync)
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
    if exchange:
        print(f"\nthe split-size exchange of {args.experts} experts over 2 ranks' layout, "
              "host us per call\n| piece | host us per call |\n| --- | --- |")
        for name, us in exchange.items():
            print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
