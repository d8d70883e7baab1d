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
    never TF32), then reads the main grad's tile, adds, and stores it once. An expert with no
    rows skips its tiles (main grad untouched), and rows past the last offset are never read.
    Without an SM carveout every tile has its own program; with one, `SMs - carveout` programs
    walk the tiles in turn (a tile's sums do not depend on which program computes it, so the
    carveout changes no bit).

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
    block_k rows per step, its warps and pipeline stages, and whether the main grad's tile is
    loaded before the row loop (`prefetch_c`: its HBM latency hidden behind the loop, for 64
    more registers a thread at 128 x 128 on 8 warps) or after it."""

    block_i: int
    block_o: int
    block_k: int
    num_warps: int
    num_stages: int
    prefetch_c: bool


@functools.lru_cache(maxsize=64)
def wgrad_config(dtype: torch.dtype) -> WgradConfig:
    """The kernel's config, a pure function of the input dtype (no autotuning: the same tiles,
    hence the same sums, in every process). Half precision: 128 x 128 tiles on 8 warps (two
    warpgroups of Hopper's wgmma), 64 rows per step, 3 stages (96 KiB of shared memory), the
    main grad's tile prefetched (242 registers, no spill, sm_90). fp32 inputs take FMA: smaller
    tiles, no prefetch (it would spill)."""
    if dtype in (torch.bfloat16, torch.float16):
        return WgradConfig(128, 128, 64, 8, 3, True)
    return WgradConfig(64, 64, 32, 4, 2, False)


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


@launch_cached
@triton.jit
def _grouped_wgrad_kernel(
    x_ptr,          # [N, I] in: rows sorted by expert, unit stride along I, rows stride_x apart
    grad_ptr,       # [N, O] in: x's dtype, unit stride along O, rows stride_g apart
    offsets_ptr,    # [E] in: int32 cumulative row end of each expert
    main_grad_ptr,  # [E, I, O] in/out: fp32, contiguous; += x_e^T @ grad_e
    I, O, stride_x, stride_g, num_tiles,
    BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH_C: tl.constexpr,
):
    tiles_o = tl.cdiv(O, BLOCK_O)
    tiles_per_expert = tl.cdiv(I, BLOCK_I) * tiles_o
    tile = tl.program_id(0)
    while tile < num_tiles:
        e = tile // tiles_per_expert
        rest = tile % tiles_per_expert
        start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        end = tl.load(offsets_ptr + e).to(tl.int64)
        if end > start:
            i = (rest // tiles_o) * BLOCK_I + tl.arange(0, BLOCK_I)
            o = (rest % tiles_o) * BLOCK_O + tl.arange(0, BLOCK_O)
            i_ok = i < I
            o_ok = o < O
            c_ptrs = main_grad_ptr + e.to(tl.int64) * I * O + i[:, None] * O + o[None, :]
            c_ok = i_ok[:, None] & o_ok[None, :]
            if PREFETCH_C:
                c = tl.load(c_ptrs, mask=c_ok, other=0.0)
            acc = tl.zeros((BLOCK_I, BLOCK_O), dtype=tl.float32)
            if not INTERPRETED:
                for k0 in tl.range(start, end, BLOCK_K, num_stages=NUM_STAGES):
                    acc = _add_rows(acc, x_ptr, grad_ptr, k0, end, i, o, i_ok, o_ok, stride_x,
                                    stride_g, BLOCK_K, INTERPRETED)
            else:
                k0 = start
                while k0 < end:
                    acc = _add_rows(acc, x_ptr, grad_ptr, k0, end, i, o, i_ok, o_ok, stride_x,
                                    stride_g, BLOCK_K, INTERPRETED)
                    k0 += BLOCK_K
            if not PREFETCH_C:
                c = tl.load(c_ptrs, mask=c_ok, other=0.0)
            tl.store(c_ptrs, c + acc, mask=c_ok)
        tile += tl.num_programs(0)


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


def grouped_weight_grad_triton(main_grad_EIO: torch.Tensor, x_NI: torch.Tensor,
                               grad_NO: torch.Tensor, offsets_E: torch.Tensor,
                               counts: Optional[list[int]] = None,
                               sm_carveout: Optional[int] = None,
                               config: Optional[WgradConfig] = None) -> None:
    """main_grad [E, I, O] (fp32, contiguous) += per expert x_e^T @ grad_e; x [N, I] and grad
    [N, O] of one dtype (bf16, fp16 or fp32), offsets [E] int32 on x's device. Same contract as
    `grouped_wgrad.grouped_weight_grad_torch`; `counts` is not needed (the kernel reads the
    offsets on the device), `sm_carveout` leaves that many SMs free, `config` overrides
    `wgrad_config` (benchmarks). 1 launch; no host sync; deterministic."""
    experts, width_in, width_out = main_grad_EIO.shape
    if main_grad_EIO.dtype != torch.float32 or not main_grad_EIO.is_contiguous():
        raise ValueError(f"grouped weight grad: main grad {main_grad_EIO.dtype} "
                         f"{tuple(main_grad_EIO.stride())}: must be contiguous fp32")
    if x_NI.dtype != grad_NO.dtype or x_NI.shape[0] != grad_NO.shape[0]:
        raise ValueError(f"grouped weight grad: x {x_NI.dtype} {tuple(x_NI.shape)} and grad "
                         f"{grad_NO.dtype} {tuple(grad_NO.shape)}: must share dtype and rows")
    if experts == 0 or x_NI.shape[0] == 0 or main_grad_EIO.numel() == 0:
        return
    cfg = config or wgrad_config(x_NI.dtype)
    x_NI, grad_NO = _unit_rows(x_NI), _unit_rows(grad_NO)
    num_tiles = experts * cdiv(width_in, cfg.block_i) * cdiv(width_out, cfg.block_o)
    programs = _programs(num_tiles, x_NI.device, sm_carveout)
    _grouped_wgrad_kernel[(programs,)](
        x_NI, grad_NO, offsets_E, main_grad_EIO, width_in, width_out, x_NI.stride(0),
        grad_NO.stride(0), num_tiles, BLOCK_I=cfg.block_i, BLOCK_O=cfg.block_o,
        BLOCK_K=cfg.block_k, INTERPRETED=_interpreted(), NUM_STAGES=cfg.num_stages,
        PREFETCH_C=cfg.prefetch_c, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
