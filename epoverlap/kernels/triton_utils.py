"""Launch helpers shared by the Triton kernels: tile heuristics and the overflow checks.

Owns the choice of tile sizes / num_warps for every kernel (one function per kernel family, so a
config is a pure function of the shape and dtype: no autotuning, hence no first-call benchmark
sync, graph capture works on the first call, and every process picks the same tiles, which keeps
reductions bit-identical across ranks and runs), and the one place where a kernel-computed count
is compared with a caller's static size:
  - CUDA: inside the kernel that computes the count (`device_asserts`: the kernel is compiled
    with Triton's device asserts on, no extra launch, no host sync);
  - CPU / interpreter: `check_count_fits` on the host (ValueError naming the count).

Host-side arithmetic here is plain Python on purpose: `triton.cdiv` / `triton.next_power_of_2`
are constexpr functions in Triton 3.6, far slower to call from the host than plain arithmetic,
and they run on every launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

INT32_MAX = 2**31 - 1
MAX_ROUTER_EXPERTS = 4096  # the router keeps one token's E scores in one tile
# Launch options of a kernel whose bound check is a `tl.device_assert`: Triton compiles device
# asserts only with debug on; the int32 overflow sanitizer that debug also enables is left off.
DEVICE_ASSERT_OPTIONS = {"debug": True, "sanitize_overflow": False}


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (host side; see the module docstring)."""
    return -(-a // b)


@dataclass(frozen=True)
class CopyConfig:
    """Tiles of the row-copy kernels: BLOCK_H hidden elements per program, its warps,
    BLOCK_T tokens per program (the row-walk kernels; 1 elsewhere), and whether the unpermute
    kernel's row walk keeps the next row's load in flight (`prefetch`; the other kernels
    ignore it)."""

    block_h: int
    num_warps: int
    block_t: int = 1
    prefetch: bool = False


@functools.lru_cache(maxsize=256)
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


@functools.lru_cache(maxsize=256)
def row_walk_config(hidden: int, elem_size: int) -> CopyConfig:
    """BLOCK_H / num_warps for permute / unpermute, whose programs walk a token's row ids.

    The walk (one reduction over E per routed row) is paid per program, so a whole row per
    program when it fits in 16 KiB (hidden 7168 bf16 -> 8192, 1/8 of the lanes masked), else
    the plain copy tiles; one token per program (`permute_config` and `unpermute_config`
    refine it per kernel).
    """
    whole = next_pow2(hidden)
    if whole * elem_size <= 16384:
        return CopyConfig(whole, 4 if whole * elem_size <= 4096 else 8)
    return copy_config(hidden, elem_size)


PERMUTE_TILE_BYTES = 16384
PERMUTE_MAX_EXPERTS_MULTI_TOKEN = 32


@functools.lru_cache(maxsize=256)
def permute_config(hidden: int, elem_size: int, num_experts: int) -> CopyConfig:
    """`row_walk_config` for the permute copy, plus BLOCK_T tokens per program.

    With at most 32 experts the per-token walk is a few in-warp reductions and a row of at
    most 8 KiB moves too little per program to hide its row-id load: ~16 KiB of token rows
    per program (hidden 4096 bf16 -> 2 tokens). The copy holds only the rows in registers.
    """
    config = row_walk_config(hidden, elem_size)
    if num_experts > PERMUTE_MAX_EXPERTS_MULTI_TOKEN:
        return config
    block_t = max(1, min(8, PERMUTE_TILE_BYTES // (config.block_h * elem_size)))
    warps = 4 if block_t * config.block_h * elem_size <= 4096 else 8
    return CopyConfig(config.block_h, warps, block_t)


UNPERMUTE_KINDS = ("forward", "backward", "permute_backward")


@functools.lru_cache(maxsize=256)
def unpermute_config(hidden: int, elem_size: int, num_experts: int, kind: str) -> CopyConfig:
    """Tiles of the unpermute kernels, by `kind` (UNPERMUTE_KINDS): `forward` (with merging
    probs), `backward` (with the merging probs' grad), `permute_backward` (the forward kernel
    without merging probs, gathering the permuted probs' grad back to [T, E]). Chosen by tile
    sweeps at a many-expert shape (DeepSeek-V3-like) and a few-expert one (Mixtral-like).

    4 warps: the fp32 accumulator and a whole row per program in 8 warps leave the SMs short of
    resident programs, so fewer row loads are in flight. The backward holds a grad row and a
    data row: at most 8 KiB of a row per program. With at most 32 experts a token's walk is
    short, so one token per program moves too little to hide its row-id load: BLOCK_T tokens
    per program keep enough rows in flight.

    `permute_backward`: without the fp32 probs tile in registers there is room for the next
    row's load in flight (`prefetch`), which hides the latency of the row walk at many experts;
    with <= 32 experts, 4 KiB row blocks of 4 tokens keep the programs small and numerous.
    """
    if kind not in UNPERMUTE_KINDS:
        raise ValueError(f"unpermute_config kind={kind!r}: allowed {', '.join(UNPERMUTE_KINDS)}")
    block_h = row_walk_config(hidden, elem_size).block_h
    if kind == "permute_backward":
        if num_experts <= PERMUTE_MAX_EXPERTS_MULTI_TOKEN:
            return CopyConfig(min(block_h, max(16, 4096 // elem_size)), 4, 4)
        return CopyConfig(block_h, 4, 1, prefetch=True)
    backward = kind == "backward"
    if backward:
        block_h = min(block_h, max(16, 8192 // elem_size))
    block_t = 1
    if num_experts <= PERMUTE_MAX_EXPERTS_MULTI_TOKEN:
        block_t = max(1, min(2 if backward else 4, 32768 // (block_h * elem_size)))
    return CopyConfig(block_h, 4, block_t)


ROW_TILE_BYTES = 16384
ROW_TILE_MAX_ROWS = 1024


@functools.lru_cache(maxsize=256)
def row_tile_config(hidden: int, elem_size: int) -> CopyConfig:
    """Tiles of the row gather and the padding-row zeroing (`rows_triton`): the plain copy's
    BLOCK_H (`copy_config`) and BLOCK_T rows per program for ~16 KiB a tile (hidden 2048 bf16
    -> 4 rows; [X] fp32 probs -> 1024 rows of 1), 4 warps up to 8 KiB a tile, else 8."""
    block_h = copy_config(hidden, elem_size).block_h
    rows = max(1, min(ROW_TILE_MAX_ROWS, ROW_TILE_BYTES // (block_h * elem_size)))
    return CopyConfig(block_h, 4 if rows * block_h * elem_size <= 8192 else 8, rows)


def rows_per_copy_program(block_h: int, elem_size: int) -> int:
    """Rows per program of the 2-D chunk-sort copy: about 16 KiB moved per program."""
    return max(1, min(64, 16384 // (block_h * elem_size)))


@dataclass(frozen=True)
class MapTiles:
    """Tiles of the row-id map build: `num_blocks` programs (x expert blocks of BLOCK_E), each
    writing a token block of BLOCK_T = SUB_T * NUM_SUB tokens as NUM_SUB unrolled sub-tiles of
    SUB_T x BLOCK_E flags (4K-8K, SUB_T <= 256: a tall tile's scan costs registers).

    Each program needs the column totals of the whole map and its prefix over earlier blocks:
    - `single` (small maps, T x E <= 64K flags, E <= 1024): one launch; each program counts the
      whole map itself in COUNT_T x BLOCK_E tiles (~16K flags; at most 64 KiB read per program,
      from L2 after the first);
    - else two launches: a count pass (its sub-tile loads in flight together) writes the
      [num_blocks, E] count matrix, which each write-pass program reads in BLOCK_B x BLOCK_E
      tiles (num_blocks kept ~128 so that matrix stays small).
    """

    sub_t: int
    num_sub: int
    block_e: int
    num_blocks: int
    block_b: int
    num_warps: int
    single: bool = False
    count_t: int = 1

    @property
    def block_t(self) -> int:
        return self.sub_t * self.num_sub


MAP_SUB_FLAGS = 8192       # two-pass write sub-tile (SUB_T <= 256: tall tiles' scans cost registers)
MAP_MAX_BLOCKS = 128
MAP_MAX_SUB = 16
MAP_PREFIX_VALUES = 16384  # count-matrix tile of a write-pass program
MAP_SINGLE_MAX_FLAGS = 65536
MAP_SINGLE_SUB_FLAGS = 4096
MAP_COUNT_FLAGS = 16384


@functools.lru_cache(maxsize=256)
def map_tiles(num_tokens: int, num_experts: int) -> MapTiles:
    """Tiles of the row-id map build for T tokens and E experts.

    mixtral (T 8192, E 8): one launch, 16 programs of 512 x 8, each counting 2048 x 8 tiles;
    dsv3 (T 8192, E 256): two passes, 32 x 256 sub-tiles, 2 per program, 128 token blocks, the
    count matrix read in two 64 x 256 tiles. (Registers: the write programs are one per SM.)
    """
    block_e = min(next_pow2(num_experts), 1024)
    if num_experts <= 1024 and num_tokens * block_e <= MAP_SINGLE_MAX_FLAGS:
        sub_t = min(max(1, min(512, MAP_SINGLE_SUB_FLAGS // block_e)), next_pow2(num_tokens))
        count_t = min(max(1, MAP_COUNT_FLAGS // block_e), next_pow2(num_tokens))
        return MapTiles(sub_t, 1, block_e, cdiv(max(num_tokens, 1), sub_t), 1,
                        8 if sub_t * block_e >= 4096 else 4, single=True, count_t=count_t)
    sub_t = max(1, min(256, MAP_SUB_FLAGS // block_e))
    sub_blocks = cdiv(max(num_tokens, 1), sub_t)
    num_sub = min(MAP_MAX_SUB, next_pow2(cdiv(sub_blocks, MAP_MAX_BLOCKS)))
    num_blocks = cdiv(max(num_tokens, 1), sub_t * num_sub)
    block_b = min(next_pow2(num_blocks), max(1, MAP_PREFIX_VALUES // block_e))
    return MapTiles(sub_t, num_sub, block_e, num_blocks, block_b,
                    8 if sub_t * block_e >= 4096 else 4)


@functools.lru_cache(maxsize=256)
def router_tile(num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, num_warps) of the router: one tile holds whole rows of E scores."""
    if num_experts > MAX_ROUTER_EXPERTS:
        raise ValueError(f"num_experts={num_experts}: the Triton router supports at most "
                         f"{MAX_ROUTER_EXPERTS} (use --kernel-backend torch)")
    block_e = next_pow2(num_experts)
    block_t = max(1, min(64, 2048 // block_e))
    return block_t, block_e, 4 if block_t * block_e <= 2048 else 8


def device_asserts(tensor: torch.Tensor) -> bool:
    """Whether a kernel on `tensor`'s device checks its bound itself (CUDA: compiled with
    `DEVICE_ASSERT_OPTIONS`, fails at the next sync); else the caller calls
    `check_count_fits` after the launch (CPU and the interpreter: a clear ValueError)."""
    return tensor.is_cuda


def check_count_fits(count_1: torch.Tensor, limit: int, message: str) -> None:
    """Fail when the device count `count_1` [1] exceeds `limit`, without a host sync on CUDA.

    The host-side form of the in-kernel bound check (see `device_asserts`). CUDA:
    `torch._assert_async` (a device-side assert that surfaces at the next sync; the kernels
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
