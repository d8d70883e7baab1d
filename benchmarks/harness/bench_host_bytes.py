"""Bytes the MoE dispatch sends between hosts, measured against the simulator's prediction;
with --time, the time and GB/s of each comm node of the MoE layer: the simulator's measured
all-to-all input (`epoverlap-simulate --comm-from`).

    torchrun --standalone --nproc-per-node 4 -m benchmarks.harness.bench_host_bytes \\
        --hosts 2 [--tokens 4096] [--hidden 2048] [--cases 64:8,32:4] [--out host_bytes.json]
        [--time [--iters 10] [--warmup 3] [--links a2a_links.json]]

The EP group is the world, split into --hosts hosts of consecutive ranks; where every rank is
on this machine, each host's ranks get their own NCCL_HOSTID before the process group
(`parallel.transport.emulated_host_id`, as --emulate-hosts does in training), so NCCL joins
two hosts' ranks over its network transport. For each case (experts:topk) every rank routes
--tokens tokens with the router's benchmark mode (--moe-router-force-load-balancing: random
logits, balanced routing) and runs the forward dispatch three ways: once per expert (the flat
dropless dispatch), once per rank (--moe-dispatch-once-per-rank) and by host
(--moe-dispatch-hierarchy node). The all-to-alls are recorded (`ExpertComm.trace`); the rows
each rank sends to ranks of other hosts, and their bytes (hidden rows in bf16 on CUDA, fp32 on
CPU, plus the fp32 probs each row carries), are summed over the ranks and set beside the
simulator's balanced-routing formula (`simulator.costs.A2aShape.rows_between_hosts` /
`bytes_between_hosts`), which this code does not use to count. The split-size exchange's few
bytes are left out of both.

--time: per case and dispatch, on the same routed rows, the comm nodes of the MoE layer as the
training executor runs them (`model.transformer`: the `dispatch` node calls
`dispatcher.dispatch`, the `combine` node `dispatcher.combine` and the residual add), each cut
out of autograd as `schedule.node_run` cuts a node (detached inputs that require grad; the
backward on the node's own outputs, from a random grad):
  F.dispatch  the tokens' and probs' all-to-alls (by host: both stages), the sizes already read;
  B.dispatch  its backward: token and probs grads, in the combine's direction;
  F.combine   the all-to-all back of expert outputs shaped as the received rows, the unpermute,
              the residual add;
  B.combine   its backward: token grads, in the dispatch's direction;
  exchange    the split-size exchange (by host, the table exchange) the dispatch reads on the
              host: from the counts on the device to the host's read of them (the forward
              dispatch's host sync).
An iteration's time is the slowest rank's; the figure is the median over --iters after
--warmup. CUDA (`node_ms`): the stream first sleeps long enough (LAUNCH_AHEAD_CYCLES) for the
host to queue all of the node's launches, then a one-element all-reduce starts every rank
together, then events bracket the node. So, as in a comm-bound training step whose host runs
ahead, the time is the device's from a common start: neither the host's launches (autograd,
Triton, NCCL's enqueue) nor a rank whose sleep ran long count. A sample whose start event had
already fired when the host finished queueing the node is `host_late` (its host time may
count); the record keeps their number per node. CPU: wall clock after a barrier.
--exchange-beside times each all-to-all node with a split-size exchange started just before it
(as the overlapped schedule starts the next microbatch's while an all-to-all runs), finished by
its read. Each node's bytes come from the all-to-alls it recorded: per rank (mean over the
ranks) those to other ranks and, of them, to other hosts. GB/s per GPU = those bytes / the
median time; with --links (bench_a2a_links' JSON) the between-hosts GB/s against that link's
measured peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from epoverlap.config import parse_config
from epoverlap.config.dispatch import DispatchMode
from epoverlap.kernels import make_moe_ops
from epoverlap.model.dispatch import make_dispatcher
from epoverlap.model.moe import Router
from epoverlap.parallel.comm import ExpertComm, HostComms
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.parallel.transport import emulated_host_id
from epoverlap.simulator.costs import PROBS_BYTES, A2aShape

DISPATCHES = {"per_expert": dict(once_per_rank=False), "per_rank": dict(once_per_rank=True),
              "by_host": dict(once_per_rank=True, hierarchy="node")}
NODES = ("F.dispatch", "B.dispatch", "F.combine", "B.combine", "exchange")  # the timed order
# The stream's sleep before a node: ~10 ms at H100/H200 clocks, far longer than the host takes
# to queue a node (a backward through autograd and Triton launches: about 1 ms at most)
LAUNCH_AHEAD_CYCLES = 20_000_000


# ---------------------------------------------------------------------------- bytes sent
@dataclass(frozen=True)
class Peers:
    """One recording communicator, as the byte count sees it: this rank's index in it and the
    host of each of its ranks."""

    comm: ExpertComm
    me: int
    host_of: tuple[int, ...]


@dataclass
class Sent:
    """What one rank sent in some all-to-alls: bytes to other ranks, of them to other hosts,
    and the hidden rows to other hosts."""

    to_peers: float = 0.0
    between_hosts: float = 0.0
    rows_between_hosts: float = 0.0


def _comms(groups, hosts: int) -> tuple[ExpertComm, list[Peers]]:
    """The EP comm (with the by-host stages) and each of its communicators, all recording."""
    per_host = groups.ep_size // hosts
    my_host, index = divmod(groups.ep_rank, per_host)
    between, within = ExpertComm(groups.ep_rail, hosts), ExpertComm(groups.ep_host, per_host)
    comm = ExpertComm(groups.ep, groups.ep_size, counts_group=groups.ep_splits,
                      by_host=HostComms(between, within, groups.ep_rank))
    peers = [Peers(comm, groups.ep_rank, tuple(r // per_host for r in range(groups.ep_size))),
             Peers(between, my_host, tuple(range(hosts))),
             Peers(within, index, (my_host,) * per_host)]
    _clear(peers)
    return comm, peers


def _clear(peers: list[Peers]) -> None:
    for p in peers:
        p.comm.trace = []


def sent_in(peers: list[Peers], hidden: int) -> Sent:
    """The bytes of every all-to-all recorded since the last `_clear` (hidden rows: those of
    row shape (hidden,))."""
    sent = Sent()
    for p in peers:
        for _, input_splits, row_shape, dtype in p.comm.trace:
            width = math.prod(row_shape) * dtype.itemsize
            for peer, rows in enumerate(input_splits):
                if peer == p.me:
                    continue
                sent.to_peers += rows * width
                if p.host_of[peer] != p.host_of[p.me]:
                    sent.between_hosts += rows * width
                    sent.rows_between_hosts += rows if tuple(row_shape) == (hidden,) else 0
    return sent


# ---------------------------------------------------------------------------- one dispatch
@dataclass
class Routed:
    """One rank's routed tokens: its hidden states [T, H] and the preprocess's output."""

    x_TH: torch.Tensor
    rows: torch.Tensor
    probs: torch.Tensor
    counts: torch.Tensor
    row_id_map: torch.Tensor


def route(router: Router, dispatcher, x_TH: torch.Tensor) -> Routed:
    with torch.no_grad():
        probs, routing_map, counts = router(x_TH)
        rows, row_probs, row_id_map = dispatcher.preprocess(x_TH, probs, routing_map)
    return Routed(x_TH, rows, row_probs, counts, row_id_map)


def dispatch_bytes(dispatcher, routed: Routed, peers: list[Peers]) -> Sent:
    """What this rank's forward dispatch sends, its split-size exchange left out."""
    with torch.no_grad():
        exchange = dispatcher.start_split_exchange(routed.counts, routed.row_id_map)
        _clear(peers)
        dispatcher.dispatch(routed.rows, routed.probs, routed.counts, exchange,
                            routed.row_id_map)
    return sent_in(peers, routed.x_TH.shape[1])


