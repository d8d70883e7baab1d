"""How the dispatch routes rows, the strategy a dispatcher holds (`TokenDispatcher.routing`):
one row per chosen expert (`PerExpert`), once per EP rank (`PerRank`,
--moe-dispatch-once-per-rank), or once per host and then per rank (`PerHost`,
--moe-dispatch-hierarchy node). A routing owns the preprocess (the permute and its row-id map),
the bound on a token's rows, how received rows reach the experts and come back, and what the
host-split and budget sizings ask of it (the rows per destination, the probs of a block's
slots, the received experts' rows).

Per expert: the preprocess permutes one row per (token, chosen expert), expert-major; received
rows arrive in blocks (source rank, local expert) and reach the experts by the sizing's block
order (`TokenDispatcher.sort_blocks`).

Once per rank: the preprocess sends each token once to every rank holding one of its experts
(`permute` over a [T, R] "to rank" map), each row with the probs of that rank's L experts (-1
where the expert was not chosen); the receiving rank copies the row to those experts
(`sort_by_expert`, a second permute) and sums their outputs (`unsort`, its unpermute) before the
combine returns one row per (token, rank). The experts see the same rows in the same order as
per expert ((local expert, source rank, token)); the combine sums per rank first. Split sizes:
rows per rank counted apart and exchanged with the expert counts; with the budget nothing is
exchanged: a rank's block holds its rows for that rank (at most one per token), and each
received row's probs say which local experts it goes to (an empty slot's: none), so the receiver
counts its experts' rows itself. Those (row, expert) pairs are budgeted too
(`DispatchBudget.expert_rows`: the budget times a rank's balanced share, tokens x topk, rather
than the blocks' rows times min(topk, L), which would size the experts' buffers for a routing
that can never happen); pairs past it are cut and recorded (`cut_expert_pairs`), and the step
reruns. On one EP rank once per rank is the plain dispatch (nothing to send once instead of
several times), and `make_dispatcher` picks that.

By host: the once-per-rank copy to the experts, after two stages (`model.dispatch.by_host`);
the preprocess sends each token once to every host holding one of its experts.

Shape legend as `model.dispatch.base`; G hosts, P ranks per host.
"""

from __future__ import annotations

import torch

from epoverlap.kernels import MoEOps
from epoverlap.model.budget import DispatchBudget
from epoverlap.model.dispatch.rows import kept_counts, move_rows
from epoverlap.parallel.comm import ExpertComm, SplitExchange


class PerExpert:
    """One row per (token, chosen expert)."""

    once_per_rank = False

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps):
        self.comm, self.ops, self.topk = comm, ops, topk
        self.num_local = num_experts // comm.size

    def permuted_rows(self, num_tokens: int) -> int:
        """Tokens x topk (static: dropped pairs leave rows past the routed count at zero)."""
        return num_tokens * self.topk

    def preprocess(self, hidden_TH, probs_TE, routing_map_TE, num_out: int):
        """-> (rows [N, H] expert-major, their probs [N], row-id map [T, E])."""
        return self.ops.permute(hidden_TH, routing_map_TE, probs_TE, num_out_tokens=num_out)

    def start_split_exchange(self, counts_E, row_id_map) -> SplitExchange:
        """The host-split sizing's exchange: the rows per rank are its experts' counts."""
        return self.comm.start_split_exchange(counts_E)

    def exchange_now(self, counts_E) -> SplitExchange:
        """The exchange started in `dispatch`, where none was started earlier."""
        return self.comm.start_split_exchange(counts_E)

    def sort_by_expert(self, dispatcher, recv_MH, recv_probs_M, meta):
        return dispatcher.sort_blocks(recv_MH, recv_probs_M, meta)

    def unsort(self, dispatcher, expert_out_MH, meta, local_row_id_map=None):
        return dispatcher.unsort_blocks(expert_out_MH, meta)

    def budget_sends(self, counts_E, row_id_map):
        """The budget sizing's counts: -> (rows sent to each rank [R], rows received per (rank,
        local expert) [R, L]), exchanged on the device (equal splits: no host read)."""
        recv_RL = self.comm.exchange_counts(counts_E)
        return counts_E.view(self.comm.size, self.num_local).sum(dim=1), recv_RL

    def block_probs(self, send_probs_X, send_index):
        """The probs of the budget blocks' slots as sent."""
        return send_probs_X

    def budget_received(self, budget: DispatchBudget, recv_probs_M, recv_RL, block: int):
        """-> (received probs, rows kept per (source rank, local expert), the local experts'
        rows or None)."""
        return recv_probs_M, kept_counts(recv_RL, block), None


