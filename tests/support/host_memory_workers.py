"""Per-rank bodies of the copy-engine all-to-alls' multi-process tests (--moe-a2a-transport
host_memory and peer_memory, `kind` below): the exchange against gloo's own, training with the
transport against the process group's, on CPU ranks and on two ranks sharing one GPU (control
over gloo)."""

from __future__ import annotations

import dataclasses
import os
import random

import torch

from epoverlap.parallel.comm import ExpertComm
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.parallel.host_memory import open_host_transport, region_path
from epoverlap.parallel.peer_memory import open_peer_transport, peer_slots_together

from gloo_workers import MODES, mode_grads_and_losses

KINDS = ("host_memory", "peer_memory")  # --moe-a2a-transport's copy-engine transports
OPEN = {"host_memory": open_host_transport, "peer_memory": open_peer_transport}
MEDIUM = {"host_memory": "host memory", "peer_memory": "peer memory"}  # in its lines


def transport_flags(kind: str) -> list[str]:
    """The transport in 4 KiB slots (many chunks a message)."""
    return ["--moe-a2a-transport", kind, "--moe-a2a-host-slot-kib", "4"]


def host_modes(kind: str = "host_memory") -> dict:
    """The process group's schedules, and the same over the transport (the `_host` modes)."""
    host = transport_flags(kind)
    return {"sequential": MODES["sequential"], "overlap": MODES["overlap"],
            "sequential_host": MODES["sequential"] + host,
            "overlap_host": MODES["overlap"] + host,
            "overlap_wgrad_host": MODES["overlap_wgrad"] + host,
            # the tuner over the transport: its paths include the process group's (+group)
            "tuned_host": MODES["overlap_wgrad"] + host + [
                "--overlap-plan", "combined_1f1b", "--tune", "on", "--tune-steps", "1"]}


def one_gpu_modes(kind: str = "host_memory") -> dict:
    return {name: flags for name, flags in host_modes(kind).items() if name != "tuned_host"}


HOST = transport_flags("host_memory")
HOST_MODES = host_modes()
ONE_GPU_MODES = one_gpu_modes()


def random_splits(rng: random.Random, ranks: int, most: int) -> list[list[int]]:
    """[source][destination] rows, zeros included (every rank draws the same table)."""
    return [[rng.choice([0, rng.randrange(1, most)]) for _ in range(ranks)]
            for _ in range(ranks)]


def exchange_table(rank: int, ranks: int, exchanges: int, device: torch.device, seed: int = 7):
    """Yield (input, output splits, input splits) of each exchange: bf16 rows whose bits say
    source, exchange and position (so a misplaced row cannot pass)."""
    rng = random.Random(seed)
    for e in range(exchanges):
        table = random_splits(rng, ranks, 300)
        rows = sum(table[rank])
        gen = torch.Generator().manual_seed(1000 * e + rank)
        input_NH = torch.randn(rows, 24, generator=gen).to(torch.bfloat16).to(device)
        yield input_NH, [table[s][rank] for s in range(ranks)], table[rank]


def against_gloo(rank, world_size, device_kind: str, exchanges: int, chunk_bytes: int,
                 kind: str = "host_memory"):
    """Every exchange through the transport and through gloo (host copies): equal bits.
    Returns (exchanges compared, whether the files this rank removes after setup are gone:
    rank 0 the region's, each rank on CPU its peer_memory receive slots')."""
    groups = init_distributed(world_size, "cpu", timeout_minutes=1)
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    transport = OPEN[kind](groups.ep, groups.ep_rank, chunk_bytes, device, 60.0)
    try:
        own = getattr(transport.placement, "blocks", [None] * world_size)[rank]
        files = ([transport.region.path] if rank == 0 else []) + (
            [own.region.path] if hasattr(own, "region") else [])
        gone = not any(os.path.exists(path) for path in files)
        compared = 0
        for input_NH, out_splits, in_splits in exchange_table(rank, world_size, exchanges,
                                                              device):
            output = input_NH.new_empty((sum(out_splits), 24))
            transport.all_to_all(output, input_NH, out_splits, in_splits)
            reference = torch.empty((sum(out_splits), 24), dtype=torch.bfloat16)
            groups.ep.all_to_all_single(reference, input_NH.cpu(), out_splits, in_splits)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            assert torch.equal(output.cpu().view(torch.int16), reference.view(torch.int16)), \
                (rank, compared)
            compared += 1
        return compared, gone
    finally:
        transport.close()
        destroy_distributed(groups)


