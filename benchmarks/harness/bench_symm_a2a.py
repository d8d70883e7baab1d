"""The MoE dispatch's all-to-all with split sizes on the device (torch symmetric memory's
`torch.ops.symm_mem.all_to_all_vdev`, over NVSHMEM) against NCCL's, on the GPUs of one host.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.harness.bench_symm_a2a \
        [--rows 8192,32768] [--hidden 2048] [--skew 1.0,1.25] [--iters 20] [--warmup 3] \
        --out symm_a2a.json

Each rank routes --rows bf16 rows of --hidden to the ranks (itself included): with skew s,
rank r's next rank ((r + 1) mod n) gets s times the share of each other rank (1.0: balanced;
`route_rows`). Four ways to move them, each timed as the slowest rank's median over --iters:

  nccl_exact    `all_to_all_single` with the exact splits (the dropless dispatch; its host
                read of the split sizes is not timed here)
  nccl_chunks   `all_to_all_single` of equal chunks of the largest split (the budget dispatch's
                fixed blocks: no host read, padding moved)
  symm_vdev     `all_to_all_vdev`: the splits read on the device, the exact rows moved into a
                symmetric buffer sized for the worst case (every rank's rows to one rank)
  symm_graph    the same call replayed from a CUDA graph (`graph`: whether it captured, else
                why not)

GB/s per GPU counts the bytes a rank sends to other ranks (the rows it moves, not the padding:
the chunks' padding is what `nccl_chunks` pays for). The symmetric call's output is checked
against NCCL's exact one (`checked`: received splits and rows equal). NVLink multicast stays off
(`NVSHMEM_DISABLE_NVLS=1`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`: the runner sets them). Rank 0
writes --out (JSON: the environment, every sample of every rank, the medians) and prints a
markdown table. Needs CUDA and NVSHMEM (`symm_mem.is_nvshmem_available()`); refused in one
line otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from benchmarks.harness.bench_a2a_links import environment, gbps, samples, slowest

BF16_BYTES = 2


def number_list(kind):
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(",")]
        if min(values) <= 0:
            raise ValueError(text)
        return values
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=number_list(int), default="8192,32768",
                        help="rows each rank routes per call, comma-separated")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--skew", type=number_list(float), default="1.0,1.25",
                        help="the next rank's share over each other rank's, comma-separated")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="the JSON record (rank 0 writes it)")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.hidden < 1:
        parser.error(f"--iters {args.iters} must be >= 1, --warmup {args.warmup} >= 0, "
                     f"--hidden {args.hidden} >= 1")
    return args


def route_rows(rows: int, skew: float, rank: int, ranks: int) -> list[int]:
    """Rows rank `rank` sends each rank: shares weighted 1, the next rank's `skew`; the
    rounding's remainder to the first rank. They add up to `rows`."""
    weights = [skew if dest == (rank + 1) % ranks else 1.0 for dest in range(ranks)]
    splits = [int(rows * w / sum(weights)) for w in weights]
    splits[0] += rows - sum(splits)
    return splits


def unavailable() -> str:
    """Why this machine cannot run the benchmark ('' when it can)."""
    if not torch.cuda.is_available():
        return "needs CUDA GPUs (NCCL and NVSHMEM)"
    import torch.distributed._symmetric_memory as symm_mem
    if not symm_mem.is_nvshmem_available():
        return "NVSHMEM is not available to this torch (symm_mem.is_nvshmem_available())"
    return ""


def use_nvshmem() -> None:
    """Symmetric memory on NVSHMEM (its `all_to_all_vdev` is NYI on the CUDA backend, torch's
    default): before the first symmetric allocation of the process."""
    import torch.distributed._symmetric_memory as symm_mem
    if hasattr(symm_mem, "set_backend"):  # older torch: TORCH_SYMMMEM=NVSHMEM in the env
        symm_mem.set_backend("NVSHMEM")


