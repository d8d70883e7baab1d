"""The expert-parallel all-to-all on copy engines: through shared host memory
(parallel/host_memory.py, --moe-a2a-transport host_memory) and by peer copies into the
receivers' own memory (parallel/peer_memory.py, peer_memory: the same transport, its data slots
placed elsewhere). A test parametrized by `kind` runs both the same way; on CPU peer_memory's
slots are each rank's shared file, mapped by the peers, where CUDA has device memory and IPC.

Tiers: pure CPU (the protocol with ranks as threads on one region: many exchanges of random
splits through small slots, every slot empty after each, bad split sizes and disagreeing
ranks in one line, a silent peer named by the watch; the CUDA branch's recorded operations
replayed as a graph would, by one thread per stream), gloo (the region made over a real EP
group, every exchange bit-equal to gloo's; training losses and grads bit-equal to the process
group's with the overlap on and off), GPU (`gpu`: two ranks sharing one GPU, control over gloo,
data through the pinned region, against gloo's host copies; the same in one process on two
ranks' streams).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time

import pytest
import torch

from epoverlap.parallel.host_memory import (EMPTY, FULL, CopyEngineTransport, Layout,
                                            SharedRegion, region_path)
from epoverlap.parallel.watch import CollectiveWatch

from dist_helpers import run_ranks
from gpu_runs import needs_gpu
from host_memory_workers import (KINDS, MEDIUM, against_gloo, budget_modes,
                                 budget_training_modes, captured_against_gloo, close_all,
                                 expert_comm_against_gloo, graphed_one_gpu_modes,
                                 graphed_training_on_one_gpu, host_modes, one_gpu_modes,
                                 pair_in_one_process, random_splits, setup_refusals,
                                 training_modes, training_on_one_gpu,
                                 transports_in_one_process)

both = pytest.mark.parametrize("kind", KINDS)


def _ranks_on_one_region(ranks: int, chunk_bytes: int, slots: int = 2, timeout_s: float = 20.0,
                         tag: str = "t", kind: str = "host_memory"):
    transports = transports_in_one_process(kind, ranks, chunk_bytes, slots=slots,
                                           timeout_s=timeout_s, tag=f"test-{tag}")
    return transports[0].region, transports


def _rows(source: int, exchange: int, rows: int) -> torch.Tensor:
    """Rows whose values name their source, exchange and position."""
    base = torch.arange(rows * 5, dtype=torch.float64).reshape(rows, 5)
    return base + 1e6 * source + 1e9 * exchange


def _run_threads(transports, tables, errors=None):
    """Each rank (a thread) runs every exchange of `tables` ([exchange][source][dest] rows)."""
    ranks = len(transports)
    outputs = [[] for _ in range(ranks)]

    def run(r):
        try:
            for e, table in enumerate(tables):
                output = torch.empty(sum(table[s][r] for s in range(ranks)), 5,
                                     dtype=torch.float64)
                transports[r].all_to_all(output, _rows(r, e, sum(table[r])),
                                         [table[s][r] for s in range(ranks)], table[r])
                outputs[r].append(output)
        except Exception as error:  # noqa: BLE001 - handed to the test
            if errors is None:
                raise
            errors.append((r, error))
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outputs


def _expected(table, exchange: int, dest: int) -> torch.Tensor:
    parts = []
    for source, row in enumerate(table):
        at = sum(row[:dest])
        parts.append(_rows(source, exchange, sum(row))[at:at + row[dest]])
    return torch.cat(parts)


@both
@pytest.mark.parametrize("ranks, chunk_bytes, slots", [(2, 64, 2), (3, 40, 2), (4, 256, 3)])
def test_many_exchanges_of_random_splits_arrive_in_place(ranks, chunk_bytes, slots, kind):
    """40 exchanges per rank through slots far smaller than a message (rows of 40 bytes, up
    to 300 rows a pair: up to 300 chunks), zero-row pairs included: every row where the
    plain all-to-all puts it, so slot reuse across chunks and exchanges is safe."""
    import random
    rng = random.Random(ranks)
    tables = [random_splits(rng, ranks, 60) for _ in range(40)]
    region, transports = _ranks_on_one_region(ranks, chunk_bytes, slots, kind=kind)
    outputs = _run_threads(transports, tables)
    for r in range(ranks):
        assert len(outputs[r]) == len(tables)
        for e, table in enumerate(tables):
            assert torch.equal(outputs[r][e], _expected(table, e, r)), (r, e)
    assert _flags(region, transports[0].layout) == [EMPTY] * transports[0].layout.pair_slots
    close_all(transports)


def _flags(region, layout) -> list[int]:
    return list(region.words[layout.flags_at // 4:layout.flags_at // 4 + layout.pair_slots])


@both
def test_every_exchange_leaves_the_slots_as_it_found_them(kind):
    """The state between exchanges is the starting one (every slot empty), so nothing counts
    up over a run (no counter to overflow, however many exchanges) and an exchange's
    operations cannot depend on the ones before: the same splits, an exchange apart, touch the
    same slots in the same order."""
    region, transports = _ranks_on_one_region(2, 64, kind=kind)
    layout = transports[0].layout
    tables = [[[7, 9], [11, 3]], [[1, 0], [2, 5]], [[7, 9], [11, 3]]]
    for e, table in enumerate(tables):
        outputs = _run_threads(transports, [table])
        for r in range(2):
            assert torch.equal(outputs[r][0], _expected(table, 0, r)), (e, r)
        assert _flags(region, layout) == [EMPTY] * layout.pair_slots, e
    close_all(transports)


@both
def test_bad_split_sizes_fail_in_one_line(kind):
    region, transports = _ranks_on_one_region(2, 64, kind=kind)
    transport = transports[0]
    with pytest.raises(ValueError, match=rf"^all-to-all over {MEDIUM[kind]}: input split sizes "
                                         r"\[3, 3\] do not cover 5 rows over 2 ranks$"):
        transport.all_to_all(torch.empty(4, 5), torch.empty(5, 5), [2, 2], [3, 3])
    with pytest.raises(ValueError, match="output split sizes \\[2, -1\\]"):
        transport.all_to_all(torch.empty(1, 5), torch.empty(4, 5), [2, -1], [2, 2])
    close_all(transports)


@both
def test_ranks_whose_split_sizes_disagree_are_named_in_one_line(kind):
    """Rank 1 expects 2 rows from rank 0, which sends 3: rank 1 says so, naming both."""
    region, transports = _ranks_on_one_region(2, 4096, timeout_s=3, kind=kind)
    errors = []

    def rank(r, send, recv):
        try:
            transports[r].all_to_all(torch.empty(sum(recv), 5), torch.zeros(sum(send), 5),
                                     recv, send)
        except Exception as error:  # noqa: BLE001
            errors.append((r, str(error)))
    threads = [threading.Thread(target=rank, args=(0, [1, 3], [1, 1])),
               threading.Thread(target=rank, args=(1, [1, 1], [2, 1]))]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    mine = [text for r, text in errors if r == 1]
    assert mine == [f"all-to-all over {MEDIUM[kind]}: rank 0 sent 60 bytes in chunks of 60, "
                    "rank 1 expected 40 in chunks of 40 (the ranks' split sizes disagree)"], errors
    close_all(transports)


class _Heartbeat:
    """Rank 1's counter never moves; this rank's does."""

    def __init__(self):
        self.counts = [0, 0]

    def beat(self):
        self.counts[0] += 1

    def counters(self):
        return list(self.counts)

    def hosts(self):
        return None


@both
def test_a_silent_peer_is_named_by_the_watch_within_the_timeout(capsys, kind):
    """Rank 1 never takes part: rank 0's exchange waits on its flag, the watch's monitor
    names rank 1 within the timeout (one line, exit status 3), as for any collective."""
    exits = []
    watch = CollectiveWatch(0, 2, 1.6, on_gpu=False, heartbeat=_Heartbeat(),
                            exit_process=exits.append)
    watch.step = 4
    region, (transport, _) = _ranks_on_one_region(2, 64, timeout_s=30, kind=kind)
    watch.start()
    started = time.monotonic()
    done = threading.Event()

    def exchange():
        try:
            with watch.collective("expert-parallel", (0, 1),
                                  f"all_to_all over {MEDIUM[kind]}"):
                transport.all_to_all(torch.empty(4, 5), torch.zeros(4, 5), [2, 2], [2, 2])
        except Exception:  # noqa: BLE001 - never answered: the thread is left behind
            pass
        done.set()
    threading.Thread(target=exchange, daemon=True).start()
    while not exits and time.monotonic() - started < 10:
        time.sleep(0.05)
    watch.close()
    assert exits == [3] and time.monotonic() - started < 5
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "rank 0: step 4: expert-parallel group (ranks 0,1) all_to_all " \
        f"over {MEDIUM[kind]} has waited" in lines[0] and "rank 1 did not answer" in lines[0], \
        lines


@both
def test_a_cpu_wait_past_the_timeout_raises_naming_the_peer(kind):
    region, transports = _ranks_on_one_region(2, 64, timeout_s=0.3, kind=kind)
    with pytest.raises(RuntimeError, match=r"^timed out after 0 s waiting for rank 1's chunk "
                                           rf"in {MEDIUM[kind]}$"):
        transports[0].all_to_all(torch.empty(4, 5), torch.zeros(4, 5), [2, 2], [2, 2])
    close_all(transports)


# ------------------------------------------------------------------------------ gloo
@both
def test_a_real_group_exchanges_like_gloo_and_leaves_no_file(kind):
    results = run_ranks(against_gloo, 2, "cpu", 12, 256, kind, timeout_s=120)
    assert [compared for compared, _ in results] == [12, 12]
    assert all(gone for _, gone in results)


@pytest.mark.parametrize("kind, region_kib, one_host", [
    ("host_memory", 36, "its all-to-all goes through one host's memory"),
    # peer_memory's region: the flags and sizes only (its slots are in device memory)
    ("peer_memory", 4, "its all-to-all copies between the GPUs of one host (CUDA IPC)")])
def test_a_region_that_cannot_be_made_or_shared_is_one_line_on_every_rank(kind, region_kib,
                                                                           one_host):
    """No room in /dev/shm on the first rank, then ranks on two hosts: every rank raises the
    same line (none waits for a region that will not come)."""
    first, second = run_ranks(setup_refusals, 2, kind, timeout_s=120)
    assert first == second and len(first) == 2, (first, second)
    assert first[0].startswith(f"--moe-a2a-transport={kind}: its buffer needs {region_kib} KiB "
                               "in /dev/shm"), first[0]
    assert first[1] == (f"--moe-a2a-transport={kind}: the expert-parallel group (ranks 0,1) "
                        f"spans hosts node0, node1; {one_host}: use --moe-a2a-transport "
                        "process_group")


@both
def test_expert_comm_and_its_view_on_the_process_group_give_the_same_rows_and_are_watched(kind):
    results = run_ranks(expert_comm_against_gloo, 2, 6, kind, timeout_s=120)
    for seen in results:
        assert f"expert-parallel group (ranks 0,1) all_to_all over {MEDIUM[kind]}" in seen, seen
        assert "expert-parallel group (ranks 0,1) all_to_all" in seen, seen


@both
def test_the_budget_dispatch_on_copy_engines_is_bitwise_the_process_groups(tmp_path, kind):
    """The dispatch a graph can hold (--moe-dispatch-budget: equal blocks, the per-expert
    counts kept on the device and sent through the transport too), sequential and overlapped
    through it: the process group's grads, losses and grad norms, every step."""
    from gloo_workers import assert_modes_match_sequential
    per_rank = run_ranks(budget_training_modes, 2, str(tmp_path), 3, kind, timeout_s=300)
    for _, counts in per_rank:  # the counts of every MoE layer's dispatch, every microbatch
        assert counts >= 2 * 4 * 3, counts
    assert_modes_match_sequential([result for result, _ in per_rank], tmp_path, 3,
                                  budget_modes(kind),
                                  differs={"sequential_host": lambda a, b: None})


