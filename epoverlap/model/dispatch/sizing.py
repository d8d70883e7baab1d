"""How the dispatch sizes its all-to-alls, one `TokenDispatcher` class per sizing
(`DispatchMode.sizing`), each holding the routing strategy it was built with
(`model.dispatch.routing`): rows per expert or once per rank (by host: `model.dispatch.by_host`).

Sizings, and whether the host reads the device in the dispatch:
  host_splits  `HostSplitDispatcher` (dropless, capacity): each rank sends what it routed; split
               sizes read on the host before the all-to-all (one sync per layer and
               microbatch), from an exchange started when the router has counted
               (`start_split_exchange`, at the end of the `attn` node), so the read waits for
               that exchange alone. With capacity (Megatron-core's
               --moe-expert-capacity-factor) the router drops routed (token, expert) pairs
               beyond an expert's capacity (`Router.step_dropped`); the split sizes are still
               data dependent.
  padded       `PaddedCapacityDispatcher` (capacity_padded, + --moe-pad-expert-input-to-
               capacity; per expert only): every expert gets exactly `capacity` rows from every
               rank (unrouted tokens with prob 0 fill the gap), so every split size is known
               from shapes: no host read.
  budget       `BudgetDispatcher` (--moe-dispatch-budget): dropless, but every rank sends every
               rank one block of a fixed size (`model.budget.DispatchBudget`): equal splits,
               counts kept on the device; a dispatch whose rows for one rank exceed the block
               is recorded on the device (`DispatchBudget.demand_rows`) and the trainer reruns
               the step at a larger budget: no token is ever silently dropped, no host read
               inside the step.

Shape legend as `model.dispatch.base`.
"""

from __future__ import annotations

from typing import Optional

import torch

from epoverlap.config.dispatch import DispatchMode, padded_rows
from epoverlap.kernels import MoEOps
from epoverlap.model.budget import DispatchBudget
from epoverlap.model.dispatch.base import DispatchMeta, TokenDispatcher
from epoverlap.model.dispatch.rows import (ExpertOrder, budget_indices, move_rows,
                                               padded_block_transpose, swap_blocks)
from epoverlap.parallel.comm import ExpertComm, SplitExchange, all_to_all


