"""The expert-parallel all-to-all through a shared host buffer, its bytes moved by copy engines
(`--moe-a2a-transport host_memory`): no SM kernel, so it holds no SM the experts' GEMMs need.

Owns `SharedRegion` (one POSIX shared-memory file per EP group, mapped by every rank of it and,
on CUDA, registered with the driver in each), `HostSlots` (the data slots in the region),
`CopyEngineTransport` (one rank's side of the exchange, its data slots where a placement puts
them), `open_region` / `open_host_transport` (made collectively over the EP group) and
`exchange_together` (several ranks of one process issued from one thread: the one-GPU
benchmark).

Placement: the flags and sizes are always in the region (host-mapped, so every process's
stream memory operations reach them); the data slots are the placement's. `HostSlots`: in the
region, filled device-to-host and drained host-to-device. `peer_memory.PeerSlots`
(`--moe-a2a-transport peer_memory`): each rank's receive slots in its own device memory,
filled by the senders' peer copies and drained device-to-device; everything below holds for
both.

Layout of the region, R ranks, S slots of C bytes per (source, destination) pair:

    flags [R][R][S] uint32   the slot's state: 0 empty, 1 full (the source fills an empty
                             slot and sets 1; the destination empties a full one and sets 0)
    sizes [R][R][S][2]       the chunk's bytes and its message's bytes (CPU: checked)
    data  [R][R][S][C]       the slots

Protocol. Chunk i of an exchange's message from s to d goes into slot i % S of the pair. The
source waits until the slot is empty (`flag == 0`), copies the chunk in, then sets it full (1);
the destination waits until it is full, copies the chunk out, then sets it empty (0). Each slot
is a one-place buffer of one writer and one reader that take turns, so its k-th fill is its
k-th emptying: both sides take the same chunk from it as long as they issue the same
exchanges in the same order with the same split sizes (the dispatch exchanged them over the
process group, or they follow from shapes: control stays there, only the data goes through
here). Every rank sends its chunks in rounds: round i puts chunk i to each peer (this rank
first, then the next ranks), then takes chunk i from each; a put waits only for a take of an
earlier round or exchange, so no rank can block the others' progress (the round argument, by
induction on the exchanges and their rounds).

Replay-invariant: an exchange leaves every slot it used empty, and its operations (slots,
values waited for and written, copies) depend only on its tensors and split sizes, never on
how many exchanges came before. So the same enqueued operations are right every time they
run: a CUDA graph that captured exchanges replays them (`--cuda-graph-impl full_iteration`,
graphs of `moe` or whole layers), eager exchanges between replays included. The split sizes
are then fixed at capture, which the sync-free dispatches give (the budget's equal blocks,
padded capacity: validation refuses graphs over the dispatches that read their sizes on the
host).

On CUDA nothing waits on the host: each rank has a send stream (device-to-host copies,
`cuMemcpyDtoHAsync`) and a receive stream (host-to-device), forked from and joined back into
the caller's stream; the waits and flag writes are stream memory operations
(`cuStreamWaitValue32` EQ / `cuStreamWriteValue32`, through ctypes to libcuda: torch has no
wait, and its write is private to symmetric memory) on the region's device mapping, and all
of them can be captured. A flag write follows its copy on the stream and, by default, a memory
fence, so a peer that sees the flag sees the bytes. The two directions run on the two copy
engines side by side, and the slots pipeline the chunks. On CPU (gloo ranks, the tests) the
same protocol runs with plain copies and the host polling the flags (x86 store order: a flag
written after the data is seen after it).

Liveness: an exchange is tracked by the run's `CollectiveWatch` as the EP group's collective,
so a dead or stopped peer is named within the timeout like any other; on CPU a wait past the
timeout also raises itself ("timed out ...", which the watch turns into its one line). A
captured exchange is watched at each replay (the caller wraps the replay in the EP group's
`watched`), as a captured NCCL all-to-all is.

Not yet: ranks on more than one host (the region is one host's memory).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from epoverlap.errors import ConfigError
from epoverlap.parallel.cuda_driver import driver

FLAG = "--moe-a2a-transport"
FLAG_BYTES = 4
PAGE = 4096
DEFAULT_SLOTS = 2
EMPTY, FULL = 0, 1  # a slot's flag
_SPIN_FAST = 200  # flag polls before the CPU wait starts sleeping
_WORD = 1 << 32  # a size word holds a message's bytes modulo this (CPU check)


@dataclass(frozen=True)
class Layout:
    """Offsets in the region of R ranks, S slots per pair, C bytes per slot."""

    ranks: int
    slots: int
    chunk_bytes: int

    @property
    def pair_slots(self) -> int:
        return self.ranks * self.ranks * self.slots

    @property
    def flags_at(self) -> int:
        return 0

    @property
    def sizes_at(self) -> int:
        return self.pair_slots * FLAG_BYTES

    @property
    def data_at(self) -> int:
        return _round_up(3 * self.pair_slots * FLAG_BYTES, PAGE)

    @property
    def total_bytes(self) -> int:
        return self.data_at + self.pair_slots * self.chunk_bytes

    def slot(self, source: int, dest: int, chunk: int) -> int:
        """Index of the slot chunk `chunk` of an exchange's message from source to dest uses."""
        return (source * self.ranks + dest) * self.slots + chunk % self.slots

    def data_offset(self, slot: int) -> int:
        return self.data_at + slot * self.chunk_bytes

    def flag_word(self, slot: int) -> int:
        """Index, in 32-bit words of the region, of the slot's empty/full flag."""
        return self.flags_at // FLAG_BYTES + slot

    def sizes_word(self, slot: int) -> int:
        """Index, in 32-bit words, of the slot's two size words (chunk, message)."""
        return self.sizes_at // FLAG_BYTES + 2 * slot

    # where a rank's receive slots lie in memory of its own (`peer_memory.PeerSlots`)
    @property
    def receive_bytes(self) -> int:
        """One rank's receive slots: R sources x S slots of C bytes."""
        return self.ranks * self.slots * self.chunk_bytes

    def dest_of(self, slot: int) -> int:
        return slot // self.slots % self.ranks

    def receive_offset(self, slot: int) -> int:
        """Where the slot lies among its destination's receive slots."""
        source = slot // (self.ranks * self.slots)
        return (source * self.slots + slot % self.slots) * self.chunk_bytes


