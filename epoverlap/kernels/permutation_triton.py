"""Token permute / unpermute for dropless MoE dispatch: Triton kernels and their autograd.

Owns the differentiable `permute_triton` / `unpermute_triton`, drop-in replacements of
`permutation.permute_torch` / `unpermute_torch` (same signatures, same row-id map format: int32
[T, E], dest row or -1, expert-major rows, ascending token within an expert; see
permutation.py). The row-id map itself is built by permutation_map_triton.py.

Shape legend: T tokens, E experts, H hidden, N permuted rows (num_out_tokens), BT tokens per
row-walk program.

Kernels (all deterministic: no atomics, fixed summation orders):
  `_permute_kernel`: one program per (BT tokens, hidden block): load the rows once, store them
    to each of the tokens' rows (and their probs); also zeroes rows past the routed count.
  `_unpermute_kernel`: one program per (BT tokens, hidden block): sum each token's rows in
    expert order in fp32 (times the merging probs), one store. Also the permute's backward.
  `_unpermute_bwd_kernel`: one program per BT tokens: grad rows = grad_out x merging prob, and
    the merging probs' grad <grad_out, row> accumulated over hidden blocks in a fixed order.

The row walk: a token's rows are visited in ascending row order, which is expert order (rows
are expert-major), by repeatedly taking the smallest row id above the previous one; 2147483647
(above every row id) ends a token's walk. The backward walk loads the next row before using the
current one, so two row loads per token are in flight; the unpermute kernel does so only when
its config says `prefetch` (triton_utils.unpermute_config): with merging probs the second row
tile's registers cost more occupancy than the extra load in flight gains, while the permute's
backward, without the probs tile, has room for it at many experts. Sums keep their order either
way.

Loops with run-time bounds are `while` loops: the Triton 3.6 interpreter cannot take `range()` of
a run-time scalar under numpy >= 2.4 (it calls int() on a 1-element array); compiled code is the
same either way. The kernels reference no module-level constants: Triton re-checks every global
a kernel uses on each launch, host time spent on every call.

Graph safety: with `num_out_tokens` given nothing syncs the host and every shape is static. Rows
>= N are never written (a map that routes more than N pairs, Transformer Engine issue 3346, is
reported: by a device assert in the map kernel on CUDA, by a ValueError on CPU).

Launches (CUDA, num_out_tokens given): permute forward 2 for small maps (map + bound check,
copy), else 3 (map count, map write + bound check, copy), no torch ops; its backward 1;
unpermute forward 1; its backward 1 (the rows past the routed count are zeroed with the count
recorded by the permute that built the map; 2 small torch ops more for a map built elsewhere).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached
from . import triton_utils
from .permutation_map_triton import (
    _record_routed_count, _recorded_routed_count, _routed_count, build_row_id_map_triton)
from .triton_utils import cdiv, check_int32_rows, next_pow2, permute_config, unpermute_config


# ----------------------------------------------------------------------------- row walk

@triton.jit
def _load_token_rows(row_id_map_ptr, t, t_ok, E, N, BLOCK_E: tl.constexpr):
    """Row ids [BT, BLOCK_E] of tokens t [BT] (-1: not routed, padding, or at/after N)."""
    e = tl.arange(0, BLOCK_E)
    row_ids = tl.load(row_id_map_ptr + t[:, None].to(tl.int64) * E + e[None, :],
                      mask=t_ok[:, None] & (e[None, :] < E), other=-1)
    return tl.where(row_ids < N, row_ids, -1)


@triton.jit
def _zero_tail_rows(out_ptr, total, t, t_ok, T, N, H, h, h_mask, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """Zero rows total + t, total + t + T, ... < N (rows past the routed count) at columns h."""
    r = tl.where(t_ok, total + t, N)
    zeros = tl.zeros((BLOCK_T, BLOCK_H), dtype=out_ptr.dtype.element_ty)
    while tl.min(r, axis=0) < N:
        tl.store(out_ptr + r[:, None].to(tl.int64) * H + h[None, :], zeros,
                 mask=(r < N)[:, None] & h_mask[None, :])
        r += T


# ----------------------------------------------------------------------------- permute

@launch_cached
@triton.jit(do_not_specialize=["T", "N"])  # row counts vary per step: one variant
def _permute_kernel(
    tokens_ptr,      # [T, H] in: source rows
    row_id_map_ptr,  # [T, E] int32 in: dest row of (t, e), -1 if not routed
    probs_ptr,       # [T, E] in: routing probs (read if HAS_PROBS)
    out_ptr,         # [N, H] out: permuted rows; rows >= routed count are zeroed
    out_probs_ptr,   # [N] out: permuted probs (written if HAS_PROBS)
    total_ptr,       # [1] int32 in: routed pairs (map build)
    T, E, H, N,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    pid_t, pid_h = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < H
    row_ids = _load_token_rows(row_id_map_ptr, t, t_ok, E, N, BLOCK_E)
    total = tl.load(total_ptr)
    x = tl.load(tokens_ptr + t[:, None].to(tl.int64) * H + h[None, :],
                mask=t_ok[:, None] & h_mask[None, :])
    r = tl.min(tl.where(row_ids >= 0, row_ids, 2147483647), axis=1)
    while tl.min(r, axis=0) < 2147483647:
        tl.store(out_ptr + r[:, None].to(tl.int64) * H + h[None, :], x,
                 mask=(r < 2147483647)[:, None] & h_mask[None, :])
        r = tl.min(tl.where(row_ids > r[:, None], row_ids, 2147483647), axis=1)
    if HAS_PROBS:
        if pid_h == 0:
            e = tl.arange(0, BLOCK_E)
            p = tl.load(probs_ptr + t[:, None].to(tl.int64) * E + e[None, :],
                        mask=t_ok[:, None] & (e[None, :] < E), other=0.0)
            tl.store(out_probs_ptr + row_ids, p, mask=row_ids >= 0)
            tail = tl.where(t_ok, total + t, N)
            while tl.min(tail, axis=0) < N:
                tl.store(out_probs_ptr + tail, tl.zeros((BLOCK_T,), out_probs_ptr.dtype.element_ty),
                         mask=tail < N)
                tail += T
    _zero_tail_rows(out_ptr, total, t, t_ok, T, N, H, h, h_mask, BLOCK_T, BLOCK_H)


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
    config = config or permute_config(hidden, tokens_TH.element_size(), num_experts)
    grid = (cdiv(num_tokens, config.block_t), max(1, cdiv(hidden, config.block_h)))
    _permute_kernel[grid](
        tokens_TH, row_id_map_TE, probs_TE if probs_TE is not None else tokens_TH, out_NH,
        out_probs_N if out_probs_N is not None else out_NH, total_1,
        num_tokens, num_experts, hidden, num_rows,
        BLOCK_T=config.block_t, BLOCK_H=config.block_h, BLOCK_E=next_pow2(num_experts),
        HAS_PROBS=probs_TE is not None, num_warps=config.num_warps)
    return out_NH, out_probs_N


# ----------------------------------------------------------------------------- unpermute

@launch_cached
@triton.jit(do_not_specialize=["T", "N"])  # row counts vary per step: one variant
def _unpermute_kernel(
    rows_ptr,        # [N, H] in: permuted rows
    row_id_map_ptr,  # [T, E] int32 in: row of (t, e), -1 if not routed
    probs_ptr,       # [T, E] in: merging probs (read if HAS_PROBS)
    out_ptr,         # [T, H] out: sum over the token's rows in expert order (x merging prob)
    row_vals_ptr,    # [N] in: per-row values gathered back to [T, E] (if GATHER_ROW_VALS)
    out_vals_ptr,    # [T, E] out: row_vals[row of (t, e)], 0 if not routed (if GATHER_ROW_VALS)
    T, E, H, N,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_PROBS: tl.constexpr, GATHER_ROW_VALS: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid_t, pid_h = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < H
    e = tl.arange(0, BLOCK_E)
    row_ids = _load_token_rows(row_id_map_ptr, t, t_ok, E, N, BLOCK_E)
    if HAS_PROBS:
        p = tl.load(probs_ptr + t[:, None].to(tl.int64) * E + e[None, :],
                    mask=t_ok[:, None] & (e[None, :] < E), other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    r = tl.min(tl.where(row_ids >= 0, row_ids, 2147483647), axis=1)
    if PREFETCH:
        x = tl.load(rows_ptr + r[:, None].to(tl.int64) * H + h[None, :],
                    mask=(r < 2147483647)[:, None] & h_mask[None, :], other=0.0)
    while tl.min(r, axis=0) < 2147483647:
        r_next = tl.min(tl.where(row_ids > r[:, None], row_ids, 2147483647), axis=1)
        if PREFETCH:  # the next rows' load is issued before this row is used
            x_next = tl.load(rows_ptr + r_next[:, None].to(tl.int64) * H + h[None, :],
                             mask=(r_next < 2147483647)[:, None] & h_mask[None, :], other=0.0)
        else:
            x = tl.load(rows_ptr + r[:, None].to(tl.int64) * H + h[None, :],
                        mask=(r < 2147483647)[:, None] & h_mask[None, :], other=0.0)
        xf = x.to(tl.float32)
        if HAS_PROBS:
            xf = xf * tl.sum(tl.where(row_ids == r[:, None], p, 0.0), axis=1)[:, None]
        acc += xf  # tokens whose walk ended add an exact +0
        r = r_next
        if PREFETCH:
            x = x_next
    tl.store(out_ptr + t[:, None].to(tl.int64) * H + h[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & h_mask[None, :])
    if GATHER_ROW_VALS:
        if pid_h == 0:
            vals = tl.load(row_vals_ptr + row_ids, mask=row_ids >= 0, other=0.0)
            tl.store(out_vals_ptr + t[:, None].to(tl.int64) * E + e[None, :], vals,
                     mask=t_ok[:, None] & (e[None, :] < E))


def _launch_unpermute(rows_NH, row_id_map_TE, probs_TE=None, row_vals_N=None, config=None):
    """[T, H] sums of each token's rows (x merging probs); optionally row_vals [N] -> [T, E]."""
    num_rows, hidden = rows_NH.shape
    num_tokens, num_experts = row_id_map_TE.shape
    out_TH = rows_NH.new_empty(num_tokens, hidden)
    out_vals_TE = None if row_vals_N is None else row_vals_N.new_empty(num_tokens, num_experts)
    if num_tokens == 0:
        return out_TH, out_vals_TE
    kind = "forward" if row_vals_N is None else "permute_backward"
    config = config or unpermute_config(hidden, rows_NH.element_size(), num_experts, kind)
    grid = (cdiv(num_tokens, config.block_t), max(1, cdiv(hidden, config.block_h)))
    _unpermute_kernel[grid](
        rows_NH, row_id_map_TE, probs_TE if probs_TE is not None else rows_NH, out_TH,
        row_vals_N if row_vals_N is not None else rows_NH,
        out_vals_TE if out_vals_TE is not None else out_TH,
        num_tokens, num_experts, hidden, num_rows,
        BLOCK_T=config.block_t, BLOCK_H=config.block_h, BLOCK_E=next_pow2(num_experts),
        HAS_PROBS=probs_TE is not None, GATHER_ROW_VALS=row_vals_N is not None,
        PREFETCH=config.prefetch, num_warps=config.num_warps)
    return out_TH, out_vals_TE


