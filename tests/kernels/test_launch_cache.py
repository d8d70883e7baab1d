"""The Triton launch cache (kernels/launch_cache.py) on CPU, against a stand-in JIT function.

The stand-in mimics the parts of Triton 3.x's `JITFunction` the cache touches (params with
`do_not_specialize`, `kernel[grid](...)` returning a compiled kernel whose `run` is the C
launcher) and records every launch, so the tests check what reaches the launcher: the
argument order, the defaults, the grid, and which calls Triton's own path must see. The GPU
test in test_kernels_gpu.py checks the real kernels bitwise with and without the cache.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
from epoverlap.kernels.launch_cache import LaunchCache, arg_key, hooks_installed, int_type_key  # noqa: E402


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty, do_not_specialize=False):
        self.name, self.default, self.do_not_specialize = name, default, do_not_specialize

    @property
    def has_default(self):
        return self.default is not inspect.Parameter.empty


class _Compiled:
    def __init__(self, log, variant):
        self.function, self.packed_metadata, self.log, self.variant = "fn", "meta", log, variant

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.log.append(("fast", self.variant, (gx, gy, gz), stream, args, enter, exit_))


class _FakeJit:
    """Triton's path: every call "specializes" and launches; returns a compiled kernel."""

    def __init__(self, params):
        self.params = params
        self.device_caches = {0: ({}, {}, None, None, None)}
        self.log, self.compiles = [], 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiles += 1
            self.log.append(("triton", grid, args, kwargs))
            return _Compiled(self.log, self.compiles)
        return run


class _FakeDriver:
    def __init__(self):
        self.active = SimpleNamespace(get_current_device=lambda: 0,
                                      get_current_stream=lambda device: 1234)


def _cache(params, knobs=None):
    fake = _FakeJit(params)
    cache = LaunchCache(fake)
    cache._driver = _FakeDriver()
    cache._runtime_knobs = knobs or SimpleNamespace(
        debug=False, launch_enter_hook=SimpleNamespace(calls=[]),
        launch_exit_hook=SimpleNamespace(calls=[]))
    return cache, fake


PARAMS = [_Param("x_ptr"), _Param("out_ptr"), _Param("T", do_not_specialize=True), _Param("H"),
          _Param("scale"), _Param("BLOCK", ), _Param("FLAG", default=False)]


def test_second_call_goes_to_the_launcher_with_every_param_in_order():
    cache, fake = _cache(PARAMS)
    x, out = torch.zeros(64), torch.zeros(64)
    cache[(4, 2)](x, out, 100, 64, 0.5, BLOCK=32, num_warps=4)
    cache[(8,)](x, out, 100, 64, 0.5, BLOCK=32, num_warps=4)
    assert (cache.misses, cache.hits) == (1, 1)
    kind, variant, grid, stream, args, enter, exit_ = fake.log[1]
    assert kind == "fast" and variant == 1 and grid == (8, 1, 1) and stream == 1234
    # BLOCK from the keywords, FLAG from its default; num_warps is an option, not a param
    assert args == (x, out, 100, 64, 0.5, 32, False)
    assert enter is None and exit_ is None


def test_row_counts_share_a_variant_but_shapes_do_not():
    cache, fake = _cache(PARAMS)
    x, out = torch.zeros(64), torch.zeros(64)
    for rows in (100, 7, 1, 4096):  # do_not_specialize: one key for every int32 count
        cache[(1,)](x, out, rows, 64, 0.5, BLOCK=32)
    assert (cache.misses, cache.hits) == (1, 3)
    cache[(1,)](x, out, 2**40, 64, 0.5, BLOCK=32)  # an int64 count is another variant
    cache[(1,)](x, out, 100, 48, 0.5, BLOCK=32)    # another hidden size
    cache[(1,)](x, out, 100, 64, 0.5, BLOCK=64)    # another constexpr
    cache[(1,)](x, out, 100, 64, 0.5, BLOCK=32, num_warps=8)  # another option
    cache[(1,)](x, out, 100, 64, 0.25, BLOCK=32)   # a float's value is not specialized
    assert (cache.misses, cache.hits) == (5, 4)


