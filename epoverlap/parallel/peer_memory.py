"""The expert-parallel all-to-all by peer copies between the GPUs of one host, on copy engines
(`--moe-a2a-transport peer_memory`): each rank's receive slots lie in its own device memory,
opened by every other rank of the EP group through CUDA IPC; a sender copies its chunk straight
into the receiver's slot (cuMemcpyDtoDAsync: a peer copy over NVLink between two GPUs, a copy
within the GPU where ranks share one), and the receiver copies it out into its output. One
copy a chunk crosses the link, not two through host memory.

Owns `PeerSlots` (the placement of `host_memory.CopyEngineTransport`'s data slots: everything
else, the flags and sizes in the shared host region, the protocol, the chunking, the size
checks, liveness and graph capture, is that module's, see its docstring), `open_peer_transport`
(made collectively over the EP group) and `peer_slots_together` (ranks of one process: the
one-GPU benchmark and tests).

Rank d's receive slots: R sources x S slots of C bytes (`Layout.receive_offset`), R x S x C
bytes of its device memory (`--moe-a2a-host-slot-kib`); the region holds only the flags and
sizes. Set up once: each rank allocates its slots as a tensor of their own, exports the
allocation holding it (cuIpcGetMemHandle names a whole allocation: the slots' offset in it goes
along) over the group's `all_gather_object`, and opens every peer's (cuIpcOpenMemHandle, peer
access enabled lazily). On CPU (gloo ranks, the tests) the same steps run on plain memory: a
rank's slots are a shared-memory file of its own, its path the handle, mapped by the peers.

Release (`close`, or a `PeerSlots` dropped without it): the device first finishes what it
queued (no copy may still use a mapping), then the peers' mappings are closed
(cuIpcCloseMemHandle) and this rank's slots freed; weakref finalizers, as for the host region's
pinning, so a transport dropped without `close` still releases them. Freeing needs no word
from the peers: every chunk they put into this rank's slots is one this rank took, so once its
own copies are done, theirs are.

Same host only (CUDA IPC): the EP group on two hosts is refused as host_memory refuses it.
"""

from __future__ import annotations

import os
import uuid
import weakref
from typing import Optional

import torch

from epoverlap.errors import ConfigError
from epoverlap.parallel.cuda_driver import driver
from epoverlap.parallel.host_memory import (DEFAULT_SLOTS, FLAG, CopyEngineTransport, Layout,
                                            SharedRegion, open_region, region_path)

# torch allocator settings whose memory cuIpcGetMemHandle cannot export (it takes cuMemAlloc's)
_NOT_EXPORTABLE = {"expandable_segments:true": "expandable segments (cuMemCreate)",
                   "backend:cudamallocasync": "the cudaMallocAsync backend (a memory pool)"}


class PeerSlots:
    """The data slots of `CopyEngineTransport` in the destinations' own memory: `blocks[r]`
    is rank r's receive slots as this process addresses them (its own, or opened)."""

    kind, medium = "peer_memory", "peer memory"
    one_host = "its all-to-all copies between the GPUs of one host (CUDA IPC)"

    def __init__(self, layout: Layout, blocks: list):
        if len(blocks) != layout.ranks:
            raise ValueError(f"{len(blocks)} ranks' receive slots for {layout.ranks} ranks")
        self.layout, self.blocks = layout, blocks

    @staticmethod
    def region_bytes(layout: Layout) -> int:
        return layout.data_at  # the flags and sizes; the slots are elsewhere

    def address(self, slot: int) -> int:
        block = self.blocks[self.layout.dest_of(slot)]
        return block.address + self.layout.receive_offset(slot)

    def bytes(self, slot: int, size: int) -> torch.Tensor:
        start = self.layout.receive_offset(slot)
        return self.blocks[self.layout.dest_of(slot)].data[start:start + size]

    def put(self, cuda, slot: int, source: int, size: int, stream: int) -> None:
        cuda.copy_device(self.address(slot), source, size, stream)

    def take(self, cuda, slot: int, dest: int, size: int, stream: int) -> None:
        cuda.copy_device(dest, self.address(slot), size, stream)

    def close(self) -> None:
        for block in self.blocks:
            block.close()


# ---------------------------------------------------------------------- one rank's slots
def _device_bytes(size: int, device: torch.device) -> torch.Tensor:
    """The slots' memory: a tensor of their own (its allocation is what IPC exports)."""
    return torch.empty(size, dtype=torch.uint8, device=device)


