"""Token permute / unpermute for dropless MoE dispatch: Triton kernels and their autograd.

Owns the Triton row-id map build and the differentiable `permute_triton` / `unpermute_triton`,
drop-in replacements of `permutation.permute_torch` / `unpermute_torch` (same signatures, same
row-id map format: int32 [T, E], dest row or -1, expert-major rows, ascending token within an
expert; see permutation.py).

Shape legend: T tokens, E experts, H hidden, N permuted rows (num_out_tokens), B token blocks
of the map build.

Kernels (all deterministic: no float atomics, fixed summation orders):
  row-id map, three passes reading only the T*E routing flags (no atomics):
    1. `_map_block_counts_kernel`: per (token block, expert) routed count.
    2. `_map_prefix_kernel` (a program per 32 experts): exclusive prefix of the block counts
       over the token blocks, and tokens per expert.
    3. `_map_write_kernel`: block-local exclusive cumsum + block prefix + expert start (the
       exclusive prefix of tokens per expert, recomputed per program: E values), total count.
  `_permute_kernel`: one program per (token, hidden block): load the row once, store it to each
    of the token's rows (and its probs); also zeroes rows past the routed count.
  `_unpermute_kernel`: one program per (token, hidden block): sum the token's rows in expert
    order in fp32 (times the merging probs), one store. Also the permute's backward.
  `_unpermute_bwd_kernel`: one program per token: grad rows = grad_out x merging prob, and the
    merging probs' grad <grad_out, row> accumulated over hidden blocks in a fixed order.

Loops with run-time bounds are `while` loops: the Triton 3.6 interpreter cannot take `range()` of
a run-time scalar under numpy >= 2.4 (it calls int() on a 1-element array); compiled code is the
same either way.

Graph safety: with `num_out_tokens` given nothing syncs the host and every shape is static. Rows
>= N are never written (a map that routes more than N pairs, Transformer Engine issue 3346, is
reported by `check_count_fits`: a device assert on CUDA, ValueError on CPU).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import triton_utils
from .triton_utils import check_int32_rows, map_tile, row_walk_config

# The row walk: a token's rows are visited in ascending row order, which is expert order
# (rows are expert-major), by repeatedly taking the smallest row id above the previous one;
# _NO_ROW (above every row id) ends the walk. Inlined, not a helper: the interpreter pays per
# call of a jit function.
_NO_ROW = tl.constexpr(2147483647)


# ----------------------------------------------------------------------------- row-id map

@triton.jit
def _map_block_counts_kernel(
    routing_map_ptr,   # [T, E] uint8 in: routing flags (bool storage)
    block_counts_ptr,  # [B, E] int32 out: routed tokens of token block b for expert e
    T, E,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_t, pid_e = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = (t[:, None] < T) & (e[None, :] < E)
    flags = tl.load(routing_map_ptr + t[:, None].to(tl.int64) * E + e[None, :], mask=mask,
                    other=0)
    counts = tl.sum((flags != 0).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + pid_t * E + e, counts, mask=e < E)


@triton.jit
def _map_prefix_kernel(
    block_counts_ptr,       # [B, E] int32 in: per-block counts (pass 1)
    block_offsets_ptr,      # [B, E] int32 out: routed tokens of expert e in blocks < b
    tokens_per_expert_ptr,  # [E] int64 out: routed tokens per expert
    B, E,
    BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """One program per BLOCK_E experts: exclusive prefix over the token blocks."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    col_sum = tl.zeros((BLOCK_E,), dtype=tl.int32)
    b0 = 0
    while b0 < B:  # `while`, not `range`: see the module docstring
        b = b0 + tl.arange(0, BLOCK_B)
        mask = (b[:, None] < B) & (e[None, :] < E)
        offs = b[:, None] * E + e[None, :]
        counts = tl.load(block_counts_ptr + offs, mask=mask, other=0)
        prefix = tl.cumsum(counts, axis=0) - counts + col_sum[None, :]
        tl.store(block_offsets_ptr + offs, prefix, mask=mask)
        col_sum += tl.sum(counts, axis=0)
        b0 += BLOCK_B
    tl.store(tokens_per_expert_ptr + e, col_sum.to(tl.int64), mask=e < E)