@pytest.mark.slow
@both
def test_training_on_copy_engines_is_bitwise_the_process_groups(tmp_path, kind):
    """The process group's sequential and overlapped runs, and the same through the transport in
    4 KiB slots (sequential, overlap, overlap with delayed wgrad, and tuned: its paths switch
    between the transport and the process group mid-run): the same reduced grads, losses and
    grad norms, every step."""
    from gloo_workers import assert_modes_match_sequential
    from run_paths import path_parts
    results = run_ranks(training_modes, 2, str(tmp_path), 6, kind, timeout_s=600)
    # a step: 2 layers x 4 microbatches x 6 all-to-alls (the dispatch's rows and
    # probabilities and the combine, forward and backward); an untuned run: 7 steps (a grads
    # step, then 6): 2 on the process group, 3 over host memory, then the tuned run's steps
    per_step, run = 2 * 4 * 6, 7 * 2 * 4 * 6
    with open(tmp_path / "tuned_host.jsonl") as records:
        paths = [json.loads(line)["path"] for line in records]
    assert "combined_1f1b+group" in paths, paths
    assert results[0][1:] == results[1][1:]
    carried, chose = results[0][1:]
    assert carried == chose["host"]  # ExpertComm's choice is what the transport carried
    tuned_group, tuned_host = chose["group"] - 2 * run, chose["host"] - 3 * run
    assert tuned_group >= per_step and tuned_group % per_step == 0, chose
    assert tuned_host >= 5 * per_step and tuned_host % per_step == 0, chose
    results = [per_mode for per_mode, _, _ in results]

    def differs(record, sequential):
        assert f"all-to-all over {MEDIUM[kind]} (4 KiB slots)" in path_parts(record)["levers"]
        assert "all-to-all over" not in path_parts(sequential)["levers"]
    modes = host_modes(kind)
    assert_modes_match_sequential(results, tmp_path, 6, modes,
                                  differs={m: differs for m in modes if "host" in m})


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@needs_gpu
@both
def test_two_ranks_sharing_one_gpu_exchange_like_gloo_host_copies(kind):
    """Two processes on cuda:0, control over gloo, data on copy engines (chunks of 64 KiB):
    device -> pinned shared region -> device (host_memory), or device -> the peer's device
    slots opened through CUDA IPC -> device (peer_memory), ordered by stream memory operations
    on the region's flags: every exchange bit-equal to gloo's all-to-all of the same rows
    copied to the host."""
    results = run_ranks(against_gloo, 2, "cuda", 20, 64 * 1024, kind, timeout_s=300)
    assert [compared for compared, _ in results] == [20, 20]


