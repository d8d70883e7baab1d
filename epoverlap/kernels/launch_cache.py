"""The host fast path of every Triton launch: one dict lookup per call, then the compiled
kernel's C launcher.

Triton's own `JITFunction.run` rebuilds the launch on every call: it binds the arguments,
specializes each one (`native_specialize_impl`, about 9 per call here), hashes the
specialization into a cache key, checks the kernel's globals, and only then launches. For our
small, frequent kernels that bookkeeping is a large share of each op's host time, and an eager
step is often bound by the host issuing launches. `LaunchCache` keeps, per kernel, the
`CompiledKernel` that Triton returned for a launch key, and on a later call with the same key
calls its launcher directly.

The launch key must never map two calls that Triton would compile differently to one kernel,
so it is deliberately coarser-safe than Triton's own specialization rather than a copy of it:
  - a tensor: its dtype and whether its data pointer is 16-byte aligned (the only pointer
    property Triton 3.x specializes on);
  - an int that the kernel lists in `do_not_specialize`: only the integer type Triton picks for
    it (int32 / int64 / uint64 by range): these are the row counts that vary step to step;
  - any other int, a bool, None and every keyword (constexprs and launch options such as
    `num_warps`): the value itself (Triton specializes ints on == 1 and divisibility by 16; the
    exact value is finer than that, so never wrong, and these are shapes that repeat);
  - a float: its type only (Triton passes every Python float as fp32);
  - the current device.
Anything else (a tuple argument, a tensor descriptor, a callable grid), launch hooks installed
(a profiler such as proton), Triton's global debug knob, or the interpreter
(`TRITON_INTERPRET=1`, CPU) take Triton's own path unchanged; under the interpreter one launch
runs at a time (`_INTERPRETER`: it patches `triton.language` while a kernel runs, so the CPU
comm lane's thread and the main thread must not interpret at once). The entries per kernel are
bounded (`MAX_ENTRIES`, the oldest dropped first), so a run whose shapes keep changing costs at
most Triton's own path plus one dict insert per call.

Compiles still happen only in Triton's path, so `epoverlap.kernels.triton_compiled_variants`
(the compile watch) sees every variant; `device_caches` and the other attributes of the wrapped
kernel are passed through.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

MAX_ENTRIES = 64
_INTERPRETER = threading.Lock()  # one interpreted launch at a time (module docstring)
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


def int_type_key(value: int) -> str:
    """The integer type Triton gives an unspecialized int argument (by range)."""
    if _INT32[0] <= value <= _INT32[1]:
        return "i32"
    if _INT64[0] <= value <= _INT64[1]:
        return "i64"
    return "u64"


def arg_key(value: Any, specialized: bool) -> Any:
    """The launch-key part of one positional argument, or raise TypeError for a kind the fast
    path does not handle (the call then takes Triton's own path)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() & 15 == 0)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return ("v", value) if specialized else int_type_key(value)
    if isinstance(value, float):
        return float
    raise TypeError(type(value).__name__)


class LaunchCache:
    """A Triton kernel with a per-launch-key cache of its compiled kernel (module docstring).

    Used as a decorator above `@triton.jit`; call sites launch it as they would the kernel:
    `kernel[grid](*args, **constexprs_and_options)`.
    """

    def __init__(self, fn):
        self.fn = fn
        self.enabled = True  # False: every launch takes Triton's own path (to compare)
        self.hits = 0
        self.misses = 0
        self._entries: dict[tuple, tuple] = {}
        params = getattr(fn, "params", None)
        # the JIT path needs Triton's launcher internals; the interpreter has no compiled kernel
        self._jit = params is not None and hasattr(fn, "device_caches")
        if self._jit:
            self._param_names = tuple(p.name for p in params)
            self._param_defaults = {p.name: p.default for p in params if p.has_default}
            self._specialized = tuple(not p.do_not_specialize for p in params)
            from triton import knobs
            from triton.runtime.driver import driver
            self._runtime_knobs, self._driver = knobs.runtime, driver

    def __getattr__(self, name: str) -> Any:  # device_caches, arg_names, ... of the kernel
        return getattr(self.__dict__["fn"], name)

    def __getitem__(self, grid) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        if not self._jit:  # the interpreter
            with _INTERPRETER:
                return self.fn[grid](*args, **kwargs)
        knobs = self._runtime_knobs if self.enabled else None
        if knobs is None or callable(grid) or knobs.debug or hooks_installed(knobs):
            return self.fn[grid](*args, **kwargs)
        driver = self._driver.active
        device = driver.get_current_device()
        key = self._key(device, args, kwargs)
        entry = self._entries.get(key) if key is not None else None
        if entry is None:
            return self._launch_and_remember(key, grid, args, kwargs)
        self.hits += 1
        kernel, tail = entry
        values = list(args)
        values.extend(kwargs[name] if name in kwargs else default for name, default in tail)
        grid_x, grid_y, grid_z = _grid3(grid)
        stream = driver.get_current_stream(device)
        kernel.run(grid_x, grid_y, grid_z, stream, kernel.function, kernel.packed_metadata,
                   None, None, None, *values)
        return kernel

    def _key(self, device: int, args: tuple, kwargs: dict) -> Optional[tuple]:
        if len(args) > len(self._specialized):
            return None
        try:
            parts = [arg_key(value, spec) for value, spec in zip(args, self._specialized)]
        except TypeError:
            return None
        return (device, tuple(parts), tuple(kwargs.items()))

    def _launch_and_remember(self, key: Optional[tuple], grid, args: tuple, kwargs: dict):
        self.misses += 1
        kernel = self.fn[grid](*args, **kwargs)
        if key is None or kernel is None or hasattr(kernel, "result"):
            return kernel
        names = self._param_names[len(args):]
        if any(name not in kwargs and name not in self._param_defaults for name in names):
            return kernel
        tail = tuple((name, self._param_defaults.get(name)) for name in names)
        if len(self._entries) >= MAX_ENTRIES:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (kernel, tail)
        return kernel


def hooks_installed(runtime_knobs) -> bool:
    """Whether a launch enter/exit hook is set (Triton 3.6: a non-empty `HookChain`; older: any
    callable): the launch then takes Triton's own path, which calls them."""
    for hook in (runtime_knobs.launch_enter_hook, runtime_knobs.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def launch_cached(fn) -> LaunchCache:
    """Decorator: `@launch_cached` above `@triton.jit(...)` (module docstring)."""
    return LaunchCache(fn)


def _grid3(grid) -> tuple[int, int, int]:
    size = len(grid)
    return grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1