class NodeBench:
    """The MoE layer's comm nodes of one dispatch on fixed routed rows, each as the executor
    runs it (module docstring). `calls()`: (node, fn, clock) in the timed order; a backward
    runs on the outputs of the forward just before it."""

    def __init__(self, dispatcher, routed: Routed, exchange_beside: bool = False):
        self.dispatcher, self.routed = dispatcher, routed
        self.exchange_beside = exchange_beside
        self.exchange = self.exchange_and_read()  # read: the timed dispatches find the sizes
        with torch.no_grad():
            recv, recv_probs, self.meta = self._dispatch(routed.rows, routed.probs)
        self.expert_out = torch.randn_like(recv)
        self.grad_recv = (torch.randn_like(recv), torch.randn_like(recv_probs))
        self.grad_hidden = torch.randn_like(routed.x_TH)
        self._pending: Optional[tuple] = None

    def calls(self, beside: Optional[bool] = None
              ) -> list[tuple[str, Callable[[], object], Optional[Callable]]]:
        """(node, queue it, then finish it on the host or None) in the timed order; with
        `beside` (default: `exchange_beside`), each all-to-all node queued just after a
        split-size exchange (its own communicator and stream) and finished by reading it, as
        the overlapped schedule starts the next microbatch's exchange while an all-to-all is
        in flight."""
        nodes = [("F.dispatch", self.dispatch_forward), ("B.dispatch", self.backward),
                 ("F.combine", self.combine_forward), ("B.combine", self.backward)]
        if self.exchange_beside if beside is None else beside:
            return [(node, self._beside(queue), self.read) for node, queue in nodes] + [
                ("exchange", self.start_exchange, self.read)]
        return [(node, queue, None) for node, queue in nodes] + [
            ("exchange", self.start_exchange, self.read)]

    def _beside(self, queue: Callable[[], None]) -> Callable[[], object]:
        def with_exchange():
            exchange = self.start_exchange()
            queue()
            return exchange
        return with_exchange

    def start_exchange(self):
        return self.dispatcher.start_split_exchange(self.routed.counts, self.routed.row_id_map)

    @staticmethod
    def read(exchange) -> None:
        exchange.read()

    def exchange_and_read(self):
        exchange = self.start_exchange()
        self.read(exchange)
        return exchange

    def _dispatch(self, rows, probs):
        return self.dispatcher.dispatch(rows, probs, self.routed.counts, self.exchange,
                                        self.routed.row_id_map)

    def dispatch_forward(self) -> None:
        rows, probs = _leaf(self.routed.rows), _leaf(self.routed.probs)
        recv, recv_probs, _ = self._dispatch(rows, probs)
        self._pending = ((recv, recv_probs), self.grad_recv)

    def combine_forward(self) -> None:
        expert_out, residual = _leaf(self.expert_out), _leaf(self.routed.x_TH)
        hidden = residual + self.dispatcher.combine(expert_out, self.meta,
                                                    self.routed.row_id_map)
        self._pending = ((hidden,), (self.grad_hidden,))

    def backward(self) -> None:
        outputs, grads = self._pending
        self._pending = None
        torch.autograd.backward(outputs, grads)


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A node's input as the executor hands it over (`schedule.node_run.as_node_leaf`)."""
    return tensor.detach().requires_grad_(True)