@pytest.mark.gpu
@needs_gpu
def test_a_region_dropped_without_close_unpins_before_its_pages_are_reused():
    """Regions made, pinned and dropped one after another (as the contention benchmark does per
    load): each drop unpins, so the next mapping, often at the same address, can be pinned."""
    import gc
    for i in range(4):
        region = SharedRegion(region_path(f"drop-{os.getpid()}-{i}"), 4 << 20, create=True)
        region.unlink()
        region.register(torch.device("cuda", 0))
        assert region.device_address
        del region
        gc.collect()


@pytest.mark.gpu
@needs_gpu
@both
def test_two_ranks_streams_in_one_process_need_no_host_wait(kind):
    """Both ranks' exchanges issued from one thread, one after the other: only the streams'
    flag waits order them (a host wait would deadlock), and the rows arrive in place."""
    assert pair_in_one_process("cuda", 10, 16 * 1024, kind) == 20


@pytest.mark.gpu
@needs_gpu
def test_device_slots_export_their_allocation_and_are_freed_when_dropped():
    """peer_memory's own slots: the IPC handle is the whole allocation's (64 bytes) and the
    slots' offset in it goes along; slots dropped without close() are freed all the same
    (the finalizer), so making them again and again does not grow the allocated memory."""
    import gc
    from epoverlap.parallel.cuda_driver import driver
    from epoverlap.parallel.peer_memory import DeviceSlots
    device = torch.device("cuda", 0)
    driver().use_device(0)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    for _ in range(4):
        slots = DeviceSlots(3 << 20, device)
        kind, handle, offset = slots.export()
        assert kind == "ipc" and len(handle) == 64 and 0 <= offset
        assert driver().allocation_base(slots.address) == slots.address - offset
        assert torch.cuda.memory_allocated(device) >= before + (3 << 20)
        del slots
        gc.collect()
        assert torch.cuda.memory_allocated(device) == before