class HostSplitDispatcher(TokenDispatcher):
    """dropless and capacity: split sizes exchanged early (`start_split_exchange`, the counts
    the routing names) and read on the host in `dispatch`; per expert, blocks sorted by the
    received counts."""

    reads_host = True

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device, mode: DispatchMode,
                 budget: Optional[DispatchBudget] = None, *, routing):
        super().__init__(comm, num_experts, topk, ops, device, mode, budget, routing=routing)
        self._order = ExpertOrder(comm.size, self.num_local, device)

    def start_split_exchange(self, counts_E, row_id_map=None) -> SplitExchange:
        """Called when the router has counted, so the exchange runs while other work is issued,
        and handed to `dispatch` (parallel.comm, `SplitExchange`)."""
        return self.routing.start_split_exchange(counts_E, row_id_map)

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        """Takes the `exchange` started earlier, or starts it here from `counts_E`; reads the
        exchanged split sizes on the host (the one host sync), then sends."""
        if exchange is None:
            exchange = self.routing.exchange_now(counts_E)
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

    def sort_blocks(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        if self.comm.size == 1:
            return recv_MH, recv_probs_M, None
        return self._order.to_expert_major(self.ops, recv_MH, recv_probs_M,
                                           meta.recv_counts_RL) + (None,)

    def unsort_blocks(self, expert_out_MH, meta: DispatchMeta):
        if self.comm.size == 1:
            return expert_out_MH
        return self._order.to_rank_major(self.ops, expert_out_MH, meta.recv_counts_RL)


class PaddedCapacityDispatcher(TokenDispatcher):
    """capacity_padded (routed per expert): every (rank, expert) pair holds `capacity` rows, so
    the split sizes come from shapes (no host read) and the expert sort is a transpose of equal
    blocks (Megatron-core's)."""

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

    def sort_blocks(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        if self.comm.size == 1:
            return recv_MH, recv_probs_M, None
        shape = (self.comm.size, self.num_local, meta.capacity)
        return swap_blocks(recv_MH, shape), swap_blocks(recv_probs_M, shape), None

    def unsort_blocks(self, expert_out_MH, meta: DispatchMeta):
        if self.comm.size == 1:
            return expert_out_MH
        return swap_blocks(expert_out_MH, (self.num_local, self.comm.size, meta.capacity))


class BudgetDispatcher(TokenDispatcher):
    """budget: fixed blocks of `DispatchBudget.block_rows` rows per rank; the rows per rank
    from the routing (per expert: counts exchanged and kept on the device); a rank's rows past
    its block are cut and recorded (`DispatchBudget.note`) for the trainer's rerun. Per expert,
    the received blocks hold each local expert's rows, then padding."""

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device, mode: DispatchMode,
                 budget: Optional[DispatchBudget] = None, *, routing):
        super().__init__(comm, num_experts, topk, ops, device, mode, budget, routing=routing)
        # blocks (rank, expert or padding) -> experts' blocks, then padding; and back
        self._budget_to_expert_major, self._budget_to_rank_major = padded_block_transpose(
            comm.size, self.num_local, device)

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        budget, routing, num_rows = self.budget, self.routing, permuted_NH.shape[0]
        budget.check_rows(num_rows)
        block = budget.block_rows
        send_R, recv_RL = routing.budget_sends(counts_E, row_id_map)
        budget.note(send_R)
        budget.note_wire(send_R, block)
        send_index, return_index = budget_indices(send_R, block, num_rows)
        gather = self.ops.gather_rows
        send_XH = move_rows(permuted_NH, send_index, return_index, gather)
        send_probs_X = routing.block_probs(
            move_rows(permuted_probs_N, send_index, return_index, gather), send_index)
        recv_MH = all_to_all(self.comm, send_XH, None, None)
        recv_probs_M = all_to_all(self.comm, send_probs_X, None, None)
        recv_probs_M, recv_counts_RL, expert_rows = routing.budget_received(
            budget, recv_probs_M, recv_RL, block)
        meta = DispatchMeta(input_splits=None, output_splits=None,
                            recv_counts_RL=recv_counts_RL, tokens_per_local_expert=None,
                            block_rows=block, send_index=send_index, return_index=return_index,
                            expert_rows=expert_rows)
        return recv_MH, recv_probs_M, meta

    def sort_blocks(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        if self.comm.size == 1:
            return recv_MH, recv_probs_M, None
        return self.ops.sort_chunks_by_idxs(recv_MH, _budget_blocks(meta).reshape(-1),
                                            self._budget_to_expert_major,
                                            recv_probs_M) + (None,)

    def unsort_blocks(self, expert_out_MH, meta: DispatchMeta):
        if self.comm.size == 1:
            return expert_out_MH
        sizes = _budget_blocks(meta).reshape(-1).index_select(0, self._budget_to_expert_major)
        return self.ops.sort_chunks_by_idxs(expert_out_MH, sizes, self._budget_to_rank_major)[0]

    def local_expert_rows(self, meta: DispatchMeta) -> int:
        return meta.expert_rows

    def _returned_rows(self, returned_NH, meta: DispatchMeta):
        """The blocks' slots back onto the permuted rows (a cut row's come back as zeros)."""
        return move_rows(returned_NH, meta.return_index, meta.send_index,
                         self.ops.gather_rows)


def _budget_blocks(meta: DispatchMeta) -> torch.Tensor:
    """[R, L + 1] rows of each received block: per local expert, then padding."""
    kept_RL = meta.recv_counts_RL
    pad_R1 = meta.block_rows - kept_RL.sum(dim=1, keepdim=True)
    return torch.cat([kept_RL, pad_R1], dim=1)
