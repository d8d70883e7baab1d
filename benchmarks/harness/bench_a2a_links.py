"""All-to-all bandwidth per GPU on each link of one machine split into emulated hosts.

    torchrun --standalone --nproc-per-node 4 -m benchmarks.harness.bench_a2a_links \
        --emulate-hosts 2 [--mib 1,4,16,64] [--iters 20] [--warmup 3] [--beside-gemm 8192]
        --out a2a_links.json
    ... --device cpu            # gloo, the same groups and records (no links to speak of)

The world's ranks are split host-major into --emulate-hosts G hosts (host = rank // (world /
G)); each host's ranks get their own NCCL_HOSTID (`parallel.transport.emulated_host_id`, set
before the first communicator), so NCCL joins two hosts' ranks through its network transport
(NET/Socket here) and one host's over NVLink / P2P, as `--emulate-hosts` does in training.
Every rank builds the three groups, in one order, and times `all_to_all_single` with equal
splits in each, every group of a kind at once (as the MoE layer's all-to-alls run):

  - `intra`: the ranks of one host (NVLink / P2P);
  - `inter`: a rail, the ranks with one index inside their hosts (the network; the rails
    run at once, sharing what the socket transport gets on this machine);
  - `flat`: every rank (both links; the bytes to other hosts go over the network).

A group of one rank is left out. Each rank sends --mib MiB per call (fp32, rounded down to a
multiple of the group size), split equally over the group's ranks. An iteration's time is the
slowest rank's: on CUDA its events bracket the call after a one-element all-reduce over all
ranks (the streams start together) and a short GPU sleep (the host enqueues the call before
the start event fires); on CPU the wall clock after a barrier. The figure is the median over
--iters. GB/s per GPU = the bytes a rank sends to other ranks (size * (n - 1) / n) / time.

Each link's peak: a pair of ranks on it (ranks 0 and 1 inside host 0, ranks 0 and world / G
across hosts) exchanging --mib MiB both ways at once (`batch_isend_irecv`), the others idle;
GB/s per direction, the best over the sizes. Each all-to-all's `of_peak` is its link's GB/s
(for `flat`: only the bytes that cross hosts, against the network's peak) over that peak.

With --beside-gemm N (CUDA), each all-to-all is also timed while every rank runs a loop of
bf16 N x N x N GEMMs on another stream, started with it and long enough to outlast it (1.5x
its time alone): `beside_gemm` gives that median and its `slowdown` against the call alone,
what `epoverlap-simulate --comm-beside-compute` takes (the link through host memory or a
network slows while the GPU computes; NVLink hardly does).

Rank 0 writes --out (JSON: the environment, the groups, every iteration's time of every rank,
the medians, the peaks; on CUDA NCCL's transport per connection of the world's ranks, read
after the flat group's runs, and the run fails when one between hosts is not the network) and
prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from epoverlap.parallel.transport import (emulated_host_id, gather_report, nccl_host_identity,
                                         transport_log_env)

MIB = 2 ** 20
SLEEP_CYCLES = 1_000_000  # ~0.5 ms at GPU clocks: longer than the host takes to enqueue a call


def mib_list(text: str) -> list[float]:
    """'1,4' -> [1.0, 4.0]; each > 0."""
    values = [float(v) for v in text.split(",")]
    if min(values) <= 0:
        raise ValueError(text)
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--emulate-hosts", type=int, default=2,
                        help="hosts the ranks are split into (must divide the world size)")
    parser.add_argument("--mib", type=mib_list, default="1,4,16,64",
                        help="MiB each rank sends per call, comma-separated")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: NCCL, a GPU per rank; cpu: gloo; auto: cuda if there is one")
    parser.add_argument("--transport-report", action=argparse.BooleanOptionalAction,
                        default=True, help="CUDA: record NCCL's transport per connection "
                        "(NCCL_DEBUG=INFO into a file, unless NCCL_DEBUG is set)")
    parser.add_argument("--beside-gemm", type=int, default=0, metavar="N",
                        help="CUDA: also time each all-to-all beside a loop of N x N x N bf16 "
                        "GEMMs on another stream (0: not)")
    parser.add_argument("--out", help="the JSON record (rank 0 writes it)")
    args = parser.parse_args(argv)
    if args.beside_gemm < 0:
        parser.error(f"--beside-gemm {args.beside_gemm}: a GEMM size >= 1, or 0 for none")
    if args.iters < 1 or args.warmup < 0:
        parser.error(f"--iters {args.iters} must be >= 1, --warmup {args.warmup} >= 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if args.emulate_hosts < 1 or world % args.emulate_hosts:
        parser.error(f"--emulate-hosts {args.emulate_hosts}: must divide the world size {world}")
    if args.emulate_hosts > 1 and local_world != world:
        parser.error(f"--emulate-hosts {args.emulate_hosts}: emulated hosts split one machine's "
                     f"ranks ({local_world} local of {world})")
    return args


def group_members(world: int, hosts: int) -> dict[str, list[list[int]]]:
    """kind -> the rank lists of its groups (groups of one rank left out)."""
    per = world // hosts
    kinds = {"intra": [list(range(h * per, (h + 1) * per)) for h in range(hosts)],
             "inter": [list(range(i, world, per)) for i in range(per)],
             "flat": [list(range(world))]}
    return {kind: lists for kind, lists in kinds.items() if len(lists[0]) > 1}


def link_pairs(world: int, hosts: int) -> dict[str, tuple[int, int]]:
    """link -> the pair of ranks whose exchange is that link's peak."""
    per = world // hosts
    return {link: pair for link, pair, there in (("intra", (0, 1), per > 1),
                                                 ("inter", (0, per), hosts > 1)) if there}