@pytest.mark.gpu
@needs_gpu
@both
def test_training_on_one_shared_gpu_is_bitwise_the_reference_exchange(tmp_path, kind):
    """Two ranks sharing cuda:0 (gloo for control): the process group's all-to-all there is
    gloo's through host copies, the reference; on copy engines (host_memory, peer_memory),
    sequential and overlapped: the same grads, losses and grad norms."""
    from gloo_workers import assert_modes_match_sequential
    results = run_ranks(training_on_one_gpu, 2, str(tmp_path), 6, None, kind, timeout_s=600)
    modes = one_gpu_modes(kind)
    assert_modes_match_sequential(results, tmp_path, 6, modes,
                                  differs={m: lambda a, b: None for m in modes})


@pytest.mark.gpu
@needs_gpu
@both
def test_two_ranks_sharing_one_gpu_replay_a_captured_exchange_like_gloo(kind):
    """Two processes on cuda:0 each capture one exchange (4 KiB slots: several chunks a pair,
    each slot used more than once) in a CUDA graph and replay it 8 times with new rows, eager
    exchanges between replays: every result bit-equal to gloo's all-to-all of the same rows."""
    results = run_ranks(captured_against_gloo, 2, 8, 4096, kind, timeout_s=240)
    assert results == [12, 12]