class PerRank(PerExpert):
    """Once per EP rank (module docstring): rows are (token, rank) pairs with [N, L] probs (-1:
    expert not chosen); the receiver copies each row to its chosen local experts and sums their
    outputs."""

    once_per_rank = True

    def permuted_rows(self, num_tokens: int) -> int:
        """A token reaches at most min(topk, R) ranks."""
        return num_tokens * min(self.topk, self.comm.size)

    def preprocess(self, hidden_TH, probs_TE, routing_map_TE, num_out: int):
        """-> (rows [N, H] rank-major, their probs [N, L], row-id map [T, R])."""
        return once_per_peer(self.ops, hidden_TH, probs_TE, routing_map_TE, self.comm.size,
                             num_out)

    def start_split_exchange(self, counts_E, row_id_map) -> SplitExchange:
        """The rows per rank are counted from the [T, R] row-id map."""
        return self.comm.start_split_exchange(counts_E, rows_per_rank(row_id_map))

    def exchange_now(self, counts_E) -> SplitExchange:
        raise ValueError("dispatch once per rank: pass the exchange that "
                         "`start_split_exchange(counts_E, row_id_map)` started")

    def sort_by_expert(self, dispatcher, recv_MH, recv_probs_M, meta):
        """-> (rows, their probs, the row-id map of the copy to the local experts)."""
        chosen_ML = recv_probs_M >= 0
        return self.ops.permute(recv_MH, chosen_ML, torch.where(chosen_ML, recv_probs_M, 0.0),
                                num_out_tokens=dispatcher.local_expert_rows(meta))

    def unsort(self, dispatcher, expert_out_MH, meta, local_row_id_map=None):
        """Each received row sums its local experts' outputs."""
        return self.ops.unpermute(expert_out_MH, local_row_id_map)

    def budget_sends(self, counts_E, row_id_map):
        """The rows per rank from the [T, R] row-id map; no counts are exchanged."""
        return rows_per_rank(row_id_map), None

    def block_probs(self, send_probs_X, send_index):
        """An empty slot chooses no expert."""
        return torch.where((send_index >= 0).unsqueeze(1), send_probs_X, -1.0)

    def budget_received(self, budget: DispatchBudget, recv_probs_M, recv_RL, block: int):
        """Each received row's probs say which local experts it goes to; the (row, expert)
        pairs past `DispatchBudget.expert_rows` are cut and recorded."""
        expert_rows = budget.expert_rows
        recv_probs_M = cut_expert_pairs(budget, recv_probs_M, expert_rows, self.topk)
        return recv_probs_M, (recv_probs_M >= 0).sum(dim=0, keepdim=True), expert_rows