# ---------------------------------------------------------------------------- timing
def node_ms(queue: Callable[[], object], finish: Optional[Callable], cuda: bool,
            flag: torch.Tensor) -> tuple[float, bool]:
    """One timed node, every rank started together (module docstring): (ms, host_late)."""
    if not cuda:
        dist.barrier()
        start = time.perf_counter()
        pending = queue()
        if finish is not None:
            finish(pending)
        return (time.perf_counter() - start) * 1e3, False
    torch.cuda._sleep(LAUNCH_AHEAD_CYCLES)
    dist.all_reduce(flag)  # after the sleep: the ranks' streams leave it together
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    pending = queue()
    host_late = start.query()  # the device reached the node before the host had queued it
    if finish is not None:
        finish(pending)  # a host read: the stream waits for what it read
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host_late


def node_samples(bench: NodeBench, args, cuda: bool, flag: torch.Tensor) -> dict:
    """node -> (every rank's times (ms) [rank][iteration], every rank's host-late samples)
    after --warmup untimed rounds."""
    mine: dict[str, list[float]] = {node: [] for node in NODES}
    late = dict.fromkeys(NODES, 0)
    for iteration in range(args.warmup + args.iters):
        for node, queue, finish in bench.calls():
            ms, host_late = node_ms(queue, finish, cuda, flag)
            if iteration >= args.warmup:
                mine[node].append(ms)
                late[node] += host_late
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, late))
    return {node: ([rank[0][node] for rank in gathered], sum(rank[1][node] for rank in gathered))
            for node in NODES}