def _settle(device: torch.device) -> None:
    """Wait for the device's queued work: none may still copy into or out of a mapping."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(tensor: torch.Tensor, device: torch.device) -> None:
    _settle(device)
    del tensor  # the finalizer's reference was the last


def _close_ipc(base: int, device: torch.device) -> None:
    _settle(device)
    if device.type == "cuda":  # a finalizer may run on a thread that never used the device
        driver().use_device(_index(device))
    driver().ipc_close(base)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class DeviceSlots:
    """This rank's receive slots in its device memory; `export()` -> the record a peer opens
    (`OpenedSlots`)."""

    data = None  # no host view: CUDA only

    def __init__(self, size: int, device: torch.device):
        tensor = _device_bytes(size, device)
        self.address = tensor.data_ptr()
        self._release = weakref.finalize(self, _free, tensor, device)  # holds the tensor
        self._release.atexit = False

    def export(self) -> tuple:
        cuda = driver()
        base = cuda.allocation_base(self.address)
        return ("ipc", cuda.ipc_export(base), self.address - base)

    def close(self) -> None:
        self._release()


class OpenedSlots:
    """A peer's receive slots opened in this process from its `DeviceSlots.export()`."""

    data = None

    def __init__(self, handle: bytes, offset: int, device: torch.device):
        base = driver().ipc_open(handle)
        self.address = base + offset
        self._release = weakref.finalize(self, _close_ipc, base, device)
        self._release.atexit = False

    def close(self) -> None:
        self._release()


class FileSlots:
    """CPU: a rank's receive slots as a shared-memory file (its own, made with `create`, or a
    peer's, mapped from the path it exported)."""

    def __init__(self, path: str, size: int, create: bool):
        self.region = SharedRegion(path, size, create=create)
        self.address, self.data = self.region.address, self.region.data

    def export(self) -> tuple:
        return ("file", self.region.path, 0)

    def close(self) -> None:
        self.data = None
        self.region.close()


class _Borrowed:
    """Another rank's slots in this process (`peer_slots_together`): that rank closes them."""

    def __init__(self, block):
        self.address, self.data = block.address, block.data

    def close(self) -> None:
        pass


def own_slots(layout: Layout, device: torch.device):
    """This rank's receive slots, exportable."""
    if device.type == "cuda":
        return DeviceSlots(layout.receive_bytes, device)
    path = region_path(f"slots-{uuid.uuid4().hex}")
    return FileSlots(path, layout.receive_bytes, create=True)


def opened_slots(record: tuple, layout: Layout, device: torch.device):
    """A peer's receive slots from its export record."""
    kind, handle, offset = record
    if kind == "ipc":
        return OpenedSlots(handle, offset, device)
    return FileSlots(handle, layout.receive_bytes, create=False)


def gather_slots(own, records: list, rank: int, layout: Layout, device: torch.device) -> list:
    """Every rank's receive slots as this process addresses them: its own, the peers' opened
    from their records (in rank order)."""
    blocks = []
    try:
        for r, record in enumerate(records):
            blocks.append(own if r == rank else opened_slots(record, layout, device))
    except BaseException:
        for block in blocks:
            if block is not own:
                block.close()
        raise
    return blocks


# ---------------------------------------------------------------------- the group's slots
def open_peer_transport(group, rank_in_group: int, chunk_bytes: int, device: torch.device,
                        timeout_s: float, slots: int = DEFAULT_SLOTS) -> CopyEngineTransport:
    """Collective over `group` (a `groups.Group`): the flags' region (`host_memory.open_region`,
    which refuses ranks on two hosts in one line on every rank), then every rank's receive
    slots, exported, exchanged and opened (module docstring)."""
    why = allocator_blocker() if device.type == "cuda" else ""
    if why:  # the same environment on every rank: each refuses before any collective
        raise ConfigError(FLAG, PeerSlots.kind, why)
    ranks = group.size
    layout = Layout(ranks, slots, chunk_bytes)
    region = open_region(group, rank_in_group, PeerSlots.region_bytes(layout), PeerSlots)
    if device.type == "cuda":
        driver().use_device(_index(device))
    own = own_slots(layout, device)
    records: list = [None] * ranks
    group.all_gather_object(records, own.export())
    blocks = gather_slots(own, records, rank_in_group, layout, device)
    group.barrier()  # every rank opened every peer's slots
    if isinstance(own, FileSlots):
        own.region.unlink()
    return CopyEngineTransport(region, rank_in_group, ranks, chunk_bytes, slots, device,
                               timeout_s, peer_names=list(group.ranks),
                               placement=PeerSlots(layout, blocks))


def allocator_blocker(environ=os.environ) -> str:
    """Why torch's CUDA allocator, as the environment sets it, cannot give memory CUDA IPC
    exports ('' when it can)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = environ.get(name, "").replace(" ", "").lower()
        for setting, what in _NOT_EXPORTABLE.items():
            if setting in conf:
                return (f"its slots are exported through CUDA IPC, which cannot export memory "
                        f"of {what} that {name} asks for: leave it out, or use "
                        "--moe-a2a-transport host_memory")
    return ""


def peer_slots_together(layout: Layout, device: Optional[torch.device] = None
                        ) -> list[PeerSlots]:
    """Every rank's `PeerSlots` for ranks of this one process (`host_memory.exchange_together`:
    the one-GPU benchmark and tests): their slots addressed directly, no IPC (a process cannot
    open its own handle); each rank's own slots released by its own `close`."""
    device = device if device is not None else torch.device("cpu")
    owned = [own_slots(layout, device) for _ in range(layout.ranks)]
    for own in owned:
        if isinstance(own, FileSlots):  # no other process maps it
            own.region.unlink()
    return [PeerSlots(layout, [own if r == rank else _Borrowed(own)
                               for r, own in enumerate(owned)])
            for rank in range(layout.ranks)]
