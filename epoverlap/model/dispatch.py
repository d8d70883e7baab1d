"""The MoE token dispatch: one strategy class per dispatch mode behind one interface.

Owns `TokenDispatcher` (the interface the MoE layer's nodes call: `preprocess`,
`start_split_exchange`, `dispatch`, `sort_by_expert`, `unsort`, `combine`, and `reads_host`,
whether the dispatch reads split sizes on the host) and its subclasses that send one row per
chosen expert, one per mode (`model.dispatch_dedup.make_dispatcher` picks one from the
config's `DispatchMode`, `epoverlap.config.dispatch`). Also `DispatchMeta` (what the steps
after the dispatch need), `ExpertOrder` (received blocks to the experts' order and back, shared
with the layer in waves, `model.waves`) and the row moves the modes share; the budget mode's
buffer size and overflow record is `model.budget.DispatchBudget`.

Modes (`DispatchMode.name`), and whether the host reads the device in the dispatch:
  dropless         `HostSplitDispatcher`: each rank sends what it routed; split sizes read on
                   the host before the all-to-all (one sync per layer and microbatch), from an
                   exchange started when the router has counted (`start_split_exchange`, at
                   the end of the `attn` node), so the read waits for that exchange alone.
  capacity         `HostSplitDispatcher` too: Megatron-core's --moe-expert-capacity-factor;
                   the router drops routed (token, expert) pairs beyond an expert's capacity
                   (`Router.step_dropped`); the split sizes are still data dependent.
  capacity_padded  `PaddedCapacityDispatcher`: + --moe-pad-expert-input-to-capacity: every
                   expert gets exactly `capacity` rows from every rank (unrouted tokens with
                   prob 0 fill the gap), so every split size is known from shapes: no host read.
  budget           `BudgetDispatcher`: --moe-dispatch-budget: dropless, but every rank sends
                   every rank one block of a fixed size (`DispatchBudget`): equal splits, counts
                   kept on the device; a dispatch whose rows for one rank exceed the block is
                   recorded on the device (`DispatchBudget.demand_rows`) and the trainer reruns
                   the step at a larger budget: no token is ever silently dropped, no host read
                   inside the step.
The dispatches that send a token once per rank, or once per host and then per rank, are
`model.dispatch_dedup`, with `make_dispatcher`, which picks the strategy of every mode.
The preprocess never reads the host in any mode (its row count is static: tokens x topk, or
experts x capacity padded); only the torch reference permute does (`preprocess_syncs_host`).

Probabilities are applied inside the expert activation (h = silu(gate) * up * prob, in fp32),
so the combine's unpermute sums rows without merging probs.

Shape legend: T local tokens, H hidden, E global experts, L local experts (E / ep), R EP ranks,
N = T * topk permuted rows, M rows received by this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from epoverlap.config.dispatch import DispatchMode, padded_rows
from epoverlap.kernels import MoEOps
from epoverlap.kernels.rows import gather_rows_torch
from epoverlap.model.budget import DispatchBudget
from epoverlap.parallel.comm import ExpertComm, SplitExchange, all_to_all


@dataclass
class DispatchMeta:
    """What the steps after the dispatch need. Split sizes are host lists where the mode reads
    them on the host (dropless, capacity) or knows them from shapes (capacity_padded), None for
    equal blocks; `recv_counts_RL` is always on the device."""

    input_splits: Optional[list[int]]  # rows sent to each EP rank
    output_splits: Optional[list[int]]  # rows received from each EP rank
    recv_counts_RL: torch.Tensor  # [R, L] device: rows received per (source rank, local expert)
    tokens_per_local_expert: Optional[list[int]]  # host, summed over source ranks; None: device
    capacity: Optional[int] = None  # capacity_padded: rows per (rank, expert)
    block_rows: Optional[int] = None  # budget: rows per (source rank) block
    send_index: Optional[torch.Tensor] = None  # budget [R*C]: block slot -> permuted row or -1
    return_index: Optional[torch.Tensor] = None  # budget [N]: permuted row -> block slot or -1
    expert_rows: Optional[int] = None  # budget once per rank: the local experts' rows (static)


class TokenDispatcher:
    """The interface of every dispatch mode, in the steps the scheduler runs as nodes:
    `preprocess` (in `attn`), `start_split_exchange` (end of `attn`, host-split modes only),
    `dispatch` (the `dispatch` node), `sort_by_expert` and `unsort` (around the experts in
    `mlp`), `combine` (the `combine` node). `reads_host`: whether `dispatch` reads split sizes
    on the host (the layer then hands it the early exchange, and graphs cannot hold it).
    `once_per_rank`: whether the preprocess's row-id map is [T, R] (token, rank), not [T, E].
    Subclasses define `dispatch`, `sort_by_expert` and `unsort`; the rest is shared."""

    reads_host = False
    once_per_rank = False

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device, mode: DispatchMode,
                 budget: Optional[DispatchBudget] = None):
        self.comm, self.ops, self.topk, self.mode, self.budget = comm, ops, topk, mode, budget
        self.num_experts = num_experts
        self.num_local = num_experts // comm.size

    @property
    def name(self) -> str:
        return self.mode.name

    @property
    def drops_tokens(self) -> bool:
        """Whether the router drops pairs over an expert's capacity (counted per step)."""
        return self.mode.drops_tokens

    def permuted_rows(self, num_tokens: int) -> int:
        """Rows of the permuted tokens: tokens x topk (static: dropped pairs leave rows past
        the routed count at zero)."""
        return num_tokens * self.topk

    def preprocess(self, hidden_TH, probs_TE, routing_map_TE):
        """Permute token copies into expert-major rows (a static row count). -> (rows [N, H],
        their probs [N], row-id map [T, E])."""
        return self.ops.permute(hidden_TH, routing_map_TE, probs_TE,
                                num_out_tokens=self.permuted_rows(hidden_TH.shape[0]))

    def start_split_exchange(self, counts_E, row_id_map=None) -> Optional[SplitExchange]:
        """Start the exchange of the split sizes `dispatch` reads on the host (None: this mode
        reads none)."""
        return None

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        """All-to-all of tokens and probs: (recv_MH, recv_probs_M, DispatchMeta)."""
        raise NotImplementedError

    def sort_by_expert(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        """Rows arrive (source rank, local expert); the experts want (local expert, rank).
        -> (rows, their probs, what `unsort` needs, or None)."""
        raise NotImplementedError

    def unsort(self, expert_out_MH, meta: DispatchMeta, local_row_id_map=None):
        """Back to the order rows arrived in."""
        raise NotImplementedError

    def combine(self, expert_out_MH, meta: DispatchMeta, row_id_map_TE):
        """All-to-all back, then each token sums its rows (probs were applied by the experts)."""
        returned_NH = all_to_all(self.comm, expert_out_MH, meta.input_splits,
                                 meta.output_splits)
        return self.ops.unpermute(self._returned_rows(returned_NH, meta), row_id_map_TE)

    def _returned_rows(self, returned_NH, meta: DispatchMeta):
        """The rows the combine's all-to-all brought back, in the preprocess's order."""
        return returned_NH


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


class HostSplitDispatcher(TokenDispatcher):
    """dropless and capacity: split sizes exchanged early (`start_split_exchange`) and read on
    the host in `dispatch`; blocks sorted by the received counts."""

    reads_host = True

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device, mode: DispatchMode,
                 budget: Optional[DispatchBudget] = None):
        super().__init__(comm, num_experts, topk, ops, device, mode, budget)
        self._order = ExpertOrder(comm.size, self.num_local, device)

    def start_split_exchange(self, counts_E, row_id_map=None) -> SplitExchange:
        """Called when the router has counted, so the exchange runs while other work is issued,
        and handed to `dispatch` (parallel.comm, `SplitExchange`)."""
        return self.comm.start_split_exchange(counts_E)

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        """Takes the `exchange` started earlier, or starts it here from `counts_E`; reads the
        exchanged split sizes on the host (the one host sync), then sends."""
        if exchange is None:
            exchange = self._exchange_now(counts_E)
        send_R, recv_R, recv_L = exchange.read()
        meta = DispatchMeta(input_splits=send_R, output_splits=recv_R,
                            recv_counts_RL=exchange.recv_RL, tokens_per_local_expert=recv_L)
        routed = sum(meta.input_splits)
        if routed != permuted_NH.shape[0]:  # the rows past the routed ones are not sent
            permuted_NH, permuted_probs_N = permuted_NH[:routed], permuted_probs_N[:routed]
        recv_MH = all_to_all(self.comm, permuted_NH, meta.output_splits, meta.input_splits)
        recv_probs_M = all_to_all(self.comm, permuted_probs_N, meta.output_splits,
                                  meta.input_splits)
        return recv_MH, recv_probs_M, meta

    def _exchange_now(self, counts_E) -> SplitExchange:
        return self.comm.start_split_exchange(counts_E)

    def sort_by_expert(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        if self.comm.size == 1:
            return recv_MH, recv_probs_M, None
        return self._order.to_expert_major(self.ops, recv_MH, recv_probs_M,
                                           meta.recv_counts_RL) + (None,)

    def unsort(self, expert_out_MH, meta: DispatchMeta, local_row_id_map=None):
        if self.comm.size == 1:
            return expert_out_MH
        return self._order.to_rank_major(self.ops, expert_out_MH, meta.recv_counts_RL)


class PaddedCapacityDispatcher(TokenDispatcher):
    """capacity_padded: every (rank, expert) pair holds `capacity` rows, so the split sizes
    come from shapes (no host read) and the expert sort is a transpose of equal blocks
    (Megatron-core's)."""

    def permuted_rows(self, num_tokens: int) -> int:
        """Experts x capacity: every expert's capacity, padded."""
        return padded_rows(num_tokens, self.topk, self.num_experts, self.mode.capacity_factor)

    def preprocess(self, hidden_TH, probs_TE, routing_map_TE):
        return self.ops.permute(hidden_TH, routing_map_TE, probs_TE,
                                num_out_tokens=self.permuted_rows(hidden_TH.shape[0]),
                                drop_and_pad=True)

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        ranks, local = self.comm.size, self.num_local
        capacity = permuted_NH.shape[0] // self.num_experts
        splits = [local * capacity] * ranks
        meta = DispatchMeta(input_splits=splits, output_splits=splits,
                            recv_counts_RL=torch.full((ranks, local), capacity,
                                                      dtype=torch.int64,
                                                      device=permuted_NH.device),
                            tokens_per_local_expert=[ranks * capacity] * local,
                            capacity=capacity)
        recv_MH = all_to_all(self.comm, permuted_NH, splits, splits)
        recv_probs_M = all_to_all(self.comm, permuted_probs_N, splits, splits)
        return recv_MH, recv_probs_M, meta

    def sort_by_expert(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        if self.comm.size == 1:
            return recv_MH, recv_probs_M, None
        shape = (self.comm.size, self.num_local, meta.capacity)
        return _swap_blocks(recv_MH, shape), _swap_blocks(recv_probs_M, shape), None

    def unsort(self, expert_out_MH, meta: DispatchMeta, local_row_id_map=None):
        if self.comm.size == 1:
            return expert_out_MH
        return _swap_blocks(expert_out_MH, (self.num_local, self.comm.size, meta.capacity))


class BudgetDispatcher(TokenDispatcher):
    """budget: fixed blocks of `DispatchBudget.block_rows` rows per rank; counts exchanged and
    kept on the device; a rank's rows past its block are cut and recorded (`DispatchBudget.
    note`) for the trainer's rerun. The received blocks hold each local expert's rows, then
    padding."""

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device, mode: DispatchMode,
                 budget: Optional[DispatchBudget] = None):
        super().__init__(comm, num_experts, topk, ops, device, mode, budget)
        # blocks (rank, expert or padding) -> experts' blocks, then padding; and back
        self._budget_to_expert_major, self._budget_to_rank_major = padded_block_transpose(
            comm.size, self.num_local, device)

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        budget, num_rows = self.budget, permuted_NH.shape[0]
        budget.check_rows(num_rows)
        block = budget.block_rows
        send_R, recv_RL = self._rows_to_send(counts_E, row_id_map)
        budget.note(send_R)
        budget.note_wire(send_R, block)
        send_index, return_index = budget_indices(send_R, block, num_rows)
        gather = self.ops.gather_rows
        send_XH = move_rows(permuted_NH, send_index, return_index, gather)
        send_probs_X = self._block_probs(
            move_rows(permuted_probs_N, send_index, return_index, gather), send_index)
        recv_MH = all_to_all(self.comm, send_XH, None, None)
        recv_probs_M = all_to_all(self.comm, send_probs_X, None, None)
        recv_probs_M, recv_counts_RL, expert_rows = self._received(recv_probs_M, recv_RL, block)
        meta = DispatchMeta(input_splits=None, output_splits=None,
                            recv_counts_RL=recv_counts_RL, tokens_per_local_expert=None,
                            block_rows=block, send_index=send_index, return_index=return_index,
                            expert_rows=expert_rows)
        return recv_MH, recv_probs_M, meta

    def _rows_to_send(self, counts_E, row_id_map):
        """-> (rows sent to each rank [R], rows received per (rank, local expert) [R, L]):
        the counts exchanged on the device (equal splits: no host read)."""
        recv_RL = self.comm.exchange_counts(counts_E)
        return counts_E.view(self.comm.size, self.num_local).sum(dim=1), recv_RL

    def _block_probs(self, send_probs_X, send_index):
        """The probs of the blocks' slots as sent."""
        return send_probs_X

    def _received(self, recv_probs_M, recv_RL, block: int):
        """-> (received probs, rows kept per (source rank, local expert), the local experts'
        rows or None)."""
        return recv_probs_M, kept_counts(recv_RL, block), None

    def sort_by_expert(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        if self.comm.size == 1:
            return recv_MH, recv_probs_M, None
        return self.ops.sort_chunks_by_idxs(recv_MH, _budget_blocks(meta).reshape(-1),
                                            self._budget_to_expert_major,
                                            recv_probs_M) + (None,)

    def unsort(self, expert_out_MH, meta: DispatchMeta, local_row_id_map=None):
        if self.comm.size == 1:
            return expert_out_MH
        sizes = _budget_blocks(meta).reshape(-1).index_select(0, self._budget_to_expert_major)
        return self.ops.sort_chunks_by_idxs(expert_out_MH, sizes, self._budget_to_rank_major)[0]

    def _returned_rows(self, returned_NH, meta: DispatchMeta):
        """The blocks' slots back onto the permuted rows (a cut row's come back as zeros)."""
        return move_rows(returned_NH, meta.return_index, meta.send_index,
                         self.ops.gather_rows)


def _budget_blocks(meta: DispatchMeta) -> torch.Tensor:
    """[R, L + 1] rows of each received block: per local expert, then padding."""
    kept_RL = meta.recv_counts_RL
    pad_R1 = meta.block_rows - kept_RL.sum(dim=1, keepdim=True)
    return torch.cat([kept_RL, pad_R1], dim=1)


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


def _swap_blocks(rows: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
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