@triton.jit
def _map_write_kernel(
    routing_map_ptr,        # [T, E] uint8 in: routing flags
    block_offsets_ptr,      # [B, E] int32 in: pass 2
    tokens_per_expert_ptr,  # [E] int64 in: pass 2 (the expert start rows are its prefix)
    row_id_map_ptr,         # [T, E] int32 out: dest row of (t, e), -1 if not routed
    total_ptr,              # [1] int32 out: routed (token, expert) pairs (program (0, 0))
    T, E,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_t, pid_e = tl.program_id(0), tl.program_id(1)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    before = tl.zeros((), dtype=tl.int32)  # rows of the experts below this expert block
    e0 = 0
    while e0 < pid_e * BLOCK_E:
        prev_e = e0 + tl.arange(0, BLOCK_E)
        before += tl.sum(tl.load(tokens_per_expert_ptr + prev_e, mask=prev_e < E, other=0)
                         .to(tl.int32), axis=0)
        e0 += BLOCK_E
    per_expert = tl.load(tokens_per_expert_ptr + e, mask=e < E, other=0).to(tl.int32)
    start = tl.cumsum(per_expert, axis=0) - per_expert + before
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = (t[:, None] < T) & (e[None, :] < E)
    offs = t[:, None].to(tl.int64) * E + e[None, :]
    routed = (tl.load(routing_map_ptr + offs, mask=mask, other=0) != 0).to(tl.int32)
    base = tl.load(block_offsets_ptr + pid_t * E + e, mask=e < E, other=0) + start
    dest = tl.cumsum(routed, axis=0) - routed + base[None, :]
    tl.store(row_id_map_ptr + offs, tl.where(routed != 0, dest, -1), mask=mask)
    if (pid_t == 0) & (pid_e == 0):
        total = tl.zeros((), dtype=tl.int32)
        e0 = 0
        while e0 < E:
            all_e = e0 + tl.arange(0, BLOCK_E)
            total += tl.sum(tl.load(tokens_per_expert_ptr + all_e, mask=all_e < E, other=0)
                            .to(tl.int32), axis=0)
            e0 += BLOCK_E
        tl.store(total_ptr, total)


def build_row_id_map_triton(routing_map_TE: torch.Tensor):
    """[T, E] bool -> (row_id_map [T, E] int32, tokens_per_expert [E] int64, total [1] int32).

    Same map as `permutation.build_row_id_map`; three launches, no atomics, no host sync.
    """
    flags_TE = routing_map_TE if routing_map_TE.dtype == torch.bool else routing_map_TE.bool()
    flags_TE = flags_TE.contiguous().view(torch.uint8)
    num_tokens, num_experts = flags_TE.shape
    check_int32_rows(num_tokens * num_experts, "tokens x experts")
    block_t, block_e = map_tile(num_experts)
    num_blocks = triton.cdiv(num_tokens, block_t)
    device = flags_TE.device
    row_id_map_TE = torch.empty(num_tokens, num_experts, dtype=torch.int32, device=device)
    counts_BE = torch.empty(num_blocks, num_experts, dtype=torch.int32, device=device)
    offsets_BE = torch.empty_like(counts_BE)
    tokens_per_expert_E = torch.empty(num_experts, dtype=torch.int64, device=device)
    total_1 = torch.empty(1, dtype=torch.int32, device=device)  # written by pass 3
    if num_tokens == 0 or num_experts == 0:
        return row_id_map_TE, tokens_per_expert_E.zero_(), total_1.zero_()
    grid = (num_blocks, triton.cdiv(num_experts, block_e))
    warps = 8 if block_t >= 128 else 4  # tall tiles (few experts): a long scan per column
    _map_block_counts_kernel[grid](flags_TE, counts_BE, num_tokens, num_experts,
                                   BLOCK_T=block_t, BLOCK_E=block_e, num_warps=warps)
    prefix_e = min(block_e, 32)  # experts per pass-2 program: E / 32 programs scan in parallel
    _map_prefix_kernel[(triton.cdiv(num_experts, prefix_e),)](
        counts_BE, offsets_BE, tokens_per_expert_E, num_blocks, num_experts,
        BLOCK_B=max(1, min(512, 4096 // prefix_e)), BLOCK_E=prefix_e, num_warps=4)
    _map_write_kernel[grid](flags_TE, offsets_BE, tokens_per_expert_E, row_id_map_TE, total_1,
                            num_tokens, num_experts, BLOCK_T=block_t, BLOCK_E=block_e,
                            num_warps=warps)
    return row_id_map_TE, tokens_per_expert_E, total_1


# ----------------------------------------------------------------------------- row walk

@triton.jit
def _load_token_rows(row_id_map_ptr, t, E, N, BLOCK_E: tl.constexpr):
    """Token t's row ids [BLOCK_E] (-1: not routed, or at/after N: never touched)."""
    e = tl.arange(0, BLOCK_E)
    row_ids = tl.load(row_id_map_ptr + t.to(tl.int64) * E + e, mask=e < E, other=-1)
    return tl.where(row_ids < N, row_ids, -1)


@triton.jit
def _zero_tail_rows(out_ptr, total_ptr, t, T, N, H, h, h_mask, BLOCK_H: tl.constexpr):
    """Zero rows total + t, total + t + T, ... < N (rows past the routed count) at columns h."""
    r = tl.load(total_ptr) + t
    zeros = tl.zeros((BLOCK_H,), dtype=out_ptr.dtype.element_ty)
    while r < N:
        tl.store(out_ptr + r.to(tl.int64) * H + h, zeros, mask=h_mask)
        r += T


# ----------------------------------------------------------------------------- permute

@triton.jit
def _permute_kernel(
    tokens_ptr,      # [T, H] in: source rows
    row_id_map_ptr,  # [T, E] int32 in: dest row of (t, e), -1 if not routed
    probs_ptr,       # [T, E] in: routing probs (read if HAS_PROBS)
    out_ptr,         # [N, H] out: permuted rows; rows >= routed count are zeroed
    out_probs_ptr,   # [N] out: permuted probs (written if HAS_PROBS)
    total_ptr,       # [1] int32 in: routed pairs (map build)
    T, E, H, N,
    BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, HAS_PROBS: tl.constexpr,
):
    t, pid_h = tl.program_id(0), tl.program_id(1)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < H
    row_ids = _load_token_rows(row_id_map_ptr, t, E, N, BLOCK_E)
    x = tl.load(tokens_ptr + t.to(tl.int64) * H + h, mask=h_mask)
    r = tl.min(tl.where(row_ids >= 0, row_ids, _NO_ROW), axis=0)
    while r < _NO_ROW:
        tl.store(out_ptr + r.to(tl.int64) * H + h, x, mask=h_mask)
        r = tl.min(tl.where(row_ids > r, row_ids, _NO_ROW), axis=0)
    if HAS_PROBS:
        if pid_h == 0:
            e = tl.arange(0, BLOCK_E)
            p = tl.load(probs_ptr + t.to(tl.int64) * E + e, mask=e < E, other=0.0)
            tl.store(out_probs_ptr + row_ids, p, mask=row_ids >= 0)
            r = tl.load(total_ptr) + t
            while r < N:
                tl.store(out_probs_ptr + r, 0.0)
                r += T
    _zero_tail_rows(out_ptr, total_ptr, t, T, N, H, h, h_mask, BLOCK_H)


def _launch_permute(tokens_TH, row_id_map_TE, total_1, num_rows, probs_TE=None, config=None,
                    out_NH=None, out_probs_N=None):
    """permuted [N, H] (+ permuted probs [N]) from a row-id map. Skips rows >= N.

    `out_NH` / `out_probs_N`: optional preallocated contiguous outputs (tests use views of a
    larger buffer to check that nothing past N is written).
    """
    num_tokens, hidden = tokens_TH.shape
    num_experts = row_id_map_TE.shape[1]
    if out_NH is None:
        out_NH = tokens_TH.new_empty(num_rows, hidden)
    if out_probs_N is None and probs_TE is not None:
        out_probs_N = probs_TE.new_empty(num_rows)
    if num_tokens == 0:
        out_NH.zero_()
        return out_NH, None if out_probs_N is None else out_probs_N.zero_()
    config = config or row_walk_config(hidden, tokens_TH.element_size())
    grid = (num_tokens, max(1, triton.cdiv(hidden, config.block_h)))
    _permute_kernel[grid](
        tokens_TH, row_id_map_TE, probs_TE if probs_TE is not None else tokens_TH, out_NH,
        out_probs_N if out_probs_N is not None else out_NH, total_1,
        num_tokens, num_experts, hidden, num_rows,
        BLOCK_H=config.block_h, BLOCK_E=triton.next_power_of_2(num_experts),
        HAS_PROBS=probs_TE is not None, num_warps=config.num_warps)
    return out_NH, out_probs_N


# ----------------------------------------------------------------------------- unpermute

@triton.jit
def _unpermute_kernel(
    rows_ptr,        # [N, H] in: permuted rows
    row_id_map_ptr,  # [T, E] int32 in: row of (t, e), -1 if not routed
    probs_ptr,       # [T, E] in: merging probs (read if HAS_PROBS)
    out_ptr,         # [T, H] out: sum over the token's rows in expert order (x merging prob)
    row_vals_ptr,    # [N] in: per-row values gathered back to [T, E] (if GATHER_ROW_VALS)
    out_vals_ptr,    # [T, E] out: row_vals[row of (t, e)], 0 if not routed (if GATHER_ROW_VALS)
    T, E, H, N,
    BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, HAS_PROBS: tl.constexpr,
    GATHER_ROW_VALS: tl.constexpr,
):
    t, pid_h = tl.program_id(0), tl.program_id(1)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < H
    e = tl.arange(0, BLOCK_E)
    row_ids = _load_token_rows(row_id_map_ptr, t, E, N, BLOCK_E)
    if HAS_PROBS:
        p = tl.load(probs_ptr + t.to(tl.int64) * E + e, mask=e < E, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    r = tl.min(tl.where(row_ids >= 0, row_ids, _NO_ROW), axis=0)
    while r < _NO_ROW:
        x = tl.load(rows_ptr + r.to(tl.int64) * H + h, mask=h_mask, other=0.0).to(tl.float32)
        if HAS_PROBS:
            x = x * tl.sum(tl.where(row_ids == r, p, 0.0), axis=0)
        acc += x
        r = tl.min(tl.where(row_ids > r, row_ids, _NO_ROW), axis=0)
    tl.store(out_ptr + t.to(tl.int64) * H + h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)
    if GATHER_ROW_VALS:
        if pid_h == 0:
            vals = tl.load(row_vals_ptr + row_ids, mask=row_ids >= 0, other=0.0)
            tl.store(out_vals_ptr + t.to(tl.int64) * E + e, vals, mask=e < E)


def _launch_unpermute(rows_NH, row_id_map_TE, probs_TE=None, row_vals_N=None, config=None):
    """[T, H] sums of each token's rows (x merging probs); optionally row_vals [N] -> [T, E]."""
    num_rows, hidden = rows_NH.shape
    num_tokens, num_experts = row_id_map_TE.shape
    out_TH = rows_NH.new_empty(num_tokens, hidden)
    out_vals_TE = None if row_vals_N is None else row_vals_N.new_empty(num_tokens, num_experts)
    if num_tokens == 0:
        return out_TH, out_vals_TE
    config = config or row_walk_config(hidden, rows_NH.element_size())
    grid = (num_tokens, max(1, triton.cdiv(hidden, config.block_h)))
    _unpermute_kernel[grid](
        rows_NH, row_id_map_TE, probs_TE if probs_TE is not None else rows_NH, out_TH,
        row_vals_N if row_vals_N is not None else rows_NH,
        out_vals_TE if out_vals_TE is not None else out_TH,
        num_tokens, num_experts, hidden, num_rows,
        BLOCK_H=config.block_h, BLOCK_E=triton.next_power_of_2(num_experts),
        HAS_PROBS=probs_TE is not None, GATHER_ROW_VALS=row_vals_N is not None,
        num_warps=config.num_warps)
    return out_TH, out_vals_TE


@triton.jit
def _unpermute_bwd_kernel(
    grad_out_ptr,    # [T, H] in: grad of the unpermute output
    rows_ptr,        # [N, H] in: the forward's permuted rows
    row_id_map_ptr,  # [T, E] int32 in: row of (t, e), -1 if not routed
    probs_ptr,       # [T, E] in: merging probs
    grad_rows_ptr,   # [N, H] out: grad_out[t] * prob(t, e) at row (t, e); rows >= routed zeroed
    grad_probs_ptr,  # [T, E] out: <grad_out[t], rows[row(t, e)]>, 0 if not routed
    total_ptr,       # [1] int32 in: routed pairs
    T, E, H, N,
    BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    row_ids = _load_token_rows(row_id_map_ptr, t, E, N, BLOCK_E)
    p = tl.load(probs_ptr + t.to(tl.int64) * E + e, mask=e < E, other=0.0).to(tl.float32)
    dots = tl.zeros((BLOCK_E,), dtype=tl.float32)
    h0 = 0
    while h0 < H:
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < H
        g = tl.load(grad_out_ptr + t.to(tl.int64) * H + h, mask=h_mask, other=0.0).to(tl.float32)
        r = tl.min(tl.where(row_ids >= 0, row_ids, _NO_ROW), axis=0)
        while r < _NO_ROW:
            is_r = row_ids == r
            scaled = g * tl.sum(tl.where(is_r, p, 0.0), axis=0)
            tl.store(grad_rows_ptr + r.to(tl.int64) * H + h,
                     scaled.to(grad_rows_ptr.dtype.element_ty), mask=h_mask)
            x = tl.load(rows_ptr + r.to(tl.int64) * H + h, mask=h_mask, other=0.0)
            dots = tl.where(is_r, dots + tl.sum(g * x.to(tl.float32), axis=0), dots)
            r = tl.min(tl.where(row_ids > r, row_ids, _NO_ROW), axis=0)
        _zero_tail_rows(grad_rows_ptr, total_ptr, t, T, N, H, h, h_mask, BLOCK_H)
        h0 += BLOCK_H
    tl.store(grad_probs_ptr + t.to(tl.int64) * E + e,
             dots.to(grad_probs_ptr.dtype.element_ty), mask=e < E)


def _launch_unpermute_bwd(grad_out_TH, rows_NH, row_id_map_TE, probs_TE, config=None):
    """(grad rows [N, H], grad merging probs [T, E]) of the unpermute with merging probs."""
    num_rows, hidden = rows_NH.shape
    num_tokens, num_experts = row_id_map_TE.shape
    grad_rows_NH = grad_out_TH.new_empty(num_rows, hidden)
    grad_probs_TE = probs_TE.new_empty(num_tokens, num_experts)
    if num_tokens == 0:
        return grad_rows_NH.zero_(), grad_probs_TE.zero_()
    total_1 = (row_id_map_TE >= 0).sum().to(torch.int32).reshape(1)
    config = config or row_walk_config(hidden, grad_out_TH.element_size())
    _unpermute_bwd_kernel[(num_tokens,)](
        grad_out_TH, rows_NH, row_id_map_TE, probs_TE, grad_rows_NH, grad_probs_TE, total_1,
        num_tokens, num_experts, hidden, num_rows,
        BLOCK_H=config.block_h, BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=config.num_warps)
    return grad_rows_NH, grad_probs_TE


# ----------------------------------------------------------------------------- autograd

class _PermuteTriton(torch.autograd.Function):
    """permute forward; backward: grad tokens = unpermute of the grad rows, grad probs gathered."""

    @staticmethod
    def forward(ctx, tokens_TH, probs_TE, row_id_map_TE, total_1, num_rows):
        ctx.save_for_backward(row_id_map_TE)
        ctx.has_probs = probs_TE is not None
        return _launch_permute(tokens_TH, row_id_map_TE, total_1, num_rows, probs_TE)

    @staticmethod
    def backward(ctx, grad_permuted_NH, grad_permuted_probs_N):
        (row_id_map_TE,) = ctx.saved_tensors
        if not ctx.has_probs or grad_permuted_probs_N is None:
            grad_permuted_probs_N = None
        grad_tokens_TH, grad_probs_TE = _launch_unpermute(
            grad_permuted_NH.contiguous(), row_id_map_TE,
            row_vals_N=None if grad_permuted_probs_N is None
            else grad_permuted_probs_N.contiguous())
        return grad_tokens_TH, grad_probs_TE, None, None, None


class _UnpermuteTriton(torch.autograd.Function):
    """unpermute forward; backward: grad rows = permute of grad_out x probs, grad probs = dots."""

    @staticmethod
    def forward(ctx, rows_NH, probs_TE, row_id_map_TE):
        ctx.save_for_backward(rows_NH, probs_TE, row_id_map_TE)
        return _launch_unpermute(rows_NH, row_id_map_TE, probs_TE)[0]

    @staticmethod
    def backward(ctx, grad_out_TH):
        rows_NH, probs_TE, row_id_map_TE = ctx.saved_tensors
        grad_out_TH = grad_out_TH.contiguous()
        if probs_TE is None:
            total_1 = (row_id_map_TE >= 0).sum().to(torch.int32).reshape(1)
            grad_rows_NH, _ = _launch_permute(grad_out_TH, row_id_map_TE, total_1,
                                              rows_NH.shape[0])
            return grad_rows_NH, None, None
        grad_rows_NH, grad_probs_TE = _launch_unpermute_bwd(grad_out_TH, rows_NH, row_id_map_TE,
                                                            probs_TE)
        return grad_rows_NH, grad_probs_TE, None


def permute_triton(
    tokens_TH: torch.Tensor,
    routing_map_TE: torch.Tensor,
    probs_TE: Optional[torch.Tensor] = None,
    num_out_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Group token copies by expert. -> (permuted [N, H], permuted_probs [N] | None, row_id_map).

    Same contract as `permutation.permute_torch`. N = num_out_tokens (the routed count when None,
    which syncs the host); rows past the routed count are zero. No host sync when
    num_out_tokens is given. Differentiable in tokens and probs.
    """
    _check_permute_args(tokens_TH, routing_map_TE, probs_TE)
    row_id_map_TE, _, total_1 = build_row_id_map_triton(routing_map_TE)
    if num_out_tokens is None:
        num_out_tokens = int(total_1[0])
    check_int32_rows(num_out_tokens, "num_out_tokens")
    triton_utils.check_count_fits(
        total_1, num_out_tokens,
        f"permute: routing map routes more (token, expert) pairs than num_out_tokens="
        f"{num_out_tokens}; refusing to write out of bounds")
    probs_TE = None if probs_TE is None else probs_TE.contiguous()
    permuted_NH, permuted_probs_N = _PermuteTriton.apply(
        tokens_TH.contiguous(), probs_TE, row_id_map_TE, total_1, num_out_tokens)
    return permuted_NH, permuted_probs_N, row_id_map_TE


def unpermute_triton(
    permuted_NH: torch.Tensor,
    row_id_map_TE: torch.Tensor,
    restore_shape: Optional[torch.Size] = None,
    probs: Optional[torch.Tensor] = None,
    routing_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Inverse of permute: each token sums its rows, weighted by `probs` [T, E] if given. -> [T, H].

    Same contract as `permutation.unpermute_torch` (`routing_map` accepted and unused). Rows of
    the map at or past N are ignored. No host sync. Differentiable in permuted rows and probs.
    """
    del routing_map
    num_tokens = row_id_map_TE.shape[0]
    if restore_shape is not None and tuple(restore_shape)[0] != num_tokens:
        raise ValueError(f"restore_shape={tuple(restore_shape)} does not match the row-id map's "
                         f"{num_tokens} tokens")
    if probs is not None and tuple(probs.shape) != tuple(row_id_map_TE.shape):
        raise ValueError(f"probs shape {tuple(probs.shape)}: must match the row-id map "
                         f"{tuple(row_id_map_TE.shape)}")
    if permuted_NH.dim() != 2:
        raise ValueError(f"permuted_tokens must be [N, H], got shape {tuple(permuted_NH.shape)}")
    return _UnpermuteTriton.apply(permuted_NH.contiguous(),
                                  None if probs is None else probs.contiguous(),
                                  row_id_map_TE.to(torch.int32).contiguous())


def _check_permute_args(tokens_TH, routing_map_TE, probs_TE) -> None:
    if tokens_TH.dim() != 2 or routing_map_TE.dim() != 2:
        raise ValueError(f"tokens {tuple(tokens_TH.shape)} and routing_map "
                         f"{tuple(routing_map_TE.shape)} must both be 2-D ([T, H], [T, E])")
    if routing_map_TE.shape[0] != tokens_TH.shape[0]:
        raise ValueError(f"routing_map has {routing_map_TE.shape[0]} tokens, tokens has "
                         f"{tokens_TH.shape[0]}")
    if probs_TE is not None and tuple(probs_TE.shape) != tuple(routing_map_TE.shape):
        raise ValueError(f"probs shape {tuple(probs_TE.shape)}: must match routing_map "
                         f"{tuple(routing_map_TE.shape)}")