@launch_cached
@triton.jit(do_not_specialize=["T", "N"])  # row counts vary per step: one variant
def _unpermute_bwd_kernel(
    grad_out_ptr,    # [T, H] in: grad of the unpermute output
    rows_ptr,        # [N, H] in: the forward's permuted rows
    row_id_map_ptr,  # [T, E] int32 in: row of (t, e), -1 if not routed
    probs_ptr,       # [T, E] in: merging probs
    grad_rows_ptr,   # [N, H] out: grad_out[t] * prob(t, e) at row (t, e); rows >= routed zeroed
    grad_probs_ptr,  # [T, E] out: <grad_out[t], rows[row(t, e)]>, 0 if not routed
    total_ptr,       # [1] int32 in: routed pairs
    T, E, H, N,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, BLOCK_E)
    row_ids = _load_token_rows(row_id_map_ptr, t, t_ok, E, N, BLOCK_E)
    p = tl.load(probs_ptr + t[:, None].to(tl.int64) * E + e[None, :],
                mask=t_ok[:, None] & (e[None, :] < E), other=0.0).to(tl.float32)
    total = tl.load(total_ptr)
    first = tl.min(tl.where(row_ids >= 0, row_ids, 2147483647), axis=1)
    dots = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    h0 = 0
    while h0 < H:
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < H
        g = tl.load(grad_out_ptr + t[:, None].to(tl.int64) * H + h[None, :],
                    mask=t_ok[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
        r = first
        x = tl.load(rows_ptr + r[:, None].to(tl.int64) * H + h[None, :],
                    mask=(r < 2147483647)[:, None] & h_mask[None, :], other=0.0)
        while tl.min(r, axis=0) < 2147483647:
            # the next rows' load is issued before this row is used: two loads in flight
            r_next = tl.min(tl.where(row_ids > r[:, None], row_ids, 2147483647), axis=1)
            x_next = tl.load(rows_ptr + r_next[:, None].to(tl.int64) * H + h[None, :],
                             mask=(r_next < 2147483647)[:, None] & h_mask[None, :], other=0.0)
            is_r = row_ids == r[:, None]
            scaled = g * tl.sum(tl.where(is_r, p, 0.0), axis=1)[:, None]
            tl.store(grad_rows_ptr + r[:, None].to(tl.int64) * H + h[None, :],
                     scaled.to(grad_rows_ptr.dtype.element_ty),
                     mask=(r < 2147483647)[:, None] & h_mask[None, :])
            dot = tl.sum(g * x.to(tl.float32), axis=1)
            dots = tl.where(is_r, dots + dot[:, None], dots)
            r = r_next
            x = x_next
        _zero_tail_rows(grad_rows_ptr, total, t, t_ok, T, N, H, h, h_mask, BLOCK_T, BLOCK_H)
        h0 += BLOCK_H
    tl.store(grad_probs_ptr + t[:, None].to(tl.int64) * E + e[None, :],
             dots.to(grad_probs_ptr.dtype.element_ty), mask=t_ok[:, None] & (e[None, :] < E))


def _launch_unpermute_bwd(grad_out_TH, rows_NH, row_id_map_TE, probs_TE, config=None,
                          total_1=None):
    """(grad rows [N, H], grad merging probs [T, E]) of the unpermute with merging probs."""
    num_rows, hidden = rows_NH.shape
    num_tokens, num_experts = row_id_map_TE.shape
    grad_rows_NH = grad_out_TH.new_empty(num_rows, hidden)
    grad_probs_TE = probs_TE.new_empty(num_tokens, num_experts)
    if num_tokens == 0:
        return grad_rows_NH.zero_(), grad_probs_TE.zero_()
    if total_1 is None:
        total_1 = _routed_count(row_id_map_TE)
    config = config or unpermute_config(hidden, grad_out_TH.element_size(), num_experts,
                                        "backward")
    _unpermute_bwd_kernel[(cdiv(num_tokens, config.block_t),)](
        grad_out_TH, rows_NH, row_id_map_TE, probs_TE, grad_rows_NH, grad_probs_TE, total_1,
        num_tokens, num_experts, hidden, num_rows,
        BLOCK_T=config.block_t, BLOCK_H=config.block_h, BLOCK_E=next_pow2(num_experts),
        num_warps=config.num_warps)
    return grad_rows_NH, grad_probs_TE


# ----------------------------------------------------------------------------- autograd

class _PermuteTriton(torch.autograd.Function):
    """permute forward; backward: grad tokens = unpermute of the grad rows, grad probs gathered."""

    @staticmethod
    def forward(ctx, tokens_TH, probs_TE, row_id_map_TE, total_1, num_rows):
        ctx.set_materialize_grads(False)  # no zero-filled grads for unused outputs
        ctx.save_for_backward(row_id_map_TE)
        ctx.has_probs = probs_TE is not None
        ctx.tokens_meta = (tokens_TH.shape, tokens_TH.dtype, tokens_TH.device)
        return _launch_permute(tokens_TH, row_id_map_TE, total_1, num_rows, probs_TE)

    @staticmethod
    def backward(ctx, grad_permuted_NH, grad_permuted_probs_N):
        (row_id_map_TE,) = ctx.saved_tensors
        if not ctx.has_probs:
            grad_permuted_probs_N = None
        if grad_permuted_NH is None:
            if grad_permuted_probs_N is None:
                return None, None, None, None, None
            shape, dtype, device = ctx.tokens_meta
            grad_permuted_NH = torch.zeros(grad_permuted_probs_N.shape[0], shape[1],
                                           dtype=dtype, device=device)
        grad_tokens_TH, grad_probs_TE = _launch_unpermute(
            grad_permuted_NH.contiguous(), row_id_map_TE,
            row_vals_N=None if grad_permuted_probs_N is None
            else grad_permuted_probs_N.contiguous())
        return grad_tokens_TH, grad_probs_TE, None, None, None


class _UnpermuteTriton(torch.autograd.Function):
    """unpermute forward; backward: grad rows = permute of grad_out x probs, grad probs = dots."""

    @staticmethod
    def forward(ctx, rows_NH, probs_TE, row_id_map_TE, total_1):
        ctx.save_for_backward(rows_NH, probs_TE, row_id_map_TE)
        ctx.total_1 = total_1
        return _launch_unpermute(rows_NH, row_id_map_TE, probs_TE)[0]

    @staticmethod
    def backward(ctx, grad_out_TH):
        rows_NH, probs_TE, row_id_map_TE = ctx.saved_tensors
        grad_out_TH = grad_out_TH.contiguous()
        total_1 = ctx.total_1 if ctx.total_1 is not None else _routed_count(row_id_map_TE)
        if probs_TE is None:
            grad_rows_NH, _ = _launch_permute(grad_out_TH, row_id_map_TE, total_1,
                                              rows_NH.shape[0])
            return grad_rows_NH, None, None, None
        grad_rows_NH, grad_probs_TE = _launch_unpermute_bwd(grad_out_TH, rows_NH, row_id_map_TE,
                                                            probs_TE, total_1=total_1)
        return grad_rows_NH, grad_probs_TE, None, None


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
    if num_out_tokens is not None:
        check_int32_rows(num_out_tokens, "num_out_tokens")
    row_id_map_TE, _, total_1 = build_row_id_map_triton(routing_map_TE, num_out_tokens)
    if num_out_tokens is None:
        num_out_tokens = int(total_1[0])
        check_int32_rows(num_out_tokens, "num_out_tokens")
    elif not triton_utils.device_asserts(row_id_map_TE):  # CUDA: asserted by the map kernel
        triton_utils.check_count_fits(
            total_1, num_out_tokens,
            f"permute: routing map routes more (token, expert) pairs than num_out_tokens="
            f"{num_out_tokens}; refusing to write out of bounds")
    # The unpermute of this map reads its routed count from here (see `_routed_count`).
    _record_routed_count(row_id_map_TE, total_1)
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
    total_1 = _recorded_routed_count(row_id_map_TE)  # for the backward's zeroed tail rows
    return _UnpermuteTriton.apply(permuted_NH.contiguous(),
                                  None if probs is None else probs.contiguous(),
                                  row_id_map_TE.to(torch.int32).contiguous(), total_1)


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