def captured_against_gloo(rank, world_size, replays: int, chunk_bytes: int,
                          kind: str = "host_memory"):
    """One exchange (splits fixed, several chunks a pair) captured in a CUDA graph on cuda:0
    and replayed `replays` times with new rows copied into its input, an eager exchange of
    other splits after every other replay: each result bit-equal to gloo's all-to-all of the
    same rows. Returns the exchanges compared."""
    groups = init_distributed(world_size, "cpu", timeout_minutes=1)
    device = torch.device("cuda", 0)
    transport = OPEN[kind](groups.ep, groups.ep_rank, chunk_bytes, device, 60.0)

    def check(output, rows, out_splits, in_splits):
        reference = torch.empty((sum(out_splits), 24), dtype=torch.bfloat16)
        groups.ep.all_to_all_single(reference, rows, out_splits, in_splits)
        assert torch.equal(output.cpu().view(torch.int16), reference.view(torch.int16))
    try:
        table = [[200, 150], [120, 260]]  # rows of 48 bytes: 2-4 chunks of 4 KiB a pair
        out_splits = [table[s][rank] for s in range(world_size)]
        in_splits = table[rank]
        static_in = torch.zeros((sum(in_splits), 24), dtype=torch.bfloat16, device=device)
        static_out = torch.zeros((sum(out_splits), 24), dtype=torch.bfloat16, device=device)
        transport.all_to_all(static_out, static_in, out_splits, in_splits)  # streams made
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            transport.all_to_all(static_out, static_in, out_splits, in_splits)
        eager = exchange_table(rank, world_size, replays, device, seed=13)
        compared = 0
        for replay in range(replays):
            gen = torch.Generator().manual_seed(100 * replay + rank)
            rows = torch.randn(sum(in_splits), 24, generator=gen).to(torch.bfloat16)
            static_in.copy_(rows.to(device))
            static_out.fill_(0)
            graph.replay()
            torch.cuda.synchronize(device)
            check(static_out, rows, out_splits, in_splits)
            compared += 1
            input_NH, e_out, e_in = next(eager)
            if replay % 2:
                output = input_NH.new_empty((sum(e_out), 24))
                transport.all_to_all(output, input_NH, e_out, e_in)
                torch.cuda.synchronize(device)
                check(output, input_NH.cpu(), e_out, e_in)
                compared += 1
        del graph
        torch.cuda.synchronize(device)
        return compared
    finally:
        transport.close()
        destroy_distributed(groups)


def expert_comm_against_gloo(rank, world_size, exchanges: int, kind: str = "host_memory"):
    """`ExpertComm` with the transport and its view on the process group (the tuner's `+group`
    path): the same rows either way, and the watch sees the exchange as the EP group's
    collective."""
    groups = init_distributed(world_size, "cpu", timeout_minutes=1)
    transport = OPEN[kind](groups.ep, groups.ep_rank, 4096, groups.device, 60.0)
    comm = ExpertComm(groups.ep, world_size, transport=transport)
    on_group = comm.on_process_group()
    assert comm.copy_engine and not on_group.copy_engine
    seen = []
    begin = groups.watch.begin
    groups.watch.begin = lambda where, peers: seen.append(where) or begin(where, peers)
    try:
        for input_NH, out_splits, in_splits in exchange_table(rank, world_size, exchanges,
                                                              groups.device, seed=11):
            through_host = comm.all_to_all(input_NH, out_splits, in_splits)
            through_gloo = on_group.all_to_all(input_NH, out_splits, in_splits)
            assert torch.equal(through_host.view(torch.int16), through_gloo.view(torch.int16))
        return sorted(set(seen))
    finally:
        comm.close()
        destroy_distributed(groups)


def training_modes(rank, world_size, out_dir, steps, kind: str = "host_memory"):
    """`mode_grads_and_losses` over the process group's schedules and the transport's, with the
    EP all-to-alls counted by what carried them: {"host": .., "group": ..} as `ExpertComm`
    chose, and the exchanges the transport itself carried (must equal "host")."""
    from epoverlap.parallel.host_memory import CopyEngineTransport
    carried, chose = [0], {"host": 0, "group": 0}
    exchange, all_to_all = CopyEngineTransport.all_to_all, ExpertComm.all_to_all

    def counted(self, *args):
        carried[0] += 1
        return exchange(self, *args)

    def chosen(self, *args):
        if self.size > 1:
            chose["host" if self.copy_engine else "group"] += 1
        return all_to_all(self, *args)
    CopyEngineTransport.all_to_all, ExpertComm.all_to_all = counted, chosen  # this process
    results = mode_grads_and_losses(rank, world_size, 2, out_dir, steps,
                                    modes=host_modes(kind))
    return results, carried[0], chose