def _reserve(fd: int, path: str, size: int) -> None:
    """Give the file its pages now: a /dev/shm too small for it fails here in one line, not
    with a SIGBUS at the first copy into a page the file system could not supply."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        os.unlink(path)
        folder = os.path.dirname(path)
        free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
        raise ConfigError(FLAG, "host_memory",
                          f"its buffer needs {_size_text(size)} in {folder}, which has "
                          f"{_size_text(free)} free ({error.strerror}): lower "
                          "--moe-a2a-host-slot-kib (ranks^2 x 2 slots) or enlarge it") from None


def _size_text(size: int) -> str:
    return f"{size / 2**20:.0f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


class SharedRegion:
    """A file in /dev/shm mapped into this process: `words` (uint32 flags and sizes) and
    `data` (a uint8 tensor over all of it); on CUDA, `register()` pins it and maps it for the
    device (`device_address`)."""

    def __init__(self, path: str, size: int, create: bool):
        size = _round_up(size, PAGE)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                _reserve(fd, path, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = path, size
        self.words = memoryview(self._map).cast("I")
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.device_address: Optional[int] = None

    def register(self, device: torch.device) -> None:
        """Pin the region for copy engines and map it for stream memory operations (once)."""
        if self.device_address is None:
            driver().use_device(_index(device))
            self.device_address = driver().register(self.address, self.size)
            # a region dropped without close() must still unpin its pages before they are
            # unmapped: a later mapping at the same address could not be pinned (CUDA 712)
            self._unpin = weakref.finalize(self, _unpin, self.address)
            self._unpin.atexit = False

    def unlink(self) -> None:
        """Remove the file (the mappings stay): after every rank mapped it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.device_address is not None:
            self._unpin()
            self.device_address = None
        self.words.release()
        self.data = None
        try:
            self._map.close()
        except BufferError:  # a tensor view still alive elsewhere: the mapping goes with it
            pass


class HostSlots:
    """Where the data slots lie: here in the region after the flags and sizes (host_memory).
    A transport's placement: the region's bytes it needs (`region_bytes`), a slot's address
    and, on CPU, its bytes (`bytes`), the copies into (`put`) and out of (`take`) a slot
    as a stream issues them, and `close`; `peer_memory.PeerSlots` is the other one."""

    kind, medium = "host_memory", "host memory"
    one_host = "its all-to-all goes through one host's memory"

    def __init__(self, region: SharedRegion, layout: Layout):
        self.region, self.layout = region, layout

    @staticmethod
    def region_bytes(layout: Layout) -> int:
        return layout.total_bytes

    def address(self, slot: int) -> int:
        return self.region.address + self.layout.data_offset(slot)

    def bytes(self, slot: int, size: int) -> torch.Tensor:
        start = self.layout.data_offset(slot)
        return self.region.data[start:start + size]

    def put(self, cuda, slot: int, source: int, size: int, stream: int) -> None:
        cuda.copy_to_host(self.address(slot), source, size, stream)

    def take(self, cuda, slot: int, dest: int, size: int, stream: int) -> None:
        cuda.copy_to_device(dest, self.address(slot), size, stream)

    def close(self) -> None:
        pass  # the region is the transport's