def link_share(kind: str, n: int, per: int) -> tuple[str, float]:
    """The link a group's all-to-all is held against, and the share of a rank's bytes that
    goes over it (`flat`: the bytes to other hosts; a flat group inside one host: intra)."""
    if kind == "inter":
        return "inter", (n - 1) / n
    if kind == "flat" and n > per:
        return "inter", (n - per) / n
    return "intra", (n - 1) / n


class BesideGemm:
    """A loop of bf16 n x n x n GEMMs on a stream of its own, `repeats` long, launched beside a
    timed call (`time_ms`)."""

    def __init__(self, n: int, device: torch.device):
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.stream, self.repeats = torch.cuda.Stream(device), 1
        for _ in range(3):  # warm up cuBLAS's choice, then time one GEMM
            torch.mm(self.a, self.b)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            torch.mm(self.a, self.b)
        end.record()
        end.synchronize()
        self.gemm_ms = start.elapsed_time(end) / 5

    def to_outlast(self, ms: float) -> "BesideGemm":
        """Enough GEMMs to run 1.5x `ms` (every rank asks with the same `ms`)."""
        self.repeats = max(1, math.ceil(1.5 * ms / self.gemm_ms))
        return self

    def launch(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.repeats):
                torch.mm(self.a, self.b)

    def wait(self) -> None:
        self.stream.synchronize()


def time_ms(fn: Callable[[], object] | None, cuda: bool, flag: torch.Tensor,
            beside: BesideGemm | None = None) -> float | None:
    """One iteration of `fn` (None on a rank that takes no part), started with every rank;
    `beside`: its GEMMs launched with it (the last iteration's finished first)."""
    if not cuda:
        dist.barrier()
        start = time.perf_counter()
        if fn is None:
            return None
        fn()
        return (time.perf_counter() - start) * 1e3
    if beside is not None:
        beside.wait()
    dist.all_reduce(flag)  # every rank's stream leaves this together
    if fn is None:
        return None
    torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    if beside is not None:
        beside.launch()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def samples(fn, args, cuda: bool, flag: torch.Tensor,
            beside: BesideGemm | None = None) -> list[list[float]]:
    """Every rank's --iters times (ms) after --warmup untimed ones: [rank][iteration]."""
    for _ in range(args.warmup):
        time_ms(fn, cuda, flag, beside)
    mine = [time_ms(fn, cuda, flag, beside) for _ in range(args.iters)]
    if beside is not None:
        beside.wait()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def gbps(byte_count: float, ms: float) -> float:
    return byte_count / (ms * 1e6)


