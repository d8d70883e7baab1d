"""The interface of the MoE token dispatch: `TokenDispatcher`, the steps the MoE layer's nodes
call, and `DispatchMeta`, what the steps after the dispatch need.

A dispatcher is two choices (`DispatchMode.sizing`, `.routing`, `epoverlap.config.dispatch`):
how the all-to-alls' rows are sized, its class (`model.dispatch.sizing`; by host, whose two
stages are sized together with their routing: `model.dispatch.by_host`), and how rows are
routed, the strategy object it holds (`routing`: `model.dispatch.routing`), put together by
`model.dispatch.factory.make_dispatcher`.

Probabilities are applied inside the expert activation (h = silu(gate) * up * prob, in fp32),
so the combine's unpermute sums rows without merging probs. The preprocess never reads the host
(its row count is static: tokens x topk, or experts x capacity padded); only the torch reference
permute does (`preprocess_syncs_host`).

Shape legend: T local tokens, H hidden, E global experts, L local experts (E / ep), R EP ranks,
N permuted rows (T * topk per expert), M rows received by this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from epoverlap.config.dispatch import DispatchMode
from epoverlap.kernels import MoEOps
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
    """The interface of every dispatch, in the steps the scheduler runs as nodes:
    `preprocess` (in `attn`), `start_split_exchange` (end of `attn`, host-split sizing only),
    `dispatch` (the `dispatch` node), `sort_by_expert` and `unsort` (around the experts in
    `mlp`), `combine` (the `combine` node). `reads_host`: whether `dispatch` reads split sizes
    on the host (the layer then hands it the early exchange, and graphs cannot hold it).
    `once_per_rank`: whether the preprocess's row-id map is [T, R] (token, rank), not [T, E].
    The sizing classes define `dispatch`, and `sort_blocks` / `unsort_blocks` (the received
    blocks to the experts' order and back, where rows are routed per expert); the `routing`
    strategy the preprocess, the row count, and how received rows reach the experts."""

    reads_host = False

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device, mode: DispatchMode,
                 budget: Optional[DispatchBudget] = None, *, routing):
        self.comm, self.ops, self.topk, self.mode, self.budget = comm, ops, topk, mode, budget
        self.num_experts = num_experts
        self.num_local = num_experts // comm.size
        self.routing = routing

    @property
    def name(self) -> str:
        return self.mode.name

    @property
    def once_per_rank(self) -> bool:
        return self.routing.once_per_rank

    @property
    def drops_tokens(self) -> bool:
        """Whether the router drops pairs over an expert's capacity (counted per step)."""
        return self.mode.drops_tokens

    def permuted_rows(self, num_tokens: int) -> int:
        """Rows of the permuted tokens (static: the routing's bound on a token's rows)."""
        return self.routing.permuted_rows(num_tokens)

    def preprocess(self, hidden_TH, probs_TE, routing_map_TE):
        """Permute token copies into destination-major rows (a static row count). -> (rows
        [N, H], their probs, row-id map), as the routing lays them out."""
        return self.routing.preprocess(hidden_TH, probs_TE, routing_map_TE,
                                       self.permuted_rows(hidden_TH.shape[0]))

    def start_split_exchange(self, counts_E, row_id_map=None) -> Optional[SplitExchange]:
        """Start the exchange of the split sizes `dispatch` reads on the host (None: this
        sizing reads none)."""
        return None

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        """All-to-all of tokens and probs: (recv_MH, recv_probs_M, DispatchMeta)."""
        raise NotImplementedError

    def sort_by_expert(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        """Received rows to the order the experts want, (local expert, source rank). -> (rows,
        their probs, what `unsort` needs, or None)."""
        return self.routing.sort_by_expert(self, recv_MH, recv_probs_M, meta)

    def unsort(self, expert_out_MH, meta: DispatchMeta, local_row_id_map=None):
        """Back to the order rows arrived in."""
        return self.routing.unsort(self, expert_out_MH, meta, local_row_id_map)

    def sort_blocks(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        """Rows routed per expert arrive in blocks (source rank, local expert); the experts
        want (local expert, source rank). -> (rows, their probs, None)."""
        raise NotImplementedError

    def unsort_blocks(self, expert_out_MH, meta: DispatchMeta):
        """Back to the blocks the rows arrived in."""
        raise NotImplementedError

    def local_expert_rows(self, meta: DispatchMeta) -> int:
        """Rows routed once per rank: the local experts' rows, every (received row, chosen
        expert) pair, as counted (the budget sizing: its static budget)."""
        return sum(meta.tokens_per_local_expert)

    def combine(self, expert_out_MH, meta: DispatchMeta, row_id_map_TE):
        """All-to-all back, then each token sums its rows (probs were applied by the experts)."""
        returned_NH = all_to_all(self.comm, expert_out_MH, meta.input_splits,
                                 meta.output_splits)
        return self.ops.unpermute(self._returned_rows(returned_NH, meta), row_id_map_TE)

    def _returned_rows(self, returned_NH, meta: DispatchMeta):
        """The rows the combine's all-to-all brought back, in the preprocess's order."""
        return returned_NH
