"""Experts' weight grads added into their fp32 main grad inside the GEMM, in Triton:
`grouped_weight_grad_triton`, the same op as `grouped_wgrad.grouped_weight_grad_torch`.

Shape legend: N rows (sorted by expert), I input features, O output features, E experts.

Kernel (deterministic: no atomics, each main-grad element summed by one program in row order):
  `_grouped_wgrad_kernel`: one output tile [BLOCK_I, BLOCK_O] of one expert per step; tiles are
    numbered expert-major (an expert's tiles run side by side and share its rows in L2). A step
    reads the expert's row range from the device offsets (no host sync: CUDA graphs and the
    budget dispatch, whose counts only the device knows, work as they are), loops over its rows
    BLOCK_K at a time with x^T [BLOCK_I, BLOCK_K] @ grad [BLOCK_K, BLOCK_O] into an fp32
    register accumulator (`tl.dot`: tensor cores for bf16/fp16, IEEE fp32 for fp32 inputs,
    never TF32) that starts as the main grad's tile, and stores it once. Because the sums start
    from the main grad, a second source of rows (`more`: the next microbatch's) added in the
    same launch gives the bits of a second launch, with the main grad read and written once
    instead of twice. Without `accumulate` the accumulator starts at zero and the old main
    grad is never read (the step's first weight grad: no zeroing pass needed). An expert with
    no rows stores its tile unchanged (zeros without `accumulate`); rows past the last offset
    are never read.
    Without an SM carveout every tile has its own program; with one, `SMs - carveout` programs
    walk the tiles in turn (a tile's sums do not depend on which program computes it, so the
    carveout changes no bit).

Tiles (`wgrad_config`): chosen by the rows an expert has on average; every config adds 64
rows a step, so the sums' order, hence the bits on a GPU, is the same whichever is taken.

Traffic: the main grad is read and written once in fp32 (8 bytes per element; the rows are
read once per output tile, from L2 after the first); the unfused path wrote the product in bf16
and read it back beside the main grad (12 bytes per element). At R rows per expert a main-grad
element costs 2R FLOPs for its 8 bytes: at the Qwen3 proxy's 256 rows that is 64 FLOPs a byte,
below the ~200 where an H200's tensor cores (989 TFLOP/s) outrun its HBM (~4.8 TB/s), so the op
is bound by the fp32 traffic there, and the fusion's saving is that third of it.

The row loop is a `tl.range` loop (software pipelined, `num_stages`) when compiled; under
TRITON_INTERPRET (CPU) it is a `while` loop with the same body and order, because the 3.6
interpreter cannot take `range()` of a bound loaded from memory (see permutation_triton.py),
and the operands go to `tl.dot` as fp32, because its dot misreads bf16 (fp32 holds bf16 and
fp16 values exactly, so the sums are the same).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached
from .triton_utils import cdiv


@dataclass(frozen=True)
class WgradConfig:
    """Tiles and launch options of `_grouped_wgrad_kernel`: an output tile of block_i x block_o,
    block_k rows per step, its warps and pipeline stages."""

    block_i: int
    block_o: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False  # rows loaded by the tensor memory accelerator (sm_90+), not by pointers
    warp_specialize: bool = False  # TMA only: loads, MMA and epilogue in warps of their own
    group_i: int = 1  # tiles taken group_i input blocks at a time across the output blocks
    flat: bool = False  # one program an SM, its tiles in one flattened (pipelined) loop


# Half precision, by the rows an expert has on average (bench_wgrad --sweep on an H200,
# benchmarks/roofline.md): up to ~768 the op is bound by the fp32 main grad's traffic, and
# small tiles on 4 warps keep more of it in flight (several blocks an SM); from 1024 it is
# compute-bound, and 128 x 256 tiles on two warpgroups run the tensor cores fastest. Every
# config adds 64 rows a step, so on a GPU the sums are the same whichever is taken.
WGRAD_FEW_ROWS = WgradConfig(128, 128, 64, 4, 3)
WGRAD_MANY_ROWS = WgradConfig(128, 256, 64, 8, 4, group_i=8)
MANY_ROWS = 1024  # rows an expert from which WGRAD_MANY_ROWS is taken
WGRAD_FP32 = WgradConfig(64, 64, 32, 4, 2)  # fp32 inputs take FMA: smaller tiles


def wgrad_config(dtype: torch.dtype, rows_per_expert: float = 0.0) -> WgradConfig:
    """The kernel's config: a pure function of the input dtype and the rows an expert has on
    average (no autotuning: the same tiles in every process)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return WGRAD_FP32
    return WGRAD_MANY_ROWS if rows_per_expert >= MANY_ROWS else WGRAD_FEW_ROWS