class CopyEngineTransport:
    """One rank's side of the all-to-all through a `SharedRegion` (module docstring), its data
    slots where `placement` puts them (`HostSlots`, the default: in the region).

    `all_to_all(output, input, output_splits, input_splits)`: rows input_splits[r] of the
    contiguous `input` go to rank r, rows output_splits[r] of `output` come from rank r (None:
    equal splits). On CUDA it syncs no host and orders the caller's stream after it; on CPU it
    returns when done. `timeout_s` bounds a CPU wait."""

    def __init__(self, region: SharedRegion, rank: int, ranks: int, chunk_bytes: int,
                 slots: int = DEFAULT_SLOTS, device: Optional[torch.device] = None,
                 timeout_s: float = 600.0, peer_names: Optional[Sequence[int]] = None,
                 placement=None):
        self.layout = Layout(ranks, slots, chunk_bytes)
        self.placement = placement if placement is not None else HostSlots(region, self.layout)
        needed = self.placement.region_bytes(self.layout)
        if region.size < needed:
            raise ValueError(f"shared region of {region.size} bytes, {needed} needed for "
                             f"{ranks} ranks x {slots} slots of {chunk_bytes}")
        self.region, self.rank, self.ranks = region, rank, ranks
        self.medium = self.placement.medium
        self.device = device if device is not None else torch.device("cpu")
        self.timeout_s = timeout_s
        self.peer_names = list(peer_names) if peer_names is not None else list(range(ranks))
        self._lock = threading.Lock()
        self._streams: Optional[tuple] = None
        if self.device.type == "cuda":
            if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
                raise ConfigError(FLAG, self.placement.kind, "with CUDA_DEVICE_MAX_CONNECTIONS"
                                  "=1 its flag waits share the compute's hardware queue, where a "
                                  "wait for a peer holds back the work the peer waits for: unset "
                                  "it or set it >= 4")
            region.register(self.device)

    def close(self) -> None:
        """Release the data slots (`placement`), then unmap the region."""
        self.placement.close()
        self.region.close()

    # ------------------------------------------------------------------ the exchange
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Optional[list[int]] = None,
                   input_splits: Optional[list[int]] = None) -> None:
        with self._lock:
            exchange = self._begin(output, input, output_splits, input_splits)
            for _ in self._phases(exchange):
                pass
            self._end(exchange)

    def _begin(self, output: torch.Tensor, input: torch.Tensor,
               output_splits: Optional[list[int]], input_splits: Optional[list[int]]
               ) -> "_Exchange":
        """Check the split sizes; on CUDA fork the send and receive streams off the caller's."""
        row_bytes = _row_bytes(input)
        send = self._bytes_per_rank(input_splits, input.shape[0], row_bytes, "input")
        recv = self._bytes_per_rank(output_splits, output.shape[0], row_bytes, "output")
        exchange = _Exchange(output, input, send, recv, _offsets(send), _offsets(recv))
        if self.device.type == "cuda":
            driver().use_device(_index(self.device))
            exchange.streams = self._cuda_streams()
            caller = torch.cuda.current_stream(self.device)
            for stream in exchange.streams:
                stream.wait_stream(caller)
        return exchange

    def _end(self, exchange: "_Exchange") -> None:
        """On CUDA: the caller's stream waits for both streams; the tensors stay allocated
        until they are done with them."""
        if exchange.streams is not None:
            send_stream, recv_stream = exchange.streams
            exchange.input.record_stream(send_stream)
            exchange.output.record_stream(recv_stream)
            caller = torch.cuda.current_stream(self.device)
            caller.wait_stream(send_stream)
            caller.wait_stream(recv_stream)

    def _phases(self, exchange: "_Exchange"):
        """Issue the exchange round by round, yielding after each round's puts and after its
        takes (`exchange_together` interleaves ranks of one process by these phases)."""
        chunk = self.layout.chunk_bytes
        puts = [math.ceil(b / chunk) for b in exchange.send]
        takes = [math.ceil(b / chunk) for b in exchange.recv]
        order = [(self.rank + p) % self.ranks for p in range(self.ranks)]
        for i in range(max(puts + takes)):
            for dest in order:
                if i < puts[dest]:
                    self._put(exchange, dest, i)
            yield
            for source in [(self.rank - p) % self.ranks for p in range(self.ranks)]:
                if i < takes[source]:
                    self._take(exchange, source, i)
            yield

    def _bytes_per_rank(self, splits: Optional[list[int]], rows: int, row_bytes: int,
                        side: str) -> list[int]:
        """Bytes to (from) each rank; bad split sizes fail in one line."""
        if splits is None:
            if rows % self.ranks:
                raise ValueError(f"all-to-all over {self.medium}: {rows} {side} rows do "
                                 f"not split equally over {self.ranks} ranks")
            splits = [rows // self.ranks] * self.ranks
        if len(splits) != self.ranks or min(splits) < 0 or sum(splits) != rows:
            raise ValueError(f"all-to-all over {self.medium}: {side} split sizes "
                             f"{list(splits)} do not cover {rows} rows over {self.ranks} ranks")
        return [count * row_bytes for count in splits]

    # ------------------------------------------------------------------ one chunk
    def _put(self, exchange: "_Exchange", dest: int, i: int) -> None:
        """Chunk i of this exchange to `dest`: wait for its slot to be empty, fill it, flag it
        full."""
        layout = self.layout
        slot = layout.slot(self.rank, dest, i)
        chunk = layout.chunk_bytes
        size = min(chunk, exchange.send[dest] - i * chunk)
        at = exchange.send_at[dest] + i * chunk
        if exchange.streams is not None:
            cuda, flags, stream = driver(), self.region.device_address, \
                exchange.streams[0].cuda_stream
            cuda.wait32(stream, flags + FLAG_BYTES * layout.flag_word(slot), EMPTY)
            self.placement.put(cuda, slot, exchange.input.data_ptr() + at, size, stream)
            cuda.write32(stream, flags + FLAG_BYTES * layout.flag_word(slot), FULL)
        else:
            words = self.region.words
            self._wait(layout.flag_word(slot), EMPTY, dest, "take")
            self.placement.bytes(slot, size).copy_(exchange.input_u8[at:at + size])
            sizes = layout.sizes_word(slot)
            words[sizes], words[sizes + 1] = size, exchange.send[dest] % _WORD
            words[layout.flag_word(slot)] = FULL

    def _take(self, exchange: "_Exchange", source: int, i: int) -> None:
        """Chunk i of this exchange from `source`: wait for its slot to be full, copy it out,
        flag it empty."""
        layout = self.layout
        slot = layout.slot(source, self.rank, i)
        chunk = layout.chunk_bytes
        size = min(chunk, exchange.recv[source] - i * chunk)
        at = exchange.recv_at[source] + i * chunk
        if exchange.streams is not None:
            cuda, flags, stream = driver(), self.region.device_address, \
                exchange.streams[1].cuda_stream
            cuda.wait32(stream, flags + FLAG_BYTES * layout.flag_word(slot), FULL)
            self.placement.take(cuda, slot, exchange.output.data_ptr() + at, size, stream)
            cuda.write32(stream, flags + FLAG_BYTES * layout.flag_word(slot), EMPTY)
        else:
            self._wait(layout.flag_word(slot), FULL, source, "chunk")
            self._check_size(slot, size, exchange.recv[source], source)
            exchange.output_u8[at:at + size].copy_(self.placement.bytes(slot, size))
            self.region.words[layout.flag_word(slot)] = EMPTY

    def _check_size(self, slot: int, size: int, message: int, source: int) -> None:
        """The chunk's and its message's bytes as the source wrote them: what this rank
        expects, else the ranks' split sizes disagree (CPU only: on CUDA no host reads)."""
        words = self.region.words
        sizes = self.layout.sizes_word(slot)
        if (words[sizes], words[sizes + 1]) != (size, message % _WORD):
            raise ValueError(
                f"all-to-all over {self.medium}: rank {self.peer_names[source]} sent "
                f"{words[sizes + 1]} bytes in chunks of {words[sizes]}, rank "
                f"{self.peer_names[self.rank]} expected {message} in chunks of {size} (the "
                "ranks' split sizes disagree)")

    def _wait(self, word: int, state: int, peer: int, what: str) -> None:
        """Poll flag `word` until it is `state`; sleeping once it is slow."""
        words, polls = self.region.words, 0
        deadline = None
        while words[word] != state:
            polls += 1
            if polls < _SPIN_FAST:
                time.sleep(0)
                continue
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now > deadline:
                raise RuntimeError(f"timed out after {self.timeout_s:.0f} s waiting for rank "
                                   f"{self.peer_names[peer]}'s {what} in {self.medium}")
            time.sleep(min(1e-3, 1e-5 * (polls - _SPIN_FAST + 1)))

    def _cuda_streams(self) -> tuple:
        if self._streams is None:
            high = torch.cuda.Stream.priority_range()[1]
            self._streams = (torch.cuda.Stream(self.device, priority=high),
                             torch.cuda.Stream(self.device, priority=high))
        return self._streams


def _unpin(address: int) -> None:
    torch.cuda.synchronize()  # no copy or flag operation may still use the pages
    driver().unregister(address)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _row_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (the same memory)."""
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return tensor.reshape(-1).view(torch.uint8)


def _offsets(sizes: list[int]) -> list[int]:
    at, total = [], 0
    for size in sizes:
        at.append(total)
        total += size
    return at


@dataclass
class _Exchange:
    """One all-to-all in flight: its tensors, bytes to / from each rank and where they start;
    on CUDA the send and receive streams."""

    output: torch.Tensor
    input: torch.Tensor
    send: list[int]
    recv: list[int]
    send_at: list[int]
    recv_at: list[int]
    streams: Optional[tuple] = None

    @property
    def input_u8(self) -> torch.Tensor:
        return _flat_bytes(self.input)

    @property
    def output_u8(self) -> torch.Tensor:
        return _flat_bytes(self.output)


def exchange_together(calls: Sequence[tuple]) -> None:
    """Several ranks' exchanges issued from this one thread (the one-GPU benchmark and tests:
    two ranks sharing a device in one process): `calls` of (transport, output, input,
    output_splits, input_splits), issued phase by phase, every rank's puts of a round before
    any take of it, so even streams that the device serializes (one hardware queue) cannot
    wait on work queued behind them."""
    started = [(t, t._begin(out, inp, out_s, in_s)) for t, out, inp, out_s, in_s in calls]
    phases = [t._phases(exchange) for t, exchange in started]
    while phases:
        phases = [p for p in phases if next(p, StopIteration) is not StopIteration]
    for transport, exchange in started:
        transport._end(exchange)


# ---------------------------------------------------------------------- the group's region
def region_path(tag: str) -> str:
    return f"/dev/shm/epoverlap-a2a-{tag}"


def open_host_transport(group, rank_in_group: int, chunk_bytes: int, device: torch.device,
                        timeout_s: float, slots: int = DEFAULT_SLOTS) -> CopyEngineTransport:
    """Collective over `group` (a `groups.Group`): the region (`open_region`), the data slots
    in it."""
    layout = Layout(group.size, slots, chunk_bytes)
    region = open_region(group, rank_in_group, HostSlots.region_bytes(layout), HostSlots)
    return CopyEngineTransport(region, rank_in_group, group.size, chunk_bytes, slots, device,
                               timeout_s, peer_names=list(group.ranks))


def open_region(group, rank_in_group: int, size: int, placement) -> SharedRegion:
    """Collective over `group`: its first rank makes the region, every rank maps it, then the
    file is removed (the mappings stay; nothing is left behind when a rank dies). Ranks on two
    hosts (`watch.host_label`), or a region the first rank could not make, fail on every rank
    with the same one line (a `ConfigError` naming `placement.kind`)."""
    from epoverlap.parallel.watch import host_label
    ranks = group.size
    seen: list = [None] * ranks
    group.all_gather_object(seen, (uuid.uuid4().hex, host_label()))
    hosts = sorted({host for _, host in seen})
    if len(hosts) > 1:
        raise ConfigError(FLAG, placement.kind,
                          f"the expert-parallel group (ranks {','.join(map(str, group.ranks))}) "
                          f"spans hosts {', '.join(hosts)}; {placement.one_host}: use "
                          "--moe-a2a-transport process_group")
    path, first = region_path(seen[0][0]), rank_in_group == 0
    region, failed = None, None
    if first:
        try:
            region = SharedRegion(path, size, create=True)
        except ConfigError as error:
            failed = error.allowed
    outcome: list = [None] * ranks
    group.all_gather_object(outcome, failed)  # the file exists, or every rank learns why not
    if outcome[0] is not None:
        raise ConfigError(FLAG, placement.kind, outcome[0])
    if region is None:
        region = SharedRegion(path, size, create=False)
    group.barrier()  # every rank mapped it
    if first:
        region.unlink()
    return region
