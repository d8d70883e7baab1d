"""Bytes the MoE dispatch sends between hosts, measured against the simulator's prediction.

    torchrun --standalone --nproc-per-node 4 -m benchmarks.harness.bench_host_bytes \\
        --hosts 2 [--tokens 4096] [--hidden 2048] [--cases 64:8,32:4] [--out host_bytes.json]

The EP group is the world, split into --hosts hosts of consecutive ranks. For each case
(experts:topk) every rank routes --tokens tokens with the router's benchmark mode
(--moe-router-force-load-balancing: random logits, balanced routing) and runs the forward
dispatch three ways: once per expert (the flat dropless dispatch), once per rank
(--moe-dispatch-once-per-rank) and by host (--moe-dispatch-hierarchy node). The all-to-alls
are recorded (`ExpertComm.trace`); the rows each rank sends to ranks of other hosts, and their
bytes (hidden rows in bf16 on CUDA, fp32 on CPU, plus the fp32 probs each row carries), are
summed over the ranks and set beside the simulator's balanced-routing formula
(`simulator.costs.A2aShape.rows_between_hosts` / `bytes_between_hosts`), which this code does
not use to count. The split-size exchange's few bytes are left out of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist

from epoverlap.config import parse_config
from epoverlap.config.dispatch import DispatchMode
from epoverlap.kernels import make_moe_ops
from epoverlap.model.dispatch_dedup import make_dispatcher
from epoverlap.model.moe import Router
from epoverlap.parallel.comm import ExpertComm, HostComms
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.simulator.costs import PROBS_BYTES, A2aShape

DISPATCHES = {"per_expert": dict(once_per_rank=False), "per_rank": dict(once_per_rank=True),
              "by_host": dict(once_per_rank=True, hierarchy="node")}


def _comms(groups, hosts: int) -> tuple[ExpertComm, ExpertComm]:
    """The EP comm (with the by-host stages) and the between-hosts one, both recording."""
    per_host = groups.ep_size // hosts
    between = ExpertComm(groups.ep_rail, hosts)
    comm = ExpertComm(groups.ep, groups.ep_size, counts_group=groups.ep_splits,
                      by_host=HostComms(between, ExpertComm(groups.ep_host, per_host),
                                        groups.ep_rank))
    comm.trace, between.trace = [], []
    return comm, between


def _sent_between_hosts(trace: list, my_host: int, ranks_per_peer: int) -> tuple[int, int]:
    """(rows, bytes) of the first dispatch's hidden rows and probs to peers of other hosts:
    the trace's first two all-to-alls after the counts (peer p is on host p // ranks_per_peer)."""
    rows, sent = 0, 0
    payload = [entry for entry in trace if entry[2] != ()][:2]  # hidden rows, then probs
    for index, (_, input_splits, row_shape, dtype) in enumerate(payload):
        width = (row_shape[0] if row_shape else 1) * torch.tensor([], dtype=dtype).element_size()
        remote = sum(n for peer, n in enumerate(input_splits)
                     if peer // ranks_per_peer != my_host)
        rows += remote if index == 0 else 0
        sent += remote * width
    return rows, sent


def measure(groups, hosts: int, experts: int, topk: int, tokens: int, hidden: int) -> dict:
    """This case's rows and bytes between hosts per dispatch, summed over the ranks."""
    cfg = parse_config(["--num-experts", str(experts), "--moe-router-topk", str(topk),
                        "--hidden-size", str(hidden), "--moe-router-force-load-balancing"])
    device, ops = groups.device, make_moe_ops("triton" if groups.device.type == "cuda"
                                              else "torch")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    router = Router(cfg.moe, hidden, 0, ops, seed=11 + groups.rank, std=0.02, dtype=dtype,
                    device=device, aux_loss_scale=1.0, mode=DispatchMode.of(cfg.moe))
    x_TH = torch.randn(tokens, hidden, dtype=dtype, device=device)
    per_host, my_host = groups.ep_size // hosts, groups.ep_rank // (groups.ep_size // hosts)
    result = {}
    for name, changes in DISPATCHES.items():
        mode = dataclasses.replace(DispatchMode.of(cfg.moe), **changes)
        comm, between = _comms(groups, hosts)
        dispatcher = make_dispatcher(comm, experts, topk, ops, device, mode)
        with torch.no_grad():
            probs, routing_map, counts = router(x_TH)
            rows, row_probs, row_id_map = dispatcher.preprocess(x_TH, probs, routing_map)
            exchange = dispatcher.start_split_exchange(counts, row_id_map)
            dispatcher.dispatch(rows, row_probs, counts, exchange, row_id_map)
        trace, peers = (between.trace, 1) if mode.by_host else (comm.trace, per_host)
        sent = torch.tensor(_sent_between_hosts(trace, my_host, peers), dtype=torch.float64,
                            device=device)
        dist.all_reduce(sent)
        shape = A2aShape(tokens, topk, hidden, experts, dtype.itemsize, groups.ep_size,
                         hosts=hosts, **changes_for_shape(changes))
        result[name] = {"rows": sent[0].item(), "bytes": sent[1].item(),
                        "predicted_rows": shape.rows_between_hosts * groups.ep_size,
                        "predicted_bytes": shape.bytes_between_hosts * groups.ep_size}
    return result


def changes_for_shape(changes: dict) -> dict:
    return {"once_per_rank": changes["once_per_rank"],
            "by_host": changes.get("hierarchy") == "node"}


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--cases", default="64:8,32:4", help="experts:topk, comma separated")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", default=None, help="JSON record (rank 0)")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.hosts < 2 or world % args.hosts:
        parser.error(f"--hosts {args.hosts} must be >= 2 and divide the {world} ranks")
    kind = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    groups = init_distributed(world, kind, timeout_minutes=5, ep_per_host=world // args.hosts)
    try:
        cases = {case: measure(groups, args.hosts, *map(int, case.split(":")), args.tokens,
                               args.hidden) for case in args.cases.split(",")}
        if groups.is_first():
            record = {"world": world, "hosts": args.hosts, "tokens_per_rank": args.tokens,
                      "hidden": args.hidden, "device": kind, "probs_bytes": PROBS_BYTES,
                      "torch": torch.__version__, "cases": cases}
            if args.out:
                with open(args.out, "w") as out:
                    json.dump(record, out, indent=1)
            print(table(cases))
    finally:
        destroy_distributed(groups)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