def node_bytes(bench: NodeBench, peers: list[Peers], device) -> dict[str, Sent]:
    """node -> what a rank sent in it, mean over the ranks (its own all-to-alls: no exchange
    beside it)."""
    per_node = {}
    for node, queue, finish in bench.calls(beside=False):
        _clear(peers)
        pending = queue()
        if finish is not None:
            finish(pending)
        per_node[node] = sent_in(peers, bench.routed.x_TH.shape[1])
    _clear(peers)
    sums = torch.tensor([dataclasses.astuple(per_node[node]) for node in NODES],
                        dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    sums /= dist.get_world_size()
    return {node: Sent(*row) for node, row in zip(NODES, sums.tolist())}


def time_dispatch(groups, bench: NodeBench, peers: list[Peers], args, peak_gbps) -> dict:
    """The `timing` record of one dispatch: per node, the slowest rank's time per iteration,
    their median, the bytes per rank and GB/s per GPU."""
    cuda = groups.device.type == "cuda"
    flag = torch.zeros(1, device=groups.device)
    sent = node_bytes(bench, peers, groups.device)
    samples = node_samples(bench, args, cuda, flag)
    nodes = {}
    for node in NODES:
        times, host_late = samples[node]
        slowest_us = [max(column) * 1e3 for column in zip(*times)]
        median_us = statistics.median(slowest_us)
        gbps = sent[node].between_hosts / (median_us * 1e3)
        nodes[node] = {"median_us": median_us, "samples_us": slowest_us,
                       "host_late_samples": host_late,
                       "bytes_to_peers": sent[node].to_peers,
                       "bytes_between_hosts": sent[node].between_hosts,
                       "gbps_per_gpu": sent[node].to_peers / (median_us * 1e3),
                       "gbps_between_hosts": gbps,
                       "of_peak_between_hosts": gbps / peak_gbps if peak_gbps else None}
    return {"nodes": nodes}


# ---------------------------------------------------------------------------- cases
def measure(groups, args, experts: int, topk: int, peak_gbps: Optional[float]) -> dict:
    """This case's rows and bytes between hosts per dispatch, summed over the ranks; with
    --time each dispatch's node timing (`time_dispatch`)."""
    cfg = parse_config(["--num-experts", str(experts), "--moe-router-topk", str(topk),
                        "--hidden-size", str(args.hidden), "--moe-router-force-load-balancing"])
    device, ops = groups.device, make_moe_ops("triton" if groups.device.type == "cuda"
                                              else "torch")
    dtype = hidden_dtype(device)
    router = Router(cfg.moe, args.hidden, 0, ops, seed=11, std=0.02, dtype=dtype,
                    device=device, aux_loss_scale=1.0, mode=DispatchMode.of(cfg.moe),
                    data_rank=groups.rank)
    x_TH = torch.randn(args.tokens, args.hidden, dtype=dtype, device=device)
    result = {}
    for name, changes in DISPATCHES.items():
        mode = dataclasses.replace(DispatchMode.of(cfg.moe), **changes)
        comm, peers = _comms(groups, args.hosts)
        dispatcher = make_dispatcher(comm, experts, topk, ops, device, mode)
        routed = route(router, dispatcher, x_TH)
        result[name] = counted(groups, args, dispatch_bytes(dispatcher, routed, peers),
                               A2aShape(args.tokens, topk, args.hidden, experts, dtype.itemsize,
                                        groups.ep_size, hosts=args.hosts,
                                        **changes_for_shape(changes)))
        if args.time:
            bench = NodeBench(dispatcher, routed, args.exchange_beside)
            result[name]["timing"] = time_dispatch(groups, bench, peers, args, peak_gbps)
    return result


def counted(groups, args, sent: Sent, shape: A2aShape) -> dict:
    """One dispatch's rows and bytes between hosts summed over the ranks, and predicted."""
    total = torch.tensor([sent.rows_between_hosts, sent.between_hosts], dtype=torch.float64,
                         device=groups.device)
    dist.all_reduce(total)
    return {"rows": total[0].item(), "bytes": total[1].item(),
            "predicted_rows": shape.rows_between_hosts * groups.ep_size,
            "predicted_bytes": shape.bytes_between_hosts * groups.ep_size}


def hidden_dtype(device: torch.device) -> torch.dtype:
    """The hidden rows' dtype: bf16 on CUDA (the training runs --bf16), fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def changes_for_shape(changes: dict) -> dict:
    return {"once_per_rank": changes["once_per_rank"],
            "by_host": changes.get("hierarchy") == "node"}


# ---------------------------------------------------------------------------- report
def table(cases: dict) -> str:
    lines = ["| experts:topk | dispatch | rows between hosts | predicted | bytes | predicted | "
             "bytes / per expert | predicted |", "|" + " --- |" * 8]
    for case, per_dispatch in cases.items():
        flat = per_dispatch["per_expert"]
        for name, got in per_dispatch.items():
            lines.append(f"| {case} | {name} | {got['rows']:,.0f} | {got['predicted_rows']:,.0f} | "
                         f"{got['bytes'] / 2**20:,.1f} MiB | {got['predicted_bytes'] / 2**20:,.1f}"
                         f" MiB | {got['bytes'] / flat['bytes']:.3f} | "
                         f"{got['predicted_bytes'] / flat['predicted_bytes']:.3f} |")
    return "\n".join(lines)


def timing_table(cases: dict) -> str:
    """Per case, dispatch and node: median ms, MiB and GB/s per GPU to other ranks and to
    other hosts, and the latter's share of the link's peak (with --links)."""
    lines = ["| experts:topk | dispatch | node | median ms | MiB to peers | GB/s per GPU | "
             "MiB between hosts | GB/s between hosts | of peak |", "|" + " --- |" * 9]
    for case, per_dispatch in cases.items():
        for name, got in per_dispatch.items():
            for node, t in got.get("timing", {}).get("nodes", {}).items():
                peak = t["of_peak_between_hosts"]
                lines.append(
                    f"| {case} | {name} | {node} | {t['median_us'] / 1e3:.3f} | "
                    f"{t['bytes_to_peers'] / 2**20:,.2f} | {t['gbps_per_gpu']:.2f} | "
                    f"{t['bytes_between_hosts'] / 2**20:,.2f} | {t['gbps_between_hosts']:.2f} | "
                    f"{'-' if peak is None else f'{peak:.2f}'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- command line
def link_peak(path: Optional[str]) -> Optional[float]:
    """The between-hosts link's peak GB/s per direction from bench_a2a_links' JSON."""
    if path is None:
        return None
    try:
        return float(json.loads(Path(path).read_text())["peaks"]["inter"]["gbps"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"bench_host_bytes: --links {path}: no between-hosts peak "
                         f"(peaks.inter.gbps of bench_a2a_links' JSON): {error}") from None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--cases", default="64:8,32:4", help="experts:topk, comma separated")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", default=None, help="JSON record (rank 0)")
    parser.add_argument("--time", action="store_true",
                        help="time each comm node of each dispatch (module docstring)")
    parser.add_argument("--iters", type=int, default=10, help="--time: timed iterations")
    parser.add_argument("--warmup", type=int, default=3, help="--time: untimed iterations first")
    parser.add_argument("--links", help="--time: bench_a2a_links' JSON, for the link's peak")
    parser.add_argument("--exchange-beside", action="store_true",
                        help="--time: each all-to-all node with a split-size exchange started "
                             "beside it (NodeBench.calls)")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.hosts < 2 or world % args.hosts:
        parser.error(f"--hosts {args.hosts} must be >= 2 and divide the {world} ranks")
    if args.iters < 1 or args.warmup < 0:
        parser.error(f"--iters {args.iters} must be >= 1, --warmup {args.warmup} >= 0")
    if args.exchange_beside and not args.time:
        parser.error("--exchange-beside times the nodes: it needs --time")
    return args


def emulate_hosts(hosts: int) -> Optional[str]:
    """Every rank on this machine: this rank's emulated host's NCCL identity, set before the
    first communicator (NCCL reads it once). Ranks of several machines keep their own."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) != world:
        return os.environ.get("NCCL_HOSTID")
    os.environ["NCCL_HOSTID"] = emulated_host_id(int(os.environ.get("LOCAL_RANK", "0")), world,
                                                 hosts)
    return os.environ["NCCL_HOSTID"]


def record_of(args, groups, world: int, cases: dict, host_ids: list,
              peak: Optional[float]) -> dict:
    record = {"world": world, "hosts": args.hosts, "tokens_per_rank": args.tokens,
              "hidden": args.hidden, "device": groups.device.type,
              "dtype": str(hidden_dtype(groups.device)).removeprefix("torch."),
              "probs_bytes": PROBS_BYTES, "torch": torch.__version__,
              "nccl_hostid_per_rank": host_ids, "cases": cases}
    if args.time:
        record["timing"] = {"iters": args.iters, "warmup": args.warmup,
                            "clock": "cuda_event" if groups.device.type == "cuda" else "host",
                            "method": "launch_ahead" if groups.device.type == "cuda" else
                            "barrier", "links": args.links,
                            "exchange_beside": args.exchange_beside,
                            "peak_between_hosts_gbps": peak}
    return record


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    peak = link_peak(args.links)
    host_id = emulate_hosts(args.hosts)
    kind = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    groups = init_distributed(world, kind, timeout_minutes=5, ep_per_host=world // args.hosts)
    try:
        cases = {case: measure(groups, args, *map(int, case.split(":")), peak)
                 for case in args.cases.split(",")}
        host_ids: list = [None] * world
        dist.all_gather_object(host_ids, host_id)
        if groups.is_first():
            record = record_of(args, groups, world, cases, host_ids, peak)
            if args.out:
                with open(args.out, "w") as out:
                    json.dump(record, out, indent=1)
            print(table(cases))
            if args.time:
                print("\n" + timing_table(cases))
    finally:
        destroy_distributed(groups)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