@pytest.mark.gpu
@needs_gpu
@both
def test_a_full_iteration_graph_on_copy_engines_is_bitwise_the_reference_exchange(tmp_path,
                                                                                   kind):
    """Two ranks sharing cuda:0: the budget dispatch's step captured as one graph
    (--cuda-graph-impl full_iteration, after one warmup step) through the transport, sequential and
    overlapped, replayed steps 2-5: the grads, losses and grad norms of the eager reference
    over the process group (gloo through host copies), every step."""
    from gloo_workers import assert_modes_match_sequential
    per_rank = run_ranks(graphed_training_on_one_gpu, 2, str(tmp_path), 5, kind,
                         timeout_s=300)
    results = [result for result, _ in per_rank]
    for _, seen in per_rank:  # one graph per graphed mode, replayed on most of its steps
        assert seen["captures"] == 2 and seen["replays"] >= 2 * 3, seen

    def graphed(record, sequential):
        from run_paths import path_parts
        assert "full_iteration" in path_parts(record)["graphs"], record
        assert f"all-to-all over {MEDIUM[kind]}" in path_parts(record)["levers"], record
    modes = graphed_one_gpu_modes(kind)
    assert_modes_match_sequential(results, tmp_path, 5, modes,
                                  differs={m: graphed for m in modes})


@both
def test_two_ranks_issued_from_one_thread_phase_by_phase_do_not_block(kind):
    """The issue order of the one-GPU benchmark (`exchange_together`), run on CPU where every
    wait is the host's: a put never waits for a take queued after it (slots of 512 bytes:
    many rounds)."""
    assert pair_in_one_process("cpu", 6, 512, kind) == 12


@pytest.mark.slow
@both
def test_a_stopped_rank_is_named_by_the_other_on_copy_engines(kind):
    """The launcher's 2-rank job through the transport, rank 1 SIGSTOPped mid-step: rank 0, its
    exchange waiting on rank 1's flags (or on the split sizes), names rank 1 within the
    timeout, as over the process group."""
    import signal
    from test_liveness import QUICK_JOB, TIMEOUT_S, _check_named, _signal_mid_step
    job, code, after_s = _signal_mid_step(signal.SIGSTOP, victim=1,
                                          flags=QUICK_JOB + ["--moe-a2a-transport", kind])
    assert after_s is not None and TIMEOUT_S / 2 <= after_s <= TIMEOUT_S + 15, after_s
    line = _check_named(job, code, survivor=0, victim=1, status=3)
    assert "expert-parallel" in line or "world" in line, line


class _HostDriver:
    """libcuda's calls as the CUDA branch issues them, run at once on host memory (the
    region's address is its own device mapping here): a wait that is not yet satisfied when
    issued fails, since in `exchange_together`'s order nothing queued later could satisfy it."""

    def __init__(self):
        self.calls = {"wait32": 0, "write32": 0, "copy_to_host": 0, "copy_to_device": 0,
                      "copy_device": 0}

    def use_device(self, index):
        pass

    def wait32(self, stream, address, value):
        self.calls["wait32"] += 1
        seen = ctypes.c_uint32.from_address(address).value
        assert seen == value, f"a wait for {value} issued where the flag is {seen}"

    def write32(self, stream, address, value):
        self.calls["write32"] += 1
        ctypes.c_uint32.from_address(address).value = value

    def copy_to_host(self, host, device, size, stream):
        self.calls["copy_to_host"] += 1
        ctypes.memmove(host, device, size)

    def copy_to_device(self, device, host, size, stream):
        self.calls["copy_to_device"] += 1
        ctypes.memmove(device, host, size)


class _Stream:
    def __init__(self, handle: int = 0):
        self.cuda_stream = handle


def test_the_cuda_branch_addresses_and_orders_its_chunks_right(monkeypatch):
    """The CUDA branch (flag addresses, wait values, copy offsets) run on the host through a
    driver that executes each call at once, two ranks issued phase by phase from one thread
    (as the one-GPU benchmark does): every row in place, and every wait already satisfied
    when issued (the order a single hardware queue would need)."""
    from epoverlap.parallel import host_memory
    fake = _HostDriver()
    monkeypatch.setattr(host_memory, "driver", lambda: fake)
    region, transports = _ranks_on_one_region(2, 96, slots=2, tag="cudabranch")
    region.device_address = region.address
    chunks, _ = _exchanges_on_the_cuda_branch(monkeypatch, transports)
    assert fake.calls == {"wait32": 2 * chunks, "write32": 2 * chunks,
                          "copy_to_host": chunks, "copy_to_device": chunks, "copy_device": 0}
    assert chunks > 100
    region.device_address = None  # never registered
    close_all(transports)