@triton.jit
def _add_rows(acc, x_ptr, grad_ptr, k0, end, i, o, i_ok, o_ok, stride_x, stride_g,
              BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc [BLOCK_I, BLOCK_O] + x[k0:k0+BLOCK_K, i]^T @ grad[k0:k0+BLOCK_K, o] (rows >= end
    read as zero)."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < end
    xt = tl.load(x_ptr + k[None, :] * stride_x + i[:, None], mask=i_ok[:, None] & k_ok[None, :],
                 other=0.0)
    g = tl.load(grad_ptr + k[:, None] * stride_g + o[None, :], mask=k_ok[:, None] & o_ok[None, :],
                other=0.0)
    if INTERPRETED:  # the 3.6 interpreter's dot misreads bf16; fp32 holds every value exactly
        xt = xt.to(tl.float32)
        g = g.to(tl.float32)
    return tl.dot(xt, g, acc, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _add_rows_tma(acc, x_ptr, grad_ptr, start, end, i0, o0, I, O, stride_x, stride_g,
                  BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                  INTERPRETED: tl.constexpr, NUM_STAGES: tl.constexpr, WS: tl.constexpr):
    """acc + rows start..end-1 through TMA: one descriptor pair per expert over just its rows,
    so the hardware reads the rows past its end (the next expert's) as zeros."""
    rows = (end - start).to(tl.int32)
    x_desc = tl.make_tensor_descriptor(x_ptr + start * stride_x, shape=[rows, I],
                                       strides=[stride_x, 1], block_shape=[BLOCK_K, BLOCK_I])
    g_desc = tl.make_tensor_descriptor(grad_ptr + start * stride_g, shape=[rows, O],
                                       strides=[stride_g, 1], block_shape=[BLOCK_K, BLOCK_O])
    if not INTERPRETED:
        for k0 in tl.range(0, rows, BLOCK_K, num_stages=NUM_STAGES, warp_specialize=WS):
            acc = tl.dot(x_desc.load([k0, i0]).T, g_desc.load([k0, o0]), acc,
                         input_precision="ieee", out_dtype=tl.float32)
    else:  # the interpreter's loop and dot, as in `_add_expert_rows`
        k0 = 0
        while k0 < rows:
            xt = x_desc.load([k0, i0]).T.to(tl.float32)
            acc = tl.dot(xt, g_desc.load([k0, o0]).to(tl.float32), acc,
                         input_precision="ieee", out_dtype=tl.float32)
            k0 += BLOCK_K
    return acc


@triton.jit
def _add_expert_rows(acc, x_ptr, grad_ptr, offsets_ptr, e, i, o, i_ok, o_ok, stride_x, stride_g,
                     BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
                     NUM_STAGES: tl.constexpr, I=0, O=0, i0=0, o0=0,
                     BLOCK_I: tl.constexpr = 0, BLOCK_O: tl.constexpr = 0,
                     TMA: tl.constexpr = False, WS: tl.constexpr = False):
    """acc + expert e's rows of one source (x, grad, offsets), BLOCK_K rows a step in order."""
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + e).to(tl.int64)
    if TMA:
        if end > start:
            acc = _add_rows_tma(acc, x_ptr, grad_ptr, start, end, i0, o0, I, O, stride_x,
                                stride_g, BLOCK_I, BLOCK_O, BLOCK_K, INTERPRETED, NUM_STAGES, WS)
    elif not INTERPRETED:
        for k0 in tl.range(start, end, BLOCK_K, num_stages=NUM_STAGES):
            acc = _add_rows(acc, x_ptr, grad_ptr, k0, end, i, o, i_ok, o_ok, stride_x,
                            stride_g, BLOCK_K, INTERPRETED)
    else:
        k0 = start
        while k0 < end:
            acc = _add_rows(acc, x_ptr, grad_ptr, k0, end, i, o, i_ok, o_ok, stride_x,
                            stride_g, BLOCK_K, INTERPRETED)
            k0 += BLOCK_K
    return acc


@launch_cached
@triton.jit
def _grouped_wgrad_kernel(
    x_ptr,          # [N, I] in: rows sorted by expert, unit stride along I, rows stride_x apart
    grad_ptr,       # [N, O] in: x's dtype, unit stride along O, rows stride_g apart
    offsets_ptr,    # [E] in: int32 cumulative row end of each expert
    x2_ptr, grad2_ptr, offsets2_ptr,  # a second source of rows (TWO_SOURCES), the same layout
    main_grad_ptr,  # [E, I, O] in/out: fp32, contiguous; (+)= x_e^T @ grad_e (+ x2_e^T @ grad2_e)
    I, O, stride_x, stride_g, stride_x2, stride_g2, num_tiles,
    BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr, NUM_STAGES: tl.constexpr, TWO_SOURCES: tl.constexpr,
    ACCUMULATE: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, GROUP_I: tl.constexpr,
):
    tiles_o = tl.cdiv(O, BLOCK_O)
    tiles_i = tl.cdiv(I, BLOCK_I)
    tiles_per_expert = tiles_i * tiles_o
    tile = tl.program_id(0)
    while tile < num_tiles:
        e = tile // tiles_per_expert
        rest = tile % tiles_per_expert
        # GROUP_I input blocks a group, column-major in it: tiles side by side share both
        # operands' blocks in L2 (at a wide output, a row of tiles would read all of grad)
        per_group = GROUP_I * tiles_o
        first_i = (rest // per_group) * GROUP_I
        group_rows = tl.minimum(tiles_i - first_i, GROUP_I)
        i0 = (first_i + (rest % per_group) % group_rows) * BLOCK_I
        o0 = ((rest % per_group) // group_rows) * BLOCK_O
        i = i0 + tl.arange(0, BLOCK_I)
        o = o0 + tl.arange(0, BLOCK_O)
        i_ok = i < I
        o_ok = o < O
        c_ptrs = main_grad_ptr + e.to(tl.int64) * I * O + i[:, None] * O + o[None, :]
        c_ok = i_ok[:, None] & o_ok[None, :]
        if ACCUMULATE:  # the sums start from the main grad: one call or two, the same bits
            acc = tl.load(c_ptrs, mask=c_ok, other=0.0)
        else:
            acc = tl.zeros((BLOCK_I, BLOCK_O), dtype=tl.float32)
        acc = _add_expert_rows(acc, x_ptr, grad_ptr, offsets_ptr, e, i, o, i_ok, o_ok,
                               stride_x, stride_g, BLOCK_K, INTERPRETED, NUM_STAGES, I, O,
                               i0, o0, BLOCK_I, BLOCK_O, TMA, WS)
        if TWO_SOURCES:
            acc = _add_expert_rows(acc, x2_ptr, grad2_ptr, offsets2_ptr, e, i, o, i_ok, o_ok,
                                   stride_x2, stride_g2, BLOCK_K, INTERPRETED, NUM_STAGES, I, O,
                                   i0, o0, BLOCK_I, BLOCK_O, TMA, WS)
        tl.store(c_ptrs, acc, mask=c_ok)
        tile += tl.num_programs(0)


@triton.jit
def _source_step(s, steps1, start1, end1, start2, end2, x_ptr, grad_ptr, x2_ptr, grad2_ptr,
                 stride_x, stride_g, stride_x2, stride_g2, i, o, i_ok, o_ok,
                 BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """Step s of a tile's row walk over both sources: steps1 steps of the first source's
    rows, then the second's; (x^T block, grad block), rows past the source's end as zero."""
    second = s >= steps1
    k = tl.where(second, start2 + (s - steps1) * BLOCK_K, start1 + s * BLOCK_K)
    k = k + tl.arange(0, BLOCK_K)
    k_ok = k < tl.where(second, end2, end1)
    xp = tl.where(second, x2_ptr, x_ptr)
    gp = tl.where(second, grad2_ptr, grad_ptr)
    sx = tl.where(second, stride_x2, stride_x)
    sg = tl.where(second, stride_g2, stride_g)
    xt = tl.load(xp + k[None, :] * sx + i[:, None], mask=i_ok[:, None] & k_ok[None, :], other=0.0)
    g = tl.load(gp + k[:, None] * sg + o[None, :], mask=k_ok[:, None] & o_ok[None, :], other=0.0)
    if INTERPRETED:
        xt = xt.to(tl.float32)
        g = g.to(tl.float32)
    return xt, g


@triton.jit
def _flat_tile(tile, x_ptr, grad_ptr, offsets_ptr, x2_ptr, grad2_ptr, offsets2_ptr,
               main_grad_ptr, I, O, stride_x, stride_g, stride_x2, stride_g2,
               BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
               INTERPRETED: tl.constexpr, NUM_STAGES: tl.constexpr,
               TWO_SOURCES: tl.constexpr, ACCUMULATE: tl.constexpr, GROUP_I: tl.constexpr):
    """One output tile of `_grouped_wgrad_flat_kernel`: both sources' rows as one walk."""
    tiles_o = tl.cdiv(O, BLOCK_O)
    tiles_i = tl.cdiv(I, BLOCK_I)
    tiles_per_expert = tiles_i * tiles_o
    e = tile // tiles_per_expert
    rest = tile % tiles_per_expert
    per_group = GROUP_I * tiles_o
    first_i = (rest // per_group) * GROUP_I
    group_rows = tl.minimum(tiles_i - first_i, GROUP_I)
    i = (first_i + (rest % per_group) % group_rows) * BLOCK_I + tl.arange(0, BLOCK_I)
    o = ((rest % per_group) // group_rows) * BLOCK_O + tl.arange(0, BLOCK_O)
    i_ok = i < I
    o_ok = o < O
    start1 = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end1 = tl.load(offsets_ptr + e).to(tl.int64)
    steps1 = tl.cdiv(end1 - start1, BLOCK_K)
    if TWO_SOURCES:
        start2 = tl.load(offsets2_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        end2 = tl.load(offsets2_ptr + e).to(tl.int64)
    else:
        start2 = end1
        end2 = end1
    steps = steps1 + tl.cdiv(end2 - start2, BLOCK_K)
    c_ptrs = main_grad_ptr + e.to(tl.int64) * I * O + i[:, None] * O + o[None, :]
    c_ok = i_ok[:, None] & o_ok[None, :]
    if ACCUMULATE:
        acc = tl.load(c_ptrs, mask=c_ok, other=0.0)
    else:
        acc = tl.zeros((BLOCK_I, BLOCK_O), dtype=tl.float32)
    if not INTERPRETED:
        for s in tl.range(0, steps, num_stages=NUM_STAGES):
            xt, g = _source_step(s, steps1, start1, end1, start2, end2, x_ptr, grad_ptr,
                                 x2_ptr, grad2_ptr, stride_x, stride_g, stride_x2, stride_g2,
                                 i, o, i_ok, o_ok, BLOCK_K, INTERPRETED)
            acc = tl.dot(xt, g, acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        s = 0
        while s < steps:
            xt, g = _source_step(s, steps1, start1, end1, start2, end2, x_ptr, grad_ptr,
                                 x2_ptr, grad2_ptr, stride_x, stride_g, stride_x2, stride_g2,
                                 i, o, i_ok, o_ok, BLOCK_K, INTERPRETED)
            acc = tl.dot(xt, g, acc, input_precision="ieee", out_dtype=tl.float32)
            s += 1
    tl.store(c_ptrs, acc, mask=c_ok)


@launch_cached
@triton.jit
def _grouped_wgrad_flat_kernel(
    x_ptr, grad_ptr, offsets_ptr, x2_ptr, grad2_ptr, offsets2_ptr, main_grad_ptr,
    I, O, stride_x, stride_g, stride_x2, stride_g2, num_tiles,
    BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr, NUM_STAGES: tl.constexpr, TWO_SOURCES: tl.constexpr,
    ACCUMULATE: tl.constexpr, GROUP_I: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):
    """`_grouped_wgrad_kernel`'s sums with one program an SM walking the tiles in one
    flattened loop, so the compiler can start the next tile's loads while this tile's sums
    are stored."""
    if not INTERPRETED:
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
            _flat_tile(tile, x_ptr, grad_ptr, offsets_ptr, x2_ptr, grad2_ptr, offsets2_ptr,
                       main_grad_ptr, I, O, stride_x, stride_g, stride_x2, stride_g2, BLOCK_I,
                       BLOCK_O, BLOCK_K, INTERPRETED, NUM_STAGES, TWO_SOURCES, ACCUMULATE,
                       GROUP_I)
    else:
        tile = tl.program_id(0)
        while tile < num_tiles:
            _flat_tile(tile, x_ptr, grad_ptr, offsets_ptr, x2_ptr, grad2_ptr, offsets2_ptr,
                       main_grad_ptr, I, O, stride_x, stride_g, stride_x2, stride_g2, BLOCK_I,
                       BLOCK_O, BLOCK_K, INTERPRETED, NUM_STAGES, TWO_SOURCES, ACCUMULATE,
                       GROUP_I)
            tile += NUM_PROGRAMS


def _interpreted() -> bool:
    """Whether the kernel runs under TRITON_INTERPRET (fixed when the kernel was decorated)."""
    return type(_grouped_wgrad_kernel.fn).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs(num_tiles: int, device: torch.device, sm_carveout: Optional[int]) -> int:
    if sm_carveout is None or device.type != "cuda":
        return num_tiles
    return max(1, min(num_tiles, _sm_count(device.index or 0) - sm_carveout))


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _checked(main_grad_EIO: torch.Tensor, x_NI: torch.Tensor, grad_NO: torch.Tensor) -> None:
    if main_grad_EIO.dtype != torch.float32 or not main_grad_EIO.is_contiguous():
        raise ValueError(f"grouped weight grad: main grad {main_grad_EIO.dtype} "
                         f"{tuple(main_grad_EIO.stride())}: must be contiguous fp32")
    if x_NI.dtype != grad_NO.dtype or x_NI.shape[0] != grad_NO.shape[0]:
        raise ValueError(f"grouped weight grad: x {x_NI.dtype} {tuple(x_NI.shape)} and grad "
                         f"{grad_NO.dtype} {tuple(grad_NO.shape)}: must share dtype and rows")


def grouped_weight_grad_triton(main_grad_EIO: torch.Tensor, x_NI: torch.Tensor,
                               grad_NO: torch.Tensor, offsets_E: torch.Tensor,
                               counts: Optional[list[int]] = None,
                               sm_carveout: Optional[int] = None,
                               config: Optional[WgradConfig] = None,
                               more: Optional[tuple] = None,
                               accumulate: bool = True) -> None:
    """main_grad [E, I, O] (fp32, contiguous) += per expert x_e^T @ grad_e; x [N, I] and grad
    [N, O] of one dtype (bf16, fp16 or fp32), offsets [E] int32 on x's device. Same contract as
    `grouped_wgrad.grouped_weight_grad_torch`; `counts` is not needed (the kernel reads the
    offsets on the device), `sm_carveout` leaves that many SMs free, `config` overrides
    `wgrad_config` (benchmarks). `more`: a second source (x2, grad2, offsets2) whose rows
    are added after the first's, with the bits of a second call. `accumulate` False: the main
    grad is overwritten (its old values never read; experts with no rows get zeros). 1 launch;
    no host sync; deterministic."""
    experts, width_in, width_out = main_grad_EIO.shape
    _checked(main_grad_EIO, x_NI, grad_NO)
    x2, g2, off2 = more if more is not None else (x_NI, grad_NO, offsets_E)
    _checked(main_grad_EIO, x2, g2)
    if experts == 0 or main_grad_EIO.numel() == 0:
        return
    rows = x_NI.shape[0] + (x2.shape[0] if more is not None else 0)
    if rows == 0:
        if not accumulate:
            main_grad_EIO.zero_()
        return
    cfg = config or wgrad_config(x_NI.dtype, rows / experts)
    x_NI, grad_NO, x2, g2 = (_unit_rows(t) for t in (x_NI, grad_NO, x2, g2))
    num_tiles = experts * cdiv(width_in, cfg.block_i) * cdiv(width_out, cfg.block_o)
    programs = _programs(num_tiles, x_NI.device, sm_carveout)
    if cfg.flat:
        programs = _programs(num_tiles, x_NI.device, sm_carveout or 0)
        _grouped_wgrad_flat_kernel[(programs,)](
            x_NI, grad_NO, offsets_E, x2, g2, off2, main_grad_EIO, width_in, width_out,
            x_NI.stride(0), grad_NO.stride(0), x2.stride(0), g2.stride(0), num_tiles,
            BLOCK_I=cfg.block_i, BLOCK_O=cfg.block_o, BLOCK_K=cfg.block_k,
            INTERPRETED=_interpreted(), NUM_STAGES=cfg.num_stages, TWO_SOURCES=more is not None,
            ACCUMULATE=accumulate, GROUP_I=cfg.group_i, NUM_PROGRAMS=programs,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    if cfg.tma:
        _check_tma(x_NI, grad_NO, x2, g2)
        # per thread (a ContextVar), so set at each call
        triton.set_allocator(functools.partial(_descriptor_scratch, x_NI.device))
    _grouped_wgrad_kernel[(programs,)](
        x_NI, grad_NO, offsets_E, x2, g2, off2, main_grad_EIO, width_in, width_out,
        x_NI.stride(0), grad_NO.stride(0), x2.stride(0), g2.stride(0), num_tiles,
        BLOCK_I=cfg.block_i, BLOCK_O=cfg.block_o, BLOCK_K=cfg.block_k,
        INTERPRETED=_interpreted(), NUM_STAGES=cfg.num_stages, TWO_SOURCES=more is not None,
        ACCUMULATE=accumulate, TMA=cfg.tma, WS=cfg.warp_specialize, GROUP_I=cfg.group_i,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _descriptor_scratch(device: torch.device, size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors the TMA kernel writes (from torch's allocator, so a
    CUDA graph's capture takes it from the graph's pool)."""
    return torch.empty(size, dtype=torch.int8, device=device)


def _check_tma(*rows: torch.Tensor) -> None:
    """TMA reads from 16-byte aligned bases with 16-byte aligned row strides."""
    for t in rows:
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            raise ValueError(f"grouped weight grad: a TMA config needs 16-byte aligned rows, "
                             f"got stride {t.stride(0)} of {t.dtype}")
