"""Row-id map of the Triton permute: `build_row_id_map_triton`, the Triton twin of
`permutation.build_row_id_map` (same format: int32 [T, E], dest row or -1, expert-major rows,
ascending token within an expert), and the routed count a map built by `permute_triton` carries
to its unpermute (`_record_routed_count`, `_routed_count`).

Shape legend: T tokens, E experts, B token blocks of the map build, N permuted rows
(num_out_tokens).

Kernels (deterministic: no atomics, fixed summation orders), reading only the T*E routing
flags. Small maps (T x E <= 64K flags):
  `_map_small_kernel`, one launch: each program counts the whole map (column totals and its
  prefix), then writes its token block. Else two passes:
  1. `_map_count_kernel`: per (token block, expert) routed count [B, E].
  2. `_map_write_kernel`: each program reads the (small, ~128 x E) count matrix for its
     prefix (routed tokens of its experts in earlier blocks, and the expert start rows: the
     exclusive prefix over experts of the column totals), then block-local cumsums -> row
     ids. Also tokens per expert, the routed total, and, on CUDA with num_out_tokens given,
     the bound check as a device assert (no extra launch).
A map that routes more than N pairs (Transformer Engine issue 3346) is reported: by that device
assert on CUDA, by the caller's ValueError elsewhere. Loops with run-time bounds are `while`
loops and the kernels reference no module-level constants (see permutation_triton.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached
from . import triton_utils
from .triton_utils import DEVICE_ASSERT_OPTIONS, cdiv, check_int32_rows, map_tiles

_ROUTED_ATTR = "_epoverlap_routed_count"  # (total_1 [1] int32, map _version) set by permute


# ----------------------------------------------------------------------------- kernels

@launch_cached
@triton.jit(do_not_specialize=["T"])  # row counts vary per step: one variant
def _map_count_kernel(
    routing_map_ptr,  # [T, E] uint8 in: routing flags (bool storage)
    counts_ptr,       # [B, E] int32 out: routed tokens of token block b for expert e
    T, E,
    SUB_T: tl.constexpr, NUM_SUB: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_b, pid_e = tl.program_id(0), tl.program_id(1)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for s in tl.static_range(NUM_SUB):
        t = (pid_b * NUM_SUB + s) * SUB_T + tl.arange(0, SUB_T)
        mask = (t[:, None] < T) & (e[None, :] < E)
        flags = tl.load(routing_map_ptr + t[:, None].to(tl.int64) * E + e[None, :], mask=mask,
                        other=0)
        counts += tl.sum((flags != 0).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid_b * E + e, counts, mask=e < E)


@triton.jit
def _write_block_row_ids(routing_map_ptr, row_id_map_ptr, block_start, base, e, T, E,
                         SUB_T: tl.constexpr, NUM_SUB: tl.constexpr):
    """Row ids of the NUM_SUB x SUB_T tokens from `block_start`, for the experts `e`: a routed
    (t, e) gets base[e] (the rows of e before this block) plus the routed tokens of e above t
    in the block; -1 where not routed."""
    for s in tl.static_range(NUM_SUB):
        t = block_start + s * SUB_T + tl.arange(0, SUB_T)
        mask = (t[:, None] < T) & (e[None, :] < E)
        offs = t[:, None].to(tl.int64) * E + e[None, :]
        routed = (tl.load(routing_map_ptr + offs, mask=mask, other=0) != 0).to(tl.int32)
        dest = tl.cumsum(routed, axis=0) - routed + base[None, :]
        tl.store(row_id_map_ptr + offs, tl.where(routed != 0, dest, -1), mask=mask)
        base += tl.sum(routed, axis=0)


@triton.jit
def _store_routed_total(total_ptr, total, N, CHECK_N: tl.constexpr):
    """Store the routed (token, expert) count; with CHECK_N, device-assert it fits in N."""
    tl.store(total_ptr, total)
    if CHECK_N:
        tl.device_assert(total <= N, "permute: routing map routes more (token, expert) "
                         "pairs than num_out_tokens; refusing to write out of bounds")


@launch_cached
@triton.jit(do_not_specialize=["T", "B", "N"])  # row counts vary per step: one variant
def _map_write_kernel(
    routing_map_ptr,        # [T, E] uint8 in: routing flags
    counts_ptr,             # [B, E] int32 in: pass 1
    row_id_map_ptr,         # [T, E] int32 out: dest row of (t, e), -1 if not routed
    tokens_per_expert_ptr,  # [E] int64 out: routed tokens per expert (programs of block 0)
    total_ptr,              # [1] int32 out: routed (token, expert) pairs (program (0, last))
    T, E, B, N,
    SUB_T: tl.constexpr, NUM_SUB: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
    CHECK_N: tl.constexpr,  # device-assert total <= N (CUDA, num_out_tokens given)
):
    pid_b, pid_e = tl.program_id(0), tl.program_id(1)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    # Rows of the experts in earlier expert blocks (only when E > BLOCK_E).
    before = tl.zeros((), dtype=tl.int32)
    e0 = 0
    while e0 < pid_e * BLOCK_E:
        prev_e = e0 + tl.arange(0, BLOCK_E)
        b0 = 0
        while b0 < B:
            b = b0 + tl.arange(0, BLOCK_B)
            tile = tl.load(counts_ptr + b[:, None] * E + prev_e[None, :],
                           mask=(b[:, None] < B) & (prev_e[None, :] < E), other=0)
            before += tl.sum(tl.sum(tile, axis=1), axis=0)
            b0 += BLOCK_B
        e0 += BLOCK_E
    # Column totals of this expert block, and their part in token blocks before this one.
    col_total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    col_before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    b0 = 0
    while b0 < B:
        b = b0 + tl.arange(0, BLOCK_B)
        tile = tl.load(counts_ptr + b[:, None] * E + e[None, :],
                       mask=(b[:, None] < B) & (e[None, :] < E), other=0)
        col_total += tl.sum(tile, axis=0)
        col_before += tl.sum(tl.where(b[:, None] < pid_b, tile, 0), axis=0)
        b0 += BLOCK_B
    base = tl.cumsum(col_total, axis=0) - col_total + before + col_before
    _write_block_row_ids(routing_map_ptr, row_id_map_ptr, pid_b * NUM_SUB * SUB_T, base, e, T,
                         E, SUB_T, NUM_SUB)
    if pid_b == 0:
        tl.store(tokens_per_expert_ptr + e, col_total.to(tl.int64), mask=e < E)
        if pid_e == tl.num_programs(1) - 1:  # the last expert block knows every column total
            _store_routed_total(total_ptr, before + tl.sum(col_total, axis=0), N, CHECK_N)


@launch_cached
@triton.jit(do_not_specialize=["T", "N"])  # row counts vary per step: one variant
def _map_small_kernel(
    routing_map_ptr,        # [T, E] uint8 in: routing flags
    row_id_map_ptr,         # [T, E] int32 out: dest row of (t, e), -1 if not routed
    tokens_per_expert_ptr,  # [E] int64 out: routed tokens per expert (program 0)
    total_ptr,              # [1] int32 out: routed (token, expert) pairs (program 0)
    T, E, N,
    COUNT_T: tl.constexpr, SUB_T: tl.constexpr, NUM_SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHECK_N: tl.constexpr,  # device-assert total <= N (CUDA, num_out_tokens given)
):
    """Small maps in one launch: each program counts the whole (small) map itself, in
    COUNT_T x BLOCK_E tiles, for the column totals and its prefix, then writes its token block
    of NUM_SUB x SUB_T tokens (the count matrix of the two-pass build, without the pass)."""
    pid_b = tl.program_id(0)
    block_start = pid_b * NUM_SUB * SUB_T
    e = tl.arange(0, BLOCK_E)
    col_total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    col_before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    t0 = 0
    while t0 < T:  # `while`: unrolled, the compiler keeps every tile's bytes live and spills
        t = t0 + tl.arange(0, COUNT_T)
        flags = tl.load(routing_map_ptr + t[:, None].to(tl.int64) * E + e[None, :],
                        mask=(t[:, None] < T) & (e[None, :] < E), other=0)
        routed = (flags != 0).to(tl.int32)
        col_total += tl.sum(routed, axis=0)
        col_before += tl.sum(tl.where(t[:, None] < block_start, routed, 0), axis=0)
        t0 += COUNT_T
    base = tl.cumsum(col_total, axis=0) - col_total + col_before
    _write_block_row_ids(routing_map_ptr, row_id_map_ptr, block_start, base, e, T, E, SUB_T,
                         NUM_SUB)
    if pid_b == 0:
        tl.store(tokens_per_expert_ptr + e, col_total.to(tl.int64), mask=e < E)
        _store_routed_total(total_ptr, tl.sum(col_total, axis=0), N, CHECK_N)


def build_row_id_map_triton(routing_map_TE: torch.Tensor, num_out_tokens: Optional[int] = None,
                            *, tiles: Optional[triton_utils.MapTiles] = None):
    """[T, E] bool -> (row_id_map [T, E] int32, tokens_per_expert [E] int64, total [1] int32).

    Same map as `permutation.build_row_id_map`; one launch for small maps (T x E <= 64K
    flags), else two; no atomics, no host sync. With `num_out_tokens` on CUDA, the (last)
    launch also device-asserts total <= num_out_tokens (elsewhere the caller checks on the
    host: see `triton_utils.device_asserts`). `tiles` overrides `map_tiles` (tests).
    """
    flags_TE = routing_map_TE if routing_map_TE.dtype == torch.bool else routing_map_TE.bool()
    flags_TE = flags_TE.contiguous().view(torch.uint8)
    num_tokens, num_experts = flags_TE.shape
    check_int32_rows(num_tokens * num_experts, "tokens x experts")
    device = flags_TE.device
    row_id_map_TE = torch.empty(num_tokens, num_experts, dtype=torch.int32, device=device)
    tokens_per_expert_E = torch.empty(num_experts, dtype=torch.int64, device=device)
    total_1 = torch.empty(1, dtype=torch.int32, device=device)  # written by the (last) launch
    if num_tokens == 0 or num_experts == 0:
        return row_id_map_TE, tokens_per_expert_E.zero_(), total_1.zero_()
    tiles = tiles or map_tiles(num_tokens, num_experts)
    check = num_out_tokens is not None and triton_utils.device_asserts(flags_TE)
    limit = num_out_tokens if check else 0
    if tiles.single:
        _map_small_kernel[(tiles.num_blocks,)](
            flags_TE, row_id_map_TE, tokens_per_expert_E, total_1, num_tokens, num_experts,
            limit, COUNT_T=tiles.count_t, SUB_T=tiles.sub_t, NUM_SUB=tiles.num_sub,
            BLOCK_E=tiles.block_e, CHECK_N=check, num_warps=tiles.num_warps,
            **(DEVICE_ASSERT_OPTIONS if check else {}))
        return row_id_map_TE, tokens_per_expert_E, total_1
    counts_BE = torch.empty(tiles.num_blocks, num_experts, dtype=torch.int32, device=device)
    grid = (tiles.num_blocks, cdiv(num_experts, tiles.block_e))
    _map_count_kernel[grid](flags_TE, counts_BE, num_tokens, num_experts, SUB_T=tiles.sub_t,
                            NUM_SUB=tiles.num_sub, BLOCK_E=tiles.block_e,
                            num_warps=tiles.num_warps)
    _map_write_kernel[grid](
        flags_TE, counts_BE, row_id_map_TE, tokens_per_expert_E, total_1,
        num_tokens, num_experts, tiles.num_blocks, limit,
        SUB_T=tiles.sub_t, NUM_SUB=tiles.num_sub, BLOCK_E=tiles.block_e, BLOCK_B=tiles.block_b,
        CHECK_N=check, num_warps=tiles.num_warps, **(DEVICE_ASSERT_OPTIONS if check else {}))
    return row_id_map_TE, tokens_per_expert_E, total_1


# ----------------------------------------------------------------------------- routed count

def _record_routed_count(row_id_map_TE: torch.Tensor, total_1: torch.Tensor) -> None:
    """Attach the routed count [1] int32 to the map `permute_triton` built, with the map's
    version: its unpermute then reads the count from here instead of counting the map."""
    setattr(row_id_map_TE, _ROUTED_ATTR, (total_1, row_id_map_TE._version))


def _recorded_routed_count(row_id_map_TE: torch.Tensor) -> Optional[torch.Tensor]:
    """The routed count [1] int32 that `permute_triton` recorded on the map it built, unless the
    map was modified in place since (or was built elsewhere): then None."""
    recorded = getattr(row_id_map_TE, _ROUTED_ATTR, None)
    if recorded is not None and recorded[1] == row_id_map_TE._version:
        return recorded[0]
    return None


def _routed_count(row_id_map_TE: torch.Tensor) -> torch.Tensor:
    """Routed pairs of a row-id map, [1] int32 on its device, without a host sync: the recorded
    count (no launch), else two small torch ops."""
    recorded = _recorded_routed_count(row_id_map_TE)
    if recorded is not None:
        return recorded
    return (row_id_map_TE >= 0).sum(dtype=torch.int32).reshape(1)