def _exchanges_on_the_cuda_branch(monkeypatch, transports) -> tuple[int, int]:
    """25 exchanges of random splits (rows of 40 bytes, slots of 96) issued by two ranks'
    transports phase by phase from one thread, each on two stand-in streams (so the CUDA
    branch runs, through whatever driver the test put in place): every row in place.
    -> (chunks, the chunks between two different ranks)."""
    import random
    from epoverlap.parallel import host_memory

    def begin(self, output, input, output_splits, input_splits):
        exchange = original_begin(self, output, input, output_splits, input_splits)
        exchange.streams = (_Stream(), _Stream())
        return exchange
    original_begin = CopyEngineTransport._begin
    monkeypatch.setattr(CopyEngineTransport, "_begin", begin)
    monkeypatch.setattr(CopyEngineTransport, "_end", lambda self, exchange: None)
    rng = random.Random(5)
    chunks = across = 0
    for e in range(25):
        table = random_splits(rng, 2, 30)
        chunks += sum(-(-rows * 40 // 96) for row in table for rows in row)
        across += sum(-(-table[s][1 - s] * 40 // 96) for s in range(2))
        inputs = [_rows(r, e, sum(table[r])) for r in range(2)]
        outputs = [torch.empty(sum(table[s][r] for s in range(2)), 5, dtype=torch.float64)
                   for r in range(2)]
        host_memory.exchange_together([(transports[r], outputs[r], inputs[r],
                                        [table[s][r] for s in range(2)], table[r])
                                       for r in range(2)])
        for r in range(2):
            assert torch.equal(outputs[r], _expected(table, e, r)), (e, r)
    return chunks, across


class _IpcDriver(_HostDriver):
    """`_HostDriver` with CUDA IPC on host memory: a device allocation is a shared-memory file
    mapped once (its owner's address), opening its handle maps the file again at another
    address (the same bytes, as a peer's mapping is), a copy into such a mapping is counted.
    Handles must name an allocation's start and be closed by the address opened."""

    def __init__(self):
        super().__init__()
        self.allocations, self.opened, self.closed = {}, {}, []
        self.into_opened = 0

    def alloc(self, size: int, pad: int) -> torch.Tensor:
        """A tensor `pad` bytes into an allocation of its own (as torch's allocator may hand
        out a piece of a larger one)."""
        path = region_path(f"test-ipc-{os.getpid()}-{len(self.allocations)}")
        owner = SharedRegion(path, pad + size, create=True)
        self.allocations[owner.address] = owner
        return owner.data[pad:pad + size]

    def allocation_base(self, address):
        bases = [base for base, owner in self.allocations.items()
                 if base <= address < base + owner.size]
        assert len(bases) == 1, f"{address:#x} is in no allocation"
        return bases[0]

    def ipc_export(self, base):
        assert base in self.allocations, "a handle is exported for an allocation's start"
        return self.allocations[base].path.encode().ljust(64, b"\0")

    def ipc_open(self, handle):
        assert len(handle) == 64
        path = handle.rstrip(b"\0").decode()
        mapping = SharedRegion(path, os.path.getsize(path), create=False)
        self.opened[mapping.address] = mapping
        return mapping.address

    def ipc_close(self, base):
        assert base in self.opened, "closed by the base address its open returned"
        self.closed.append(base)

    def copy_device(self, dest, source, size, stream):
        self.calls["copy_device"] += 1
        self.into_opened += any(base <= dest < base + mapping.size
                                for base, mapping in self.opened.items())
        ctypes.memmove(dest, source, size)

    def release(self):
        for mapping in list(self.opened.values()) + list(self.allocations.values()):
            mapping.unlink()
            mapping.close()


def test_peer_memory_opens_its_peers_slots_through_ipc_and_copies_into_them(monkeypatch):
    """peer_memory's CUDA branch on the host: each rank's slots 768 bytes into an allocation
    of their own, exported (the allocation's handle and that offset), opened by the other
    rank at an address of its own; the CUDA branch's copies (device to device only) run at
    once: every row in place, every chunk to the other rank copied into the mapping opened
    for it (the owner's address would pass too, in one process, but not across processes),
    and closing closes each opened handle by the base its open returned."""
    from epoverlap.parallel import host_memory, peer_memory
    from epoverlap.parallel.peer_memory import DeviceSlots, PeerSlots, gather_slots
    fake = _IpcDriver()
    monkeypatch.setattr(host_memory, "driver", lambda: fake)
    monkeypatch.setattr(peer_memory, "driver", lambda: fake)
    monkeypatch.setattr(peer_memory, "_device_bytes", lambda size, device: fake.alloc(size, 768))
    layout, cpu = Layout(2, 2, 96), torch.device("cpu")
    region = SharedRegion(region_path(f"test-ipc-flags-{os.getpid()}"),
                          PeerSlots.region_bytes(layout), create=True)
    region.unlink()
    region.device_address = region.address  # the host mapping stands for the device's
    own = [DeviceSlots(layout.receive_bytes, cpu) for _ in range(2)]
    records = [slots.export() for slots in own]
    assert [(kind, offset) for kind, _, offset in records] == [("ipc", 768)] * 2
    placements = [PeerSlots(layout, gather_slots(own[r], records, r, layout, cpu))
                  for r in range(2)]
    assert len(fake.opened) == 2  # each rank opened the other's, none its own
    transports = [CopyEngineTransport(region, r, 2, 96, 2, placement=placements[r])
                  for r in range(2)]
    chunks, across = _exchanges_on_the_cuda_branch(monkeypatch, transports)
    assert fake.calls == {"wait32": 2 * chunks, "write32": 2 * chunks, "copy_to_host": 0,
                          "copy_to_device": 0, "copy_device": 2 * chunks}
    assert fake.into_opened == across and across > 50
    region.device_address = None  # never registered
    close_all(transports)
    assert sorted(fake.closed) == sorted(fake.opened)
    fake.release()


class _Recorder:
    """libcuda's calls as a capture sees them: recorded per stream, run later (a replay) by
    one thread per stream, a wait polling its flag as the stream's wait operation does."""

    def __init__(self):
        self.ops: dict[int, list] = {}

    def use_device(self, index):
        pass

    def wait32(self, stream, address, value):
        def wait():
            deadline = time.monotonic() + 20
            while ctypes.c_uint32.from_address(address).value != value:
                assert time.monotonic() < deadline, f"stream {stream} waits for {value}"
                time.sleep(0)
        self.ops.setdefault(stream, []).append(wait)

    def write32(self, stream, address, value):
        def write():
            ctypes.c_uint32.from_address(address).value = value
        self.ops.setdefault(stream, []).append(write)

    def copy_to_host(self, host, device, size, stream):
        self.ops.setdefault(stream, []).append(lambda: ctypes.memmove(host, device, size))

    def copy_to_device(self, device, host, size, stream):
        self.ops.setdefault(stream, []).append(lambda: ctypes.memmove(device, host, size))

    def copy_device(self, dest, source, size, stream):
        self.ops.setdefault(stream, []).append(lambda: ctypes.memmove(dest, source, size))

    def replay(self):
        """Every stream's operations, each stream a thread (as the graph's branches run)."""
        threads = [threading.Thread(target=lambda ops=ops: [op() for op in ops], daemon=True)
                   for ops in self.ops.values()]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        assert not any(t.is_alive() for t in threads)


@both
def test_recorded_exchanges_replay_right_every_time_with_eager_ones_between(monkeypatch, kind):
    """The CUDA branch's operations for a sequence of three exchanges (random splits through
    slots of 96 bytes, many chunks) recorded once per rank, as a capture would, and run again
    and again as a graph replays them (both ranks' send and receive streams concurrently) with
    new rows in the same input tensors, eager (host-polled) exchanges between replays: every
    replay's rows, and every eager exchange's, equal the plain all-to-all's bit for bit, and
    every slot is empty after each replay (a replay of operations numbered once would copy
    stale slots or wait forever)."""
    import random
    from epoverlap.parallel import host_memory
    recorder = _Recorder()
    monkeypatch.setattr(host_memory, "driver", lambda: recorder)
    region, transports = _ranks_on_one_region(2, 96, slots=2, tag="replay", kind=kind)
    region.device_address = region.address  # the host mapping stands for the device's
    layout = transports[0].layout
    capturing = [False]

    def begin(self, output, input, output_splits, input_splits):
        exchange = original_begin(self, output, input, output_splits, input_splits)
        if capturing[0]:
            exchange.streams = (_Stream(10 * self.rank), _Stream(10 * self.rank + 1))
        return exchange
    original_begin = CopyEngineTransport._begin
    monkeypatch.setattr(CopyEngineTransport, "_begin", begin)
    monkeypatch.setattr(CopyEngineTransport, "_end", lambda self, exchange: None)
    rng = random.Random(9)
    tables = [random_splits(rng, 2, 30) for _ in range(3)]
    inputs = [[_rows(r, 0, sum(table[r])) for table in tables] for r in range(2)]
    outputs = [[torch.empty(sum(table[s][r] for s in range(2)), 5, dtype=torch.float64)
                for table in tables] for r in range(2)]
    capturing[0] = True
    for r in range(2):  # a capture issues, runs nothing: each rank alone, no peer needed
        for e, table in enumerate(tables):
            transports[r].all_to_all(outputs[r][e], inputs[r][e],
                                     [table[s][r] for s in range(2)], table[r])
    capturing[0] = False
    assert _flags(region, layout) == [EMPTY] * layout.pair_slots  # nothing ran yet
    for replay in range(1, 6):
        for r in range(2):
            for e, table in enumerate(tables):
                inputs[r][e].copy_(_rows(r, 10 * replay + e, sum(table[r])))
        recorder.replay()
        eager = _run_threads(transports, [[[replay, 2], [3, replay]]] + tables)
        for r in range(2):
            for e, table in enumerate(tables):
                expected = torch.cat([
                    _rows(s, 10 * replay + e, sum(table[s]))[sum(table[s][:r]):][:table[s][r]]
                    for s in range(2)])
                assert torch.equal(outputs[r][e], expected), (replay, r, e)
                assert torch.equal(eager[r][1 + e], _expected(table, 1 + e, r))
            assert torch.equal(eager[r][0], _expected([[replay, 2], [3, replay]], 0, r))
        assert _flags(region, layout) == [EMPTY] * layout.pair_slots, replay
    assert sum(len(ops) for ops in recorder.ops.values()) > 200
    region.device_address = None  # never registered
    close_all(transports)


def test_a_buffer_larger_than_the_shared_memory_fails_in_one_line(monkeypatch):
    """posix_fallocate refusing the pages (a small /dev/shm, as in a default container) is
    one line naming the flags, and no file is left behind."""
    from epoverlap.parallel import host_memory

    def full(fd, offset, size):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(host_memory.os, "posix_fallocate", full)
    path = region_path("test-full")
    with pytest.raises(ValueError, match=r"^--moe-a2a-transport=host_memory: its buffer needs "
                                         r"64 MiB in /dev/shm, which has \d+ [MK]iB free \(No "
                                         r"space left on device\): lower "
                                         r"--moe-a2a-host-slot-kib"):
        SharedRegion(path, 64 * 2**20, create=True)
    assert not os.path.exists(path)


@pytest.mark.slow
@both
def test_a_killed_rank_is_named_by_the_other_on_copy_engines(kind):
    """The same with rank 0 SIGKILLed: shared memory raises nothing when a peer dies, so a
    survivor waiting on its flags is the monitor's to name (the heartbeat stopped)."""
    import signal
    from test_liveness import QUICK_JOB, TIMEOUT_S, _check_named, _signal_mid_step
    job, code, after_s = _signal_mid_step(signal.SIGKILL, victim=0,
                                          flags=QUICK_JOB + ["--moe-a2a-transport", kind])
    assert after_s is not None and after_s <= TIMEOUT_S + 15, after_s
    _check_named(job, code, survivor=1, victim=0, status=128 + signal.SIGKILL)


def test_peer_memory_refuses_an_allocator_whose_memory_ipc_cannot_export():
    """Expandable segments and the cudaMallocAsync backend allocate memory that
    cuIpcGetMemHandle does not take: one line naming the setting, before any collective."""
    from epoverlap.parallel.peer_memory import allocator_blocker
    assert allocator_blocker({}) == ""
    assert allocator_blocker({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == ""
    line = allocator_blocker({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert line == ("its slots are exported through CUDA IPC, which cannot export memory of "
                    "expandable segments (cuMemCreate) that PYTORCH_ALLOC_CONF asks for: leave "
                    "it out, or use --moe-a2a-transport host_memory")
    assert "cudaMallocAsync" in allocator_blocker(
        {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