def training_on_one_gpu(rank, world_size, out_dir, steps, modes=None, kind="host_memory"):
    """Two ranks sharing cuda:0, gloo for control (NCCL refuses two ranks on one GPU): the
    process group's all-to-all there is gloo's, through host copies (the reference), against
    the transport's copy engines; eager, untuned, fp32, deterministic, Triton kernels."""
    import gloo_workers
    from epoverlap.training.setup.environment import make_deterministic
    make_deterministic(on_gpu=True)  # the CLI's --deterministic-mode; Trainer alone does not
    made = init_distributed(world_size, "cpu", timeout_minutes=2)
    on_gpu = dataclasses.replace(made, device=torch.device("cuda", 0), local_rank=0)
    os.environ["LOCAL_RANK"] = "0"  # both ranks on GPU 0
    gpu_flags = ["--device", "cuda", "--tune", "off",
                 "--kernel-backend", "triton"]  # the GPU tier's deterministic backend
    modes = {name: (flags if "--cuda-graph-impl" in flags else
                    flags + ["--cuda-graph-impl", "none"]) + gpu_flags
             for name, flags in (modes or one_gpu_modes(kind)).items()}
    gloo_workers.init_distributed = lambda *args, **kwargs: on_gpu  # this process only
    _all_to_alls_through_host()
    gloo_workers.destroy_distributed = lambda groups: None
    try:
        return gloo_workers.mode_grads_and_losses(rank, world_size, 2, out_dir, steps,
                                                  modes=modes)
    finally:
        destroy_distributed(made)


# the budget dispatch (its counts kept on the device) over the process group and the transport
BUDGET = ["--moe-dispatch-budget", "1.25"]


def budget_modes(kind: str = "host_memory") -> dict:
    return {"sequential": MODES["sequential"] + BUDGET,
            "sequential_host": MODES["sequential"] + BUDGET + transport_flags(kind),
            "overlap_host": MODES["overlap"] + BUDGET + transport_flags(kind)}


BUDGET_MODES = budget_modes()


def budget_training_modes(rank, world_size, out_dir, steps, kind: str = "host_memory"):
    """`mode_grads_and_losses` over `budget_modes(kind)` -> (its results, the integer
    exchanges the transport carried: the budget's counts, which go with the data)."""
    from epoverlap.parallel.host_memory import CopyEngineTransport
    counts = [0]
    exchange = CopyEngineTransport.all_to_all

    def counted(self, output, input, *args):
        counts[0] += not input.is_floating_point()
        return exchange(self, output, input, *args)
    CopyEngineTransport.all_to_all = counted  # this process
    return mode_grads_and_losses(rank, world_size, 2, out_dir, steps,
                                 modes=budget_modes(kind)), counts[0]


# the reference, eager over the process group, then one graph of the iteration over host
# memory, sequential and overlapped: the budget dispatch (2 = EP: it never overflows, so one
# bank), bf16 (a graph holding the grouped GEMMs needs it), the capture after one step
GRAPHED_BUDGET = ["--moe-dispatch-budget", "2", "--bf16", "--cuda-graph-warmup-steps", "1"]
FULL_GRAPH = ["--cuda-graph-impl", "full_iteration"]


def graphed_one_gpu_modes(kind: str = "host_memory") -> dict:
    host = transport_flags(kind)
    return {
        "sequential": MODES["sequential"] + GRAPHED_BUDGET + ["--cuda-graph-impl", "none"],
        "sequential_host_graph": MODES["sequential"] + GRAPHED_BUDGET + host + FULL_GRAPH,
        "overlap_host_graph": MODES["overlap"] + GRAPHED_BUDGET + host + FULL_GRAPH}


GRAPHED_ONE_GPU_MODES = graphed_one_gpu_modes()


def graphed_training_on_one_gpu(rank, world_size, out_dir, steps, kind: str = "host_memory"):
    """`training_on_one_gpu` over `GRAPHED_ONE_GPU_MODES`: the full-iteration graph over host
    memory replays steps 2 onwards; the reference runs eagerly over the process group (gloo,
    whose calls a graph cannot hold). -> (its results, {"captures": .., "replays": ..} of the
    full-iteration graphs in this process)."""
    from epoverlap.graphs.full_iteration import FullIterationGraph
    seen = {"captures": 0, "replays": 0}
    capture, replay = FullIterationGraph.capture, torch.cuda.CUDAGraph.replay

    def counted_capture(self, *args, **kwargs):
        seen["captures"] += 1
        return capture(self, *args, **kwargs)

    def counted_replay(self):
        seen["replays"] += 1
        return replay(self)
    FullIterationGraph.capture = counted_capture  # this process only
    torch.cuda.CUDAGraph.replay = counted_replay
    return training_on_one_gpu(rank, world_size, out_dir, steps,
                               graphed_one_gpu_modes(kind)), seen