def slowest(rank_samples: list) -> dict:
    """Every rank's samples, the slowest timed rank's per iteration, and their median (ms)."""
    per_iteration = [max(column) for column in zip(*(s for s in rank_samples if s[0] is not None))]
    return {"samples_ms": per_iteration, "rank_samples_ms": rank_samples,
            "ms": statistics.median(per_iteration)}


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int) -> Callable[[], None]:
    """Send `send` to `peer` while receiving `recv` from it."""
    def both_ways():
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return both_ways


def all_to_all_results(args, kinds: dict, device, cuda, flag,
                       beside: BesideGemm | None = None) -> list[dict]:
    """Each group kind of `kinds` (`group_members`) at every size: the slowest rank's time and
    GB/s per GPU; with `beside`, also its time beside the GEMM loop and the slowdown."""
    rank, results = dist.get_rank(), []
    per = dist.get_world_size() // args.emulate_hosts
    for kind, lists in kinds.items():
        groups = [dist.new_group(members) for members in lists]  # all ranks, one order
        mine = next(g for g, members in zip(groups, lists) if rank in members)
        n = len(lists[0])
        link, share = link_share(kind, n, per)
        for mib in args.mib:
            send = torch.ones(max(n, int(mib * MIB / 4) // n * n), device=device)
            call = partial(dist.all_to_all_single, torch.empty_like(send), send, group=mine)
            record, size = slowest(samples(call, args, cuda, flag)), send.numel() * 4
            if beside is not None:
                near = slowest(samples(call, args, cuda, flag, beside.to_outlast(record["ms"])))
                record["beside_gemm"] = {"n": args.beside_gemm, "repeats": beside.repeats,
                                         "gemm_ms": beside.gemm_ms, **near,
                                         "slowdown": near["ms"] / record["ms"]}
            results.append({"group": kind, "members": lists, "ranks": n, "bytes": size,
                            "gbps_per_gpu": gbps(size * (n - 1) / n, record["ms"]),
                            "link": link, "link_gbps": gbps(size * share, record["ms"]),
                            **record})
    return results


def peak_results(args, device, cuda, flag) -> dict:
    """link -> its pair's two-way exchange at every size, GB/s per direction; the best."""
    rank, peaks = dist.get_rank(), {}
    for link, pair in link_pairs(dist.get_world_size(), args.emulate_hosts).items():
        sizes = []
        for mib in args.mib:
            send = torch.ones(max(1, int(mib * MIB / 4)), device=device)
            peer = pair[1] if rank == pair[0] else pair[0]
            fn = exchange(send, torch.empty_like(send), peer) if rank in pair else None
            record = slowest(samples(fn, args, cuda, flag))
            sizes.append({"bytes": send.numel() * 4,
                          "gbps": gbps(send.numel() * 4, record["ms"]), **record})
        peaks[link] = {"pair": list(pair), "gbps": max(s["gbps"] for s in sizes),
                       "sizes": sizes}
    return peaks


def environment(cuda: bool) -> dict:
    """The versions, the device and the NCCL settings this run had; each rank's host id."""
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, os.environ.get("NCCL_HOSTID"))
    return {"torch": torch.__version__, "backend": dist.get_backend(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "nccl_env": {k: v for k, v in sorted(os.environ.items())
                         if k.startswith(("NCCL_", "TORCH_NCCL_", "NVSHMEM_", "TORCH_SYMM"))},
            "nccl_hostid_per_rank": hosts}


def print_tables(record: dict) -> None:
    print(f"\nbench_a2a_links: {record['world']} ranks as {record['hosts']} emulated hosts, "
          f"{record['environment']['device']}, {record['environment']['backend']}, "
          f"median of {record['iters']} (the slowest rank per iteration)")
    print("| group | ranks | MiB per rank | ms | GB/s per GPU | link | link GB/s | of peak |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in record["results"]:
        peak = f"{r['of_peak']:.2f}" if r["of_peak"] is not None else "-"
        print(f"| {r['group']} | {r['ranks']} | {r['bytes'] / MIB:g} | {r['ms']:.3f} | "
              f"{r['gbps_per_gpu']:.2f} | {r['link']} | {r['link_gbps']:.2f} | {peak} |")
    beside = [r for r in record["results"] if "beside_gemm" in r]
    if beside:
        print(f"\nbeside a loop of {beside[0]['beside_gemm']['n']}^3 bf16 GEMMs on another "
              "stream:\n| group | MiB per rank | ms alone | ms beside | slowdown |\n"
              "| --- | --- | --- | --- | --- |")
        for r in beside:
            print(f"| {r['group']} | {r['bytes'] / MIB:g} | {r['ms']:.3f} | "
                  f"{r['beside_gemm']['ms']:.3f} | {r['beside_gemm']['slowdown']:.3f} |")
    print("\n| link | pair | MiB | ms | GB/s per direction |\n| --- | --- | --- | --- | --- |")
    for link, peak in record["peaks"].items():
        for s in peak["sizes"]:
            print(f"| {link} | {peak['pair']} | {s['bytes'] / MIB:g} | {s['ms']:.3f} | "
                  f"{s['gbps']:.2f} |")
    transport = record["transport"] or {"lines": [], "problems": []}
    for line in transport["lines"] + [f"bench_a2a_links: WRONG LINK: {problem}"
                                      for problem in transport["problems"]]:
        print(line)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank, world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"])
    if args.emulate_hosts > 1:  # before the first communicator (NCCL reads it once)
        os.environ["NCCL_HOSTID"] = emulated_host_id(local_rank, world, args.emulate_hosts)
    log_env = transport_log_env() if cuda and args.transport_report else {}
    os.environ.update(log_env)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.beside_gemm and not cuda:
        print("bench_a2a_links: --beside-gemm needs CUDA (a GEMM on a stream beside the "
              "all-to-all's)", file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    try:
        flag, groups = torch.zeros(1, device=device), group_members(world, args.emulate_hosts)
        beside = BesideGemm(args.beside_gemm, device) if args.beside_gemm else None
        flat = all_to_all_results(args, {"flat": groups["flat"]}, device, cuda, flag, beside)
        # so far only communicators of the world's numbering have connected: NCCL's log names
        # global ranks (a subgroup's communicator numbers its own ranks from 0)
        report = gather_report(log_env.get("NCCL_DEBUG_FILE"), nccl_host_identity()) \
            if cuda and args.transport_report else None
        others = {kind: lists for kind, lists in groups.items() if kind != "flat"}
        record = {"benchmark": "bench_a2a_links", "environment": environment(cuda),
                  "world": world, "hosts": args.emulate_hosts, "iters": args.iters,
                  "warmup": args.warmup, "groups": groups,
                  "results": all_to_all_results(args, others, device, cuda, flag, beside)
                  + flat,
                  "peaks": peak_results(args, device, cuda, flag),
                  "transport": report and {"lines": report.lines(),
                                           "problems": report.problems()}}
        for r in record["results"]:
            peak = record["peaks"].get(r["link"])
            r["of_peak"] = r["link_gbps"] / peak["gbps"] if peak else None
        if dist.get_rank() == 0:
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(record, f, indent=1)
            print_tables(record)
    finally:
        dist.destroy_process_group()
    return 1 if record["transport"] and record["transport"]["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
