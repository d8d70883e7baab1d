"""The few CUDA driver calls the copy-engine all-to-alls need (`host_memory`, `peer_memory`),
through ctypes: torch exposes no stream memory operations and no CUDA IPC of its own
allocations. Owns `driver()` (libcuda, loaded once per process at the first CUDA use) and
`IPC_HANDLE_BYTES` (the size of a CUipcMemHandle)."""

from __future__ import annotations

import ctypes
import functools
import threading

IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE


class _IpcHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value to cuIpcOpenMemHandle."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Driver:
    """libcuda's calls, every one checked, a failure one line naming the call."""

    WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
    HOST_REGISTER = 0x01 | 0x02  # CU_MEMHOSTREGISTER_PORTABLE | _DEVICEMAP
    IPC_LAZY_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._calls = {}
        self._thread = threading.local()  # the device whose context this thread has current

    def _fn(self, *names: str):
        for name in names:
            if name in self._calls:
                return self._calls[name]
            fn = getattr(self.lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                self._calls[name] = fn
                return fn
        raise RuntimeError(f"libcuda has none of {names}")

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self._fn("cuGetErrorString")(result, ctypes.byref(text))
            raise RuntimeError(f"copy-engine all-to-all: {call} failed with CUDA error "
                               f"{result} ({(text.value or b'?').decode()})")

    def use_device(self, index: int) -> None:
        """Make `index`'s primary context (the one torch's runtime calls use) current on this
        thread, once per thread: a rank whose process group is gloo may not have touched the
        device yet, and autograd runs the backward's all-to-alls on a thread of its own."""
        if getattr(self._thread, "index", None) == index:
            return
        context = ctypes.c_void_p()
        self._check(self._fn("cuCtxGetCurrent")(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            self._check(self._fn("cuInit")(ctypes.c_uint(0)), "cuInit")
            device = ctypes.c_int()
            self._check(self._fn("cuDeviceGet")(ctypes.byref(device), ctypes.c_int(index)),
                        "cuDeviceGet")
            self._check(self._fn("cuDevicePrimaryCtxRetain")(ctypes.byref(context), device),
                        "cuDevicePrimaryCtxRetain")
            self._check(self._fn("cuCtxSetCurrent")(context), "cuCtxSetCurrent")
        self._thread.index = index

    # ------------------------------------------------------------------ pinned host memory
    def register(self, address: int, size: int) -> int:
        self._check(self._fn("cuMemHostRegister_v2", "cuMemHostRegister")(
            ctypes.c_void_p(address), ctypes.c_size_t(size), ctypes.c_uint(self.HOST_REGISTER)),
            "cuMemHostRegister")
        device_address = ctypes.c_uint64()
        self._check(self._fn("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")(
            ctypes.byref(device_address), ctypes.c_void_p(address), ctypes.c_uint(0)),
            "cuMemHostGetDevicePointer")
        return device_address.value

    def unregister(self, address: int) -> None:
        self._fn("cuMemHostUnregister")(ctypes.c_void_p(address))

    # ------------------------------------------------------------------ stream operations
    def wait32(self, stream: int, device_address: int, value: int) -> None:
        self._check(self._fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32")(
            ctypes.c_void_p(stream), ctypes.c_uint64(device_address), ctypes.c_uint32(value),
            ctypes.c_uint(self.WAIT_EQ)), "cuStreamWaitValue32")

    def write32(self, stream: int, device_address: int, value: int) -> None:
        self._check(self._fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32")(
            ctypes.c_void_p(stream), ctypes.c_uint64(device_address), ctypes.c_uint32(value),
            ctypes.c_uint(0)), "cuStreamWriteValue32")

    def copy_to_host(self, host: int, device: int, size: int, stream: int) -> None:
        self._check(self._fn("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync")(
            ctypes.c_void_p(host), ctypes.c_uint64(device), ctypes.c_size_t(size),
            ctypes.c_void_p(stream)), "cuMemcpyDtoHAsync")

    def copy_to_device(self, device: int, host: int, size: int, stream: int) -> None:
        self._check(self._fn("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync")(
            ctypes.c_uint64(device), ctypes.c_void_p(host), ctypes.c_size_t(size),
            ctypes.c_void_p(stream)), "cuMemcpyHtoDAsync")

    def copy_device(self, dest: int, source: int, size: int, stream: int) -> None:
        """Device to device: between two GPUs a peer copy (copy engine, over NVLink where
        there is one), on one GPU a copy within it."""
        self._check(self._fn("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync")(
            ctypes.c_uint64(dest), ctypes.c_uint64(source), ctypes.c_size_t(size),
            ctypes.c_void_p(stream)), "cuMemcpyDtoDAsync")

    # ------------------------------------------------------------------ CUDA IPC
    def allocation_base(self, address: int) -> int:
        """The start of the allocation holding device `address` (an IPC handle names a whole
        allocation, torch's caching allocator hands out pieces of larger ones)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self._fn("cuMemGetAddressRange_v2", "cuMemGetAddressRange")(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)),
            "cuMemGetAddressRange")
        return base.value

    def ipc_export(self, base: int) -> bytes:
        """The IPC handle of the allocation starting at `base` (its 64 bytes)."""
        handle = _IpcHandle()
        self._check(self._fn("cuIpcGetMemHandle")(ctypes.byref(handle), ctypes.c_uint64(base)),
                    "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)

    def ipc_open(self, handle: bytes) -> int:
        """Map another process's allocation into this one's context -> its base here."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        fn = self._fn("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        base = ctypes.c_uint64()
        self._check(fn(ctypes.byref(base), _IpcHandle.from_buffer_copy(handle),
                       ctypes.c_uint(self.IPC_LAZY_PEER_ACCESS)), "cuIpcOpenMemHandle")
        return base.value

    def ipc_close(self, base: int) -> None:
        self._check(self._fn("cuIpcCloseMemHandle")(ctypes.c_uint64(base)),
                    "cuIpcCloseMemHandle")


@functools.cache
def driver() -> _Driver:
    """libcuda, loaded at the first CUDA use of a transport (once per process)."""
    return _Driver()