def transports_in_one_process(kind: str, ranks: int, chunk_bytes: int, device=None,
                              slots: int = 2, timeout_s: float = 30.0, tag: str = "pair"):
    """Every rank's transport of `kind` in this process on one region (the one-GPU benchmark's
    and the thread tests' form): peer_memory's receive slots addressed directly (no IPC)."""
    from epoverlap.parallel.host_memory import (CopyEngineTransport, HostSlots, Layout,
                                                SharedRegion)
    from epoverlap.parallel.peer_memory import PeerSlots
    layout = Layout(ranks, slots, chunk_bytes)
    placement = PeerSlots if kind == "peer_memory" else HostSlots
    region = SharedRegion(region_path(f"{tag}-{os.getpid()}-{random.getrandbits(48):x}"),
                          placement.region_bytes(layout), create=True)
    region.unlink()
    placements = (peer_slots_together(layout, device) if kind == "peer_memory"
                  else [None] * ranks)
    return [CopyEngineTransport(region, r, ranks, chunk_bytes, slots, device=device,
                                timeout_s=timeout_s, placement=placements[r])
            for r in range(ranks)]


def close_all(transports) -> None:
    """Release every rank's slots, then the region they share."""
    for transport in transports:
        transport.placement.close()
    transports[0].region.close()


def pair_in_one_process(device_kind: str, exchanges: int, chunk_bytes: int,
                        kind: str = "host_memory") -> int:
    """Two ranks' transports on one region in one process, issued from one thread phase by
    phase (`exchange_together`, the benchmark's form): on CUDA their streams order everything,
    nothing waits on the host; on CPU the same order runs with host waits and must not block.
    Against a plain gather of the rows."""
    from epoverlap.parallel.host_memory import exchange_together
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    ranks = transports_in_one_process(kind, 2, chunk_bytes, device)
    compared = 0
    tables = [list(exchange_table(r, 2, exchanges, device, seed=3)) for r in range(2)]
    outputs = [[None] * exchanges for _ in range(2)]
    for e in range(exchanges):  # issued from one thread: on CUDA the streams wait, not the host
        calls = []
        for r in range(2):
            input_NH, out_splits, in_splits = tables[r][e]
            outputs[r][e] = input_NH.new_empty((sum(out_splits), 24))
            calls.append((ranks[r], outputs[r][e], input_NH, out_splits, in_splits))
        exchange_together(calls)
    if device.type == "cuda":
        torch.cuda.synchronize()
    for e in range(exchanges):
        for r in range(2):
            parts = []
            for s in range(2):
                input_NH, _, in_splits = tables[s][e]
                at = sum(in_splits[:r])
                parts.append(input_NH[at:at + in_splits[r]])
            assert torch.equal(outputs[r][e].view(torch.int16), torch.cat(parts).view(torch.int16))
            compared += 1
    close_all(ranks)
    return compared


def setup_refusals(rank, world_size, kind: str = "host_memory"):
    """What each rank raises when the first rank cannot make the region (no room in
    /dev/shm), then when the group spans two hosts: the same one line on every rank."""
    from epoverlap.errors import ConfigError
    from epoverlap.parallel import host_memory, watch
    groups = init_distributed(world_size, "cpu", timeout_minutes=1)
    lines = []
    try:
        def full(fd, offset, size):
            raise OSError(28, "No space left on device")
        host_memory.os.posix_fallocate = full
        try:
            OPEN[kind](groups.ep, groups.ep_rank, 4096, groups.device, 30.0)
        except ConfigError as error:
            lines.append(str(error))
        watch.host_label = lambda: f"node{rank}"
        try:
            OPEN[kind](groups.ep, groups.ep_rank, 4096, groups.device, 30.0)
        except ConfigError as error:
            lines.append(str(error))
        return lines
    finally:
        destroy_distributed(groups)


def _all_to_alls_through_host() -> None:
    """The process group's all-to-alls of CUDA tensors staged through host copies (gloo's
    own all-to-all is documented for CPU tensors): the reference exchange. This process only."""
    from epoverlap.parallel.groups import Group
    plain = Group.all_to_all_single

    def through_host(self, output, input, output_splits=None, input_splits=None):
        if not output.is_cuda:
            return plain(self, output, input, output_splits, input_splits)
        staged = torch.empty(output.shape, dtype=output.dtype)
        plain(self, staged, input.cpu(), output_splits, input_splits)
        output.copy_(staged)
    Group.all_to_all_single = through_host