class PerHost(PerRank):
    """Once per host, then once per rank inside it (`model.dispatch.by_host`), over the EP
    group's hosts (`comm.by_host`): the preprocess's row-id map is [T, G + R]: stage 1's row
    ids per host, then 1 where the token reaches a rank (counted for the host-split sizing's
    exchange; the combine's unpermute reads the first G columns)."""

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps):
        super().__init__(comm, num_experts, topk, ops)
        self.route = comm.by_host
        self.hosts, self.per_host = self.route.hosts, self.route.per_host
        if self.hosts * self.per_host != comm.size:
            raise ValueError(f"{self.hosts} hosts of {self.per_host} ranks for an EP group of "
                             f"{comm.size}")

    def permuted_rows(self, num_tokens: int) -> int:
        """A token reaches at most min(topk, G) hosts."""
        return num_tokens * min(self.topk, self.hosts)

    def preprocess(self, hidden_TH, probs_TE, routing_map_TE, num_out: int):
        """-> (rows [N, H] host-major, their probs [N, P x L], row-id map [T, G + R])."""
        tokens = hidden_TH.shape[0]
        rows_NH, probs_NK, row_id_map_TG = once_per_peer(
            self.ops, hidden_TH, probs_TE, routing_map_TE, self.hosts, num_out)
        to_rank_TR = routing_map_TE.view(tokens, self.comm.size, self.num_local).any(dim=2)
        return rows_NH, probs_NK, torch.cat([row_id_map_TG, to_rank_TR.to(row_id_map_TG.dtype)],
                                            dim=1)

    def start_split_exchange(self, counts_E, row_id_map) -> SplitExchange:
        """Rows per host, (token, rank) pairs, expert counts: to every rank (`by_host.
        HostRoute`)."""
        hosts = self.hosts
        rows_G = (row_id_map[:, :hosts] >= 0).sum(dim=0)
        pairs_R = row_id_map[:, hosts:].sum(dim=0)
        return self.comm.start_table_exchange(torch.cat([
            rows_G.to(counts_E.dtype), pairs_R.to(counts_E.dtype), counts_E]))

    def exchange_now(self, counts_E) -> SplitExchange:
        raise ValueError("dispatch by host: pass the exchange `start_split_exchange` started")


ROUTINGS = {"per_expert": PerExpert, "per_rank": PerRank, "per_host": PerHost}


def cut_expert_pairs(budget: DispatchBudget, probs_ML: torch.Tensor, expert_rows: int,
                     topk: int) -> torch.Tensor:
    """The (received row, local expert) pairs in the order the second permute gives them rows
    (expert-major), those past `expert_rows` unchosen (probs -1); their count is recorded for
    the rerun."""
    chosen_ML = probs_ML >= 0
    budget.note_expert_rows(chosen_ML.sum())
    if expert_rows >= probs_ML.shape[0] * min(topk, probs_ML.shape[1]):
        return probs_ML  # every pair fits: nothing to cut
    row_LM = torch.cumsum(chosen_ML.t().reshape(-1), 0).view(chosen_ML.shape[1], -1) - 1
    return torch.where(chosen_ML & (row_LM.t() < expert_rows), probs_ML, -1.0)


def rows_per_rank(row_id_map_TR: torch.Tensor) -> torch.Tensor:
    """Once per rank: the rows sent to each rank, from the preprocess's [T, R] row-id map. [R]."""
    return (row_id_map_TR >= 0).sum(dim=0)


def rows_by_pair(row_id_map_TR: torch.Tensor, num_rows: int) -> torch.Tensor:
    """For each of `num_rows` permuted rows, the flat (t * R + r) entry of the row-id map that
    names it, -1 past the routed rows. [N] device, no host read: the map's row ids are distinct,
    so a stable sort of them lists the entries in row order."""
    unrouted = row_id_map_TR.numel()
    keys_X = torch.where(row_id_map_TR >= 0, row_id_map_TR, unrouted).reshape(-1)
    sorted_X, entry_X = torch.sort(keys_X, stable=True)
    return torch.where(sorted_X[:num_rows] < unrouted, entry_X[:num_rows], -1)


def once_per_peer(ops: MoEOps, hidden_TH, probs_TE, routing_map_TE, peers: int,
                  num_out: int):
    """Each token's row once to every one of `peers` holding one of its experts (the experts in
    `peers` equal runs), with the probs of that peer's experts (-1: not chosen). -> (rows [N, H]
    peer-major, their probs [N, E / peers], row-id map [T, peers])."""
    tokens, per_peer = hidden_TH.shape[0], routing_map_TE.shape[1] // peers
    to_peer_TP = routing_map_TE.view(tokens, peers, per_peer).any(dim=2)
    permuted_NH, _, row_id_map_TP = ops.permute(hidden_TH, to_peer_TP, None,
                                                num_out_tokens=num_out)
    chosen_probs_XK = torch.where(routing_map_TE, probs_TE, -1.0).view(
        tokens * peers, per_peer)  # X = (token, peer) pairs
    source_N = rows_by_pair(row_id_map_TP, num_out)
    permuted_probs_NK = move_rows(chosen_probs_XK, source_N, row_id_map_TP.reshape(-1),
                                  ops.gather_rows)
    return permuted_NH, permuted_probs_NK, row_id_map_TP
