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
    carveout changes no bit). Tiles are numbered `group_i` input blocks at a time (L2 reuse);
    the numbering, like the carveout, changes no bit.

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
    group_i: int = 1  # tiles taken group_i input blocks at a time across the output blocks


# Half precision, by the rows an expert has on average (bench_wgrad's sweeps on an H200,
# benchmarks/roofline.md): up to ~768 the op is bound by the fp32 main grad's traffic, and
# 128 x 128 tiles on one warpgroup with 3 stages (two blocks an SM) keep most of it in flight;
# from 1024 it is compute-bound, and 128 x 256 tiles on two warpgroups run the tensor cores
# fastest, taken 8 input blocks at a time so that a wide output's grad is read from L2. Every
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
def _add_expert_rows(acc, x_ptr, grad_ptr, offsets_ptr, e, i, o, i_ok, o_ok, stride_x, stride_g,
                     BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    """acc + expert e's rows of one source (x, grad, offsets), BLOCK_K rows a step in order."""
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + e).to(tl.int64)
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
    ACCUMULATE: tl.constexpr, GROUP_I: tl.constexpr,
):
    tiles_o = tl.cdiv(O, BLOCK_O)
    tiles_i = tl.cdiv(I, BLOCK_I)
    tiles_per_expert = tiles_i * tiles_o
    tile = tl.program_id(0)
    while tile < num_tiles:
        e = tile // tiles_per_expert
        rest = tile % tiles_per_expert
        # GROUP_I input blocks a group, taken column by column: tiles running side by side
        # share both operands' blocks in L2 (row by row, at a wide output such as Mixtral's
        # fc1, every row of tiles would read all of the expert's grad from HBM again)
        per_group = GROUP_I * tiles_o
        first_i = (rest // per_group) * GROUP_I
        group_rows = tl.minimum(tiles_i - first_i, GROUP_I)
        i = (first_i + (rest % per_group) % group_rows) * BLOCK_I + tl.arange(0, BLOCK_I)
        o = ((rest % per_group) // group_rows) * BLOCK_O + tl.arange(0, BLOCK_O)
        i_ok = i < I
        o_ok = o < O
        c_ptrs = main_grad_ptr + e.to(tl.int64) * I * O + i[:, None] * O + o[None, :]
        c_ok = i_ok[:, None] & o_ok[None, :]
        if ACCUMULATE:  # the sums start from the main grad: one call or two, the same bits
            acc = tl.load(c_ptrs, mask=c_ok, other=0.0)
        else:
            acc = tl.zeros((BLOCK_I, BLOCK_O), dtype=tl.float32)
        acc = _add_expert_rows(acc, x_ptr, grad_ptr, offsets_ptr, e, i, o, i_ok, o_ok,
                               stride_x, stride_g, BLOCK_K, INTERPRETED, NUM_STAGES)
        if TWO_SOURCES:
            acc = _add_expert_rows(acc, x2_ptr, grad2_ptr, offsets2_ptr, e, i, o, i_ok, o_ok,
                                   stride_x2, stride_g2, BLOCK_K, INTERPRETED, NUM_STAGES)
        tl.store(c_ptrs, acc, mask=c_ok)
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
    _grouped_wgrad_kernel[(programs,)](
        x_NI, grad_NO, offsets_E, x2, g2, off2, main_grad_EIO, width_in, width_out,
        x_NI.stride(0), grad_NO.stride(0), x2.stride(0), g2.stride(0), num_tiles,
        BLOCK_I=cfg.block_i, BLOCK_O=cfg.block_o, BLOCK_K=cfg.block_k,
        INTERPRETED=_interpreted(), NUM_STAGES=cfg.num_stages, TWO_SOURCES=more is not None,
        ACCUMULATE=accumulate, GROUP_I=cfg.group_i, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
