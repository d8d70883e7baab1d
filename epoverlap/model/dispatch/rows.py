"""The row moves the dispatches share: `move_rows` (rows moved by a one-to-one index, its grads
copied back), the fixed blocks of the budget sizing (`budget_indices`, `block_indices`,
`kept_counts`), and the block orders around the experts (`ExpertOrder`, `swap_blocks`,
`padded_block_transpose`), also read by the layer in waves (`model.waves`, `model.waves_budget`).

Shape legend as `model.dispatch.base`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from epoverlap.kernels import MoEOps
from epoverlap.kernels.rows import gather_rows_torch


class ExpertOrder:
    """Received rows in blocks (source rank, local expert) <-> (local expert, source rank),
    the order the grouped experts want, for `ranks` ranks and `experts` local experts (all of a
    rank's, or a wave's: `model.waves`). `counts_RL` [R, L] (device): rows per block."""

    def __init__(self, ranks: int, experts: int, device: torch.device):
        self._to_expert_major = index_tensor([r * experts + e for e in range(experts)
                                        for r in range(ranks)], device)
        self._to_rank_major = index_tensor([e * ranks + r for r in range(ranks)
                                      for e in range(experts)], device)

    def to_expert_major(self, ops: MoEOps, rows_MH, probs_M, counts_RL):
        """-> (rows, probs) in (local expert, source rank) blocks."""
        return ops.sort_chunks_by_idxs(rows_MH, counts_RL.reshape(-1), self._to_expert_major,
                                       probs_M)

    def to_rank_major(self, ops: MoEOps, rows_MH, counts_RL):
        """Back to the (source rank, local expert) blocks the rows arrived in."""
        return ops.sort_chunks_by_idxs(rows_MH, counts_RL.t().reshape(-1),
                                       self._to_rank_major)[0]


class _MoveRows(torch.autograd.Function):
    """Rows moved by an index whose valid entries are one-to-one (`inverse` maps back): the
    backward is the inverse move, a gather, so every grad is copied, never summed. `gather`:
    out[y] = src[index[y]], a zero row where index[y] < 0 (`MoEOps.gather_rows`)."""

    @staticmethod
    def forward(ctx, src_XH, index_Y, inverse_X, gather: Callable):
        ctx.save_for_backward(inverse_X)
        ctx.gather = gather
        return gather(src_XH, index_Y)

    @staticmethod
    def backward(ctx, grad_YH):
        (inverse_X,) = ctx.saved_tensors
        return ctx.gather(grad_YH, inverse_X), None, None, None


def move_rows(src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,
              gather: Callable = gather_rows_torch) -> torch.Tensor:
    """`_MoveRows` for [X, H] rows or [X] / [X, K] values; `gather`: the op table's
    `gather_rows` (the torch reference where no table is at hand)."""
    return _MoveRows.apply(src, index, inverse, gather)


def budget_indices(send_R: torch.Tensor, block_rows: int, num_rows: int):
    """Permuted rows (expert-major, so rank r's rows are one run) <-> fixed blocks of
    `block_rows` slots per rank. -> (send_index [R*C]: slot -> row or -1 (empty),
    return_index [N]: row -> slot or -1 (cut: the rank's rows overflow the block))."""
    send, return_N = block_indices(send_R.unsqueeze(1), [block_rows], num_rows)
    return send[0], return_N


def block_indices(send_RK: torch.Tensor, rows_K: Sequence[int], num_rows: int):
    """`budget_indices` for K blocks per rank (a layer in waves': one per group of experts):
    the permuted rows are runs (rank r, block k) in that order, run (r, k) going to rank r in
    block k, whose buffer holds `rows_K[k]` slots per
    rank. -> (send_index per block [R*C_k]: slot -> row or -1, return_index [N]: row -> slot
    of the K buffers laid end to end, or -1 (cut))."""
    ranks, blocks = send_RK.shape
    device = send_RK.device
    end_X = torch.cumsum(send_RK.reshape(-1), 0)
    start_RK = (end_X - send_RK.reshape(-1)).view(ranks, blocks)
    send = []
    for k, rows in enumerate(rows_K):
        slot_C = torch.arange(rows, device=device)
        send.append(torch.where(slot_C < send_RK[:, k:k + 1], start_RK[:, k:k + 1] + slot_C,
                                -1).reshape(-1))
    row_N = torch.arange(num_rows, device=device)
    run_N = torch.searchsorted(end_X, row_N, right=True)
    owned_N = run_N < ranks * blocks
    run_N = run_N.clamp(max=ranks * blocks - 1)
    offset_N = row_N - start_RK.reshape(-1).index_select(0, run_N)
    rank_N, block_N = run_N // blocks, run_N % blocks
    return_N, base = torch.full_like(row_N, -1), 0
    for k, rows in enumerate(rows_K):
        held_N = owned_N & (block_N == k) & (offset_N < rows)
        return_N = torch.where(held_N, base + rank_N * rows + offset_N, return_N)
        base += ranks * rows
    return send, return_N


def kept_counts(recv_RL: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Rows of each (source rank, local expert) that fit the source's block (its first
    `block_rows` rows, in expert order). [R, L] device."""
    end_RL = torch.cumsum(recv_RL, 1)
    return end_RL.clamp(max=block_rows) - (end_RL - recv_RL).clamp(max=block_rows)


def swap_blocks(rows: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Rows as blocks [A, B, C] -> [B, A, C] (a transpose of the two outer block indices)."""
    blocks = rows.view(*shape, *rows.shape[1:]).transpose(0, 1)
    return blocks.reshape(rows.shape)


def padded_block_transpose(outer: int, inner: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block orders for `sort_chunks_by_idxs`: blocks laid out (o, i) for o < `outer`, i <=
    `inner` (i == inner: o's padding) -> (i, o) for i < inner, then the paddings in o's order;
    and the order back."""
    with_pad = inner + 1
    forward = index_tensor([o * with_pad + i for i in range(inner) for o in range(outer)]
                           + [o * with_pad + inner for o in range(outer)], device)
    back = index_tensor([(i * outer + o) if i < inner else inner * outer + o
                         for o in range(outer) for i in range(with_pad)], device)
    return forward, back


def index_tensor(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