def test_dtype_and_alignment_are_part_of_the_key():
    cache, fake = _cache(PARAMS)
    x, out = torch.zeros(64), torch.zeros(64)
    cache[(1,)](x, out, 10, 64, 0.5, BLOCK=32)
    cache[(1,)](x.double(), out, 10, 64, 0.5, BLOCK=32)
    cache[(1,)](x[1:], out, 10, 64, 0.5, BLOCK=32)  # 4-byte offset: not 16-byte aligned
    cache[(1,)](x[4:], out, 10, 64, 0.5, BLOCK=32)  # 16-byte offset: same key as x
    assert [entry[0] for entry in fake.log] == ["triton", "triton", "triton", "fast"]


def test_hooks_debug_callable_grids_and_odd_args_take_tritons_path():
    hooked = SimpleNamespace(debug=False, launch_enter_hook=SimpleNamespace(calls=[print]),
                             launch_exit_hook=SimpleNamespace(calls=[]))
    debug = SimpleNamespace(debug=True, launch_enter_hook=None, launch_exit_hook=None)
    x = torch.zeros(8)
    for knobs in (hooked, debug):
        cache, fake = _cache(PARAMS, knobs)
        for _ in range(2):
            cache[(1,)](x, x, 1, 8, 1.0, BLOCK=8)
        assert [entry[0] for entry in fake.log] == ["triton", "triton"]
    cache, fake = _cache(PARAMS)
    for _ in range(2):
        cache[lambda meta: (1,)](x, x, 1, 8, 1.0, BLOCK=8)
        cache[(1,)](x, x, (1, 2), 8, 1.0, BLOCK=8)  # a tuple argument
    assert [entry[0] for entry in fake.log] == ["triton"] * 4
    assert cache.hits == 0


def test_a_param_left_to_triton_without_default_is_never_cached():
    params = PARAMS[:6] + [_Param("NEEDED")]
    cache, fake = _cache(params)
    x = torch.zeros(8)
    for _ in range(2):
        cache[(1,)](x, x, 1, 8, 1.0, BLOCK=8)  # NEEDED missing: Triton's own error path
    assert cache.hits == 0


def test_entries_are_bounded(monkeypatch):
    monkeypatch.setattr("epoverlap.kernels.launch_cache.MAX_ENTRIES", 3)
    cache, fake = _cache(PARAMS)
    x = torch.zeros(8)
    for hidden in range(10):
        cache[(1,)](x, x, 1, hidden, 1.0, BLOCK=8)
    assert len(cache._entries) == 3


def test_key_parts():
    assert int_type_key(2**31 - 1) == "i32" and int_type_key(-(2**31)) == "i32"
    assert int_type_key(2**31) == "i64" and int_type_key(2**64 - 1) == "u64"
    assert arg_key(True, True) is True and arg_key(None, True) is None
    assert arg_key(16, True) != arg_key(32, True) and arg_key(16, False) == arg_key(32, False)
    with pytest.raises(TypeError):
        arg_key("text", True)


def test_hooks_installed_reads_tritons_hook_chains():
    from triton import knobs

    assert not hooks_installed(knobs.runtime)  # a fresh process installs none
    assert hooks_installed(SimpleNamespace(launch_enter_hook=print, launch_exit_hook=None))


def test_the_real_kernels_pass_their_attributes_through():
    from epoverlap.kernels import permutation_triton

    kernel = permutation_triton._permute_kernel
    assert isinstance(kernel, LaunchCache)
    assert kernel.fn.__class__.__name__ in ("JITFunction", "InterpretedFunction")
    assert hasattr(kernel, "device_caches") or kernel.fn.__class__.__name__ != "JITFunction"


class _PatchingInterpreter:
    """Like Triton's interpreter: a launch patches a module-wide global for its duration
    (triton.language), and a kernel that finds it unpatched mid-run fails."""

    patched = 0

    def __getitem__(self, grid):
        def run(*args):
            _PatchingInterpreter.patched += 1
            try:
                for _ in range(2000):
                    if _PatchingInterpreter.patched != 1:
                        raise RuntimeError("another launch patched the language mid-run")
            finally:
                _PatchingInterpreter.patched -= 1
        return run


def test_interpreted_launches_from_two_threads_run_one_at_a_time():
    """On CPU the comm lane is a worker thread: its kernels and the main thread's must not be
    interpreted at once (LaunchCache serializes the interpreter's launches)."""
    import concurrent.futures

    kernel = LaunchCache(_PatchingInterpreter())
    assert not kernel._jit
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        launches = [pool.submit(kernel[(1,)], i) for i in range(200)]
        for launch in launches:
            launch.result()
