"""Launch helpers shared by the Triton kernels: tile heuristics and the overflow check.

Owns the choice of tile sizes / num_warps for every kernel (one function per kernel family, so a
config is a pure function of the shape and dtype: no autotuning, hence no first-call benchmark
sync, graph capture works on the first call, and every process picks the same tiles, which keeps
reductions bit-identical across ranks and runs), and `check_count_fits`, the one place where a
kernel-computed count is compared with a caller's static size (device assert on CUDA, ValueError
on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT32_MAX = 2**31 - 1
MAX_ROUTER_EXPERTS = 4096  # the router keeps one token's E scores in one tile


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class CopyConfig:
    """Tiles of the row-copy kernels: BLOCK_H hidden elements per program, its warps."""

    block_h: int
    num_warps: int


def copy_config(hidden: int, elem_size: int) -> CopyConfig:
    """BLOCK_H / num_warps for a plain tiled row copy (the chunk sort).

    The largest power-of-two block of at most 8 KiB whose padding wastes <= 1/8 of the row
    (hidden 7168 bf16 -> 1024, hidden 4096 bf16 -> 4096); 4 warps up to 4 KiB, else 8, so each
    thread moves one or two 16-byte vectors per row.
    """
    max_block = max(8192 // elem_size, 16)
    block = min(next_pow2(hidden), max_block)
    while block > 256 and (-hidden % block) * 8 > hidden:
        block //= 2
    return CopyConfig(block, 4 if block * elem_size <= 4096 else 8)


def row_walk_config(hidden: int, elem_size: int) -> CopyConfig:
    """BLOCK_H / num_warps for permute / unpermute, whose programs walk a token's row ids.

    The walk (one reduction over E per routed row) is paid per program, so a whole row per
    program when it fits in 16 KiB (hidden 7168 bf16 -> 8192, 1/8 of the lanes masked), else
    the plain copy tiles.
    """
    whole = next_pow2(hidden)
    if whole * elem_size <= 16384:
        return CopyConfig(whole, 4 if whole * elem_size <= 4096 else 8)
    return copy_config(hidden, elem_size)


def rows_per_copy_program(block_h: int, elem_size: int) -> int:
    """Rows per program of the 2-D chunk-sort copy: about 16 KiB moved per program."""
    return max(1, min(64, 16384 // (block_h * elem_size)))


def map_tile(num_experts: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E) of the row-id map passes: ~4K routing flags per program."""
    block_e = min(next_pow2(num_experts), 1024)
    return max(1, min(512, 4096 // block_e)), block_e


def router_tile(num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, num_warps) of the router: one tile holds whole rows of E scores."""
    if num_experts > MAX_ROUTER_EXPERTS:
        raise ValueError(f"num_experts={num_experts}: the Triton router supports at most "
                         f"{MAX_ROUTER_EXPERTS} (use --kernel-backend torch)")
    block_e = next_pow2(num_experts)
    block_t = max(1, min(64, 2048 // block_e))
    return block_t, block_e, 4 if block_t * block_e <= 2048 else 8


def check_count_fits(count_1: torch.Tensor, limit: int, message: str) -> None:
    """Fail when the device count `count_1` [1] exceeds `limit`, without a host sync on CUDA.

    CUDA: `torch._assert_async` (a device-side assert that surfaces at the next sync; the kernels
    have already skipped every write past `limit`). CPU: ValueError naming the count.
    """
    if count_1.is_cuda:
        torch._assert_async(count_1[0] <= limit, message)
        return
    count = int(count_1[0])
    if count > limit:
        raise ValueError(f"{message} (got {count})")


def check_int32_rows(num_rows: int, what: str) -> None:
    """Row ids are int32: refuse sizes they cannot index."""
    if num_rows > INT32_MAX:
        raise ValueError(f"{what}={num_rows}: row ids are int32, at most {INT32_MAX}")