class Case:
    """One (rows, skew): the buffers of the four ways, made once."""

    def __init__(self, rows: int, skew: float, hidden: int, device: torch.device, group_name):
        import torch.distributed._symmetric_memory as symm_mem
        rank, ranks = dist.get_rank(), dist.get_world_size()
        self.send = route_rows(rows, skew, rank, ranks)
        self.recv = [route_rows(rows, skew, src, ranks)[rank] for src in range(ranks)]
        self.chunk = max(max(route_rows(rows, skew, r, ranks)) for r in range(ranks))
        self.hidden, self.group_name = hidden, group_name
        self.rows_out = sum(self.recv)
        self.moved_bytes = (rows - self.send[rank]) * hidden * BF16_BYTES
        self.inp = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
        self.out = torch.empty(self.rows_out, hidden, device=device, dtype=torch.bfloat16)
        self.chunk_in = torch.zeros(ranks * self.chunk, hidden, device=device,
                                    dtype=torch.bfloat16)
        self.chunk_out = torch.empty_like(self.chunk_in)
        # symmetric buffers: the same size on every rank, the output for the worst case
        self.symm_in = symm_mem.empty(rows * hidden, dtype=torch.bfloat16, device=device)
        self.symm_out = symm_mem.empty(ranks * rows * hidden, dtype=torch.bfloat16,
                                       device=device)
        # torch's two signatures: (input, out, in_splits, out_splits_offsets [2, n], group) and
        # the older (input, out, in_out_splits [3, n]: in, out, offsets, group)
        # (each its own allocation: the op looks a symmetric tensor up by its start)
        send = torch.tensor(self.send, device=device) * hidden
        if len(torch.ops.symm_mem.all_to_all_vdev.default._schema.arguments) == 5:
            self.splits = (symm_mem.empty(ranks, dtype=torch.int64, device=device),
                           symm_mem.empty((2, ranks), dtype=torch.int64, device=device))
            self.splits[0].copy_(send)
            self.received = self.splits[1][0]  # elements from each rank, after a call
        else:
            self.splits = (symm_mem.empty((3, ranks), dtype=torch.int64, device=device),)
            self.splits[0][0].copy_(send)
            self.received = self.splits[0][1]
        for buffer in (self.symm_in, self.symm_out) + self.splits:
            symm_mem.rendezvous(buffer, group=group_name)
        self.symm_in.copy_(self.inp.reshape(-1))

    def nccl_exact(self) -> None:
        dist.all_to_all_single(self.out, self.inp, self.recv, self.send)

    def nccl_chunks(self) -> None:
        dist.all_to_all_single(self.chunk_out, self.chunk_in)

    def symm_vdev(self) -> None:
        torch.ops.symm_mem.all_to_all_vdev(self.symm_in, self.symm_out, *self.splits,
                                           self.group_name)

    def checked(self) -> bool:
        """The symmetric call's received splits and rows equal NCCL's exact ones."""
        self.nccl_exact()
        self.symm_vdev()
        torch.cuda.synchronize()
        splits = (self.received // self.hidden).tolist()
        rows = self.symm_out[:self.rows_out * self.hidden].view(self.rows_out, self.hidden)
        return splits == self.recv and torch.equal(rows, self.out)


def graph_of(fn):
    """(a CUDA graph replaying `fn`, '') or (None, why it did not capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as error:  # noqa: BLE001  (recorded: whether it captures is a finding)
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return graph, ""


def time_case(case: Case, args, flag: torch.Tensor) -> dict:
    ways = {"nccl_exact": case.nccl_exact, "nccl_chunks": case.nccl_chunks,
            "symm_vdev": case.symm_vdev}
    result = {"send_rows": case.send, "recv_rows": case.recv, "chunk_rows": case.chunk,
              "checked": case.checked()}
    graph, why = graph_of(case.symm_vdev)
    result["graph"] = why or "captured"
    if graph is not None:
        ways["symm_graph"] = graph.replay
    for name, fn in ways.items():
        timed = slowest(samples(fn, args, True, flag))
        timed["gbps_per_gpu"] = gbps(case.moved_bytes, timed["ms"])
        result[name] = timed
    return result


def print_table(record: dict) -> None:
    print(f"\nbench_symm_a2a: {record['ranks']} ranks, {record['environment']['device']}, "
          f"hidden {record['hidden']} bf16, median of {record['iters']} (slowest rank)")
    print("| rows | skew | way | ms | GB/s per GPU | checked | graph |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for case in record["cases"]:
        for way in ("nccl_exact", "nccl_chunks", "symm_vdev", "symm_graph"):
            if way in case:
                print(f"| {case['rows']} | {case['skew']:g} | {way} | {case[way]['ms']:.3f} | "
                      f"{case[way]['gbps_per_gpu']:.1f} | {case['checked']} | {case['graph']} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    why = unavailable()
    if why:
        print(f"bench_symm_a2a: {why}", file=sys.stderr)
        return 2
    import torch.distributed._symmetric_memory as symm_mem
    use_nvshmem()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        group_name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        flag, cases = torch.zeros(1, device=device), []
        for rows in args.rows:
            for skew in args.skew:
                case = Case(rows, skew, args.hidden, device, group_name)
                cases.append({"rows": rows, "skew": skew, **time_case(case, args, flag)})
                del case
        record = {"ranks": dist.get_world_size(), "hidden": args.hidden, "iters": args.iters,
                  "warmup": args.warmup, "environment": environment(True), "cases": cases}
        if dist.get_rank() == 0:
            if args.out:
                with open(args.out, "w") as out:
                    json.dump(record, out, indent=1)
            print_table(record)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
