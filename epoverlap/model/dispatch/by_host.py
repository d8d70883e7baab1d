"""The hierarchical dispatch (--moe-dispatch-hierarchy node): rows routed once per host, then
once per rank inside it (`routing.PerHost`), its two stages sized together with that routing,
by host splits (`ByHostDispatcher`) or by the budget (`ByHostBudgetDispatcher`); `HostRoute`,
both stages' split sizes read from the exchanged table.

By host (`ByHostDispatcher`, dropless or capacity): the EP group is G hosts of P ranks, EP rank =
host x P + index (`parallel.comm.HostComms`). Stage 1, between hosts: each token goes once to
every host holding one of its experts, to the rank of the sender's own index there (a rail),
with the probs of that host's P x L experts; stage 2, inside the host: that rank sends each
received row once to every rank of the host holding one of its experts, with the probs of that
rank's L experts (the once-per-rank layout over the host). Both stages run in the `dispatch`
node (the comm lane); the combine runs them backwards, each stage summing its rows per row it
was sent (inside the host first, then per token). The receiver reorders its rows from (host
mate, source host, token) to (source host, host mate, token), the order once per rank receives
them in, so the experts see the same rows in the same order, and compute the same bits, as
--moe-dispatch-once-per-rank; only the combine's sums (per host, then per token) and the
backward's matching sums round apart. Split sizes: every rank sends every rank of the group its
rows per host, its (token, rank) pairs and its expert counts, one small all-gather started when
the router has counted (`ExpertComm.start_table_exchange`); the dispatch reads it on the host
and derives both stages' sizes (`HostRoute`).

By host with the budget (`ByHostBudgetDispatcher`, sync-free, so graphs can hold it): the
same two stages in fixed blocks (`model.budget.ByHostBudget`): stage 1 one block per host, stage
2 one block per host mate, each a rank's rows for it then empty slots (probs -1), so both
stages' all-to-alls have equal splits and nothing is read on the host. Each mate also sends, in
a small all-to-all, how many rows of its block came from each source host, so the receiver
reorders (mate, source host) blocks to (source host, mate) on the device, empty slots last; the
experts' (row, expert) pairs are cut at the budget's `expert_rows`. Rows past a block are cut
and recorded (`ByHostBudget.demand`), and the step reruns at a level that holds them, so a step
that counts is the dropless one: the experts see the rows of --moe-dispatch-hierarchy node in
the same order and the combine sums them in the same order, bit for bit.

Shape legend as `model.dispatch.base`; G hosts, P ranks per host, M1 rows received between
hosts; C1, C2 the two stages' block rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from epoverlap.config.dispatch import DispatchMode
from epoverlap.kernels import MoEOps
from epoverlap.model.budget import DispatchBudget
from epoverlap.model.dispatch.base import DispatchMeta, TokenDispatcher
from epoverlap.model.dispatch.routing import cut_expert_pairs, once_per_peer
from epoverlap.model.dispatch.rows import (budget_indices, index_tensor, kept_counts,
                                               move_rows, padded_block_transpose)
from epoverlap.parallel.comm import ExpertComm, SplitExchange, all_to_all


@dataclass(frozen=True)
class HostRoute:
    """One dispatch's split sizes by host, from the exchanged table (`of`): row s = EP rank
    s's rows per host [G], (token, rank) pairs per rank [R] and expert counts [E]."""

    between_send: list[int]  # stage 1: rows to the rail peer in each host
    between_recv: list[int]  # stage 1: rows from the rail peer of each host
    within_send: list[int]  # stage 2: rows to each rank of my host
    within_recv: list[int]  # stage 2: rows from each rank of my host
    tokens_per_local_expert: list[int]

    @classmethod
    def of(cls, table: list[list[int]], me: int, hosts: int, per_host: int,
           local: int) -> "HostRoute":
        ranks = hosts * per_host
        host, index = divmod(me, per_host)
        pairs, experts = hosts, hosts + ranks  # column offsets in a row of the table

        def rail(h: int) -> list[int]:  # rank `index` of host h
            return table[h * per_host + index]

        def pairs_to_me_from(mate: int) -> int:  # over every source host, via host mate `mate`
            return sum(table[h * per_host + mate][pairs + me] for h in range(hosts))

        return cls(
            between_send=table[me][:hosts],
            between_recv=[rail(h)[host] for h in range(hosts)],
            within_send=[sum(rail(h)[pairs + host * per_host + mate] for h in range(hosts))
                         for mate in range(per_host)],
            within_recv=[pairs_to_me_from(mate) for mate in range(per_host)],
            tokens_per_local_expert=[sum(row[experts + me * local + e] for row in table)
                                     for e in range(local)])

    @classmethod
    def mirrored(cls, row: list[int], hosts: int, per_host: int, local: int) -> "HostRoute":
        """--comm-mode local_copy: every all-to-all a local copy, so each stage brings back
        what this rank sent (`row`: its own entry of the table): from host h its rows for
        host h, from host mate m its rows for the ranks of index m, each expert's rows summed
        over the ranks holding one of that index."""
        ranks = hosts * per_host
        pairs = row[hosts:hosts + ranks]
        within = [sum(pairs[h * per_host + mate] for h in range(hosts))
                  for mate in range(per_host)]
        counts = row[hosts + ranks:]
        return cls(between_send=row[:hosts], between_recv=row[:hosts], within_send=within,
                   within_recv=within,
                   tokens_per_local_expert=[sum(counts[s * local + e] for s in range(ranks))
                                            for e in range(local)])


@dataclass
class ByHostMeta(DispatchMeta):
    """`DispatchMeta` (`input_splits` / `output_splits`: stage 1's), and stage 2's."""

    within_send: Optional[list[int]] = None
    within_recv: Optional[list[int]] = None
    within_row_id_map: Optional[torch.Tensor] = None  # [M1, P]: stage 2's permute
    blocks_PG: Optional[torch.Tensor] = None  # [P, G] device: rows from (host mate, src host)


class ByHostDispatcher(TokenDispatcher):
    """--moe-dispatch-hierarchy node, dropless or capacity (module docstring): split sizes
    from the exchanged table (`HostRoute`), read on the host."""

    reads_host = True

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device, mode: DispatchMode,
                 budget: Optional[DispatchBudget] = None, *, routing):
        super().__init__(comm, num_experts, topk, ops, device, mode, budget, routing=routing)
        self.route = routing.route
        hosts, per_host = self.route.hosts, self.route.per_host
        self._to_source_major = index_tensor([p * hosts + h for h in range(hosts)
                                              for p in range(per_host)], device)
        self._to_mate_major = index_tensor([h * per_host + p for p in range(per_host)
                                            for h in range(hosts)], device)

    def start_split_exchange(self, counts_E, row_id_map=None) -> SplitExchange:
        """The table of every rank's rows per host, (token, rank) pairs and expert counts
        (`routing.PerHost.start_split_exchange`), read as `HostRoute`."""
        return self.routing.start_split_exchange(counts_E, row_id_map)

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        if exchange is None:
            exchange = self.routing.exchange_now(counts_E)  # refused: too late for the table
        route = self.route
        sizes, recv_counts_RL, blocks_PG = self._sizes(exchange)
        routed = sum(sizes.between_send)
        recv_M1H, recv_probs_M1K = _send_rows(route.between, permuted_NH[:routed],
                                              permuted_probs_N[:routed], sizes.between_recv,
                                              sizes.between_send)
        rows_NH, probs_NL, within_map = once_per_peer(
            self.ops, recv_M1H, recv_probs_M1K, recv_probs_M1K >= 0, route.per_host,
            sum(sizes.within_send))
        recv_MH, recv_probs_ML = _send_rows(route.within, rows_NH, probs_NL, sizes.within_recv,
                                            sizes.within_send)
        meta = ByHostMeta(
            input_splits=sizes.between_send, output_splits=sizes.between_recv,
            recv_counts_RL=recv_counts_RL,
            tokens_per_local_expert=sizes.tokens_per_local_expert,
            within_send=sizes.within_send, within_recv=sizes.within_recv,
            within_row_id_map=within_map, blocks_PG=blocks_PG)
        return recv_MH, recv_probs_ML, meta

    def _sizes(self, exchange: SplitExchange) -> tuple[HostRoute, torch.Tensor, torch.Tensor]:
        """(both stages' sizes; [R, L] device: rows from each source rank per local expert;
        [P, G] device: rows from each (host mate, source host)), from the exchanged table, or
        under --comm-mode local_copy from this rank's own row (`HostRoute.mirrored`)."""
        route, hosts, per_host, local = (self.route, self.route.hosts, self.route.per_host,
                                         self.num_local)
        host_table, ranks = exchange.read_pairs()[1], self.comm.size
        table = exchange.recv_RL  # [R, V] device, there once read
        if self.comm.mode == "local_copy":  # every row of the table is this rank's own
            row = table[0]
            return (HostRoute.mirrored(host_table[0], hosts, per_host, local),
                    row[hosts + ranks:].view(ranks, local),
                    row[hosts:hosts + ranks].view(hosts, per_host).t())
        experts = hosts + ranks + route.ep_rank * local
        return (HostRoute.of(host_table, route.ep_rank, hosts, per_host, local),
                table[:, experts:experts + local],
                table[:, hosts + route.ep_rank].view(hosts, per_host).t())

    def sort_by_expert(self, recv_MH, recv_probs_M, meta: ByHostMeta):
        """(host mate, source host) blocks to (source host, host mate), then once per rank's
        copy to the local experts."""
        sizes = meta.blocks_PG.reshape(-1)
        rows = self.ops.sort_chunks_by_idxs(recv_MH, sizes, self._to_source_major)[0]
        probs = self.ops.sort_chunks_by_idxs(recv_probs_M, sizes, self._to_source_major)[0]
        return super().sort_by_expert(rows, probs, meta)

    def unsort(self, expert_out_MH, meta: ByHostMeta, local_row_id_map=None):
        rows = super().unsort(expert_out_MH, meta, local_row_id_map)
        return self.ops.sort_chunks_by_idxs(rows, meta.blocks_PG.t().reshape(-1),
                                            self._to_mate_major)[0]

    def combine(self, expert_out_MH, meta: ByHostMeta, row_id_map_TE):
        """Inside the host back, each stage-1 row sums its ranks'; between hosts back, each
        token sums its hosts'."""
        route = self.route
        back_NH = all_to_all(route.within, expert_out_MH, meta.within_send, meta.within_recv)
        rows_M1H = self.ops.unpermute(back_NH, meta.within_row_id_map)
        back_NH = all_to_all(route.between, rows_M1H, meta.input_splits, meta.output_splits)
        return self.ops.unpermute(back_NH, row_id_map_TE[:, :route.hosts].contiguous())


@dataclass
class ByHostBudgetMeta(DispatchMeta):
    """`DispatchMeta` (`send_index` / `return_index`: stage 1's block slots), and stage 2's."""

    within_send_index: Optional[torch.Tensor] = None  # [P*C2]: slot -> forwarded row or -1
    within_return_index: Optional[torch.Tensor] = None  # [N2]: forwarded row -> slot or -1
    within_row_id_map: Optional[torch.Tensor] = None  # [G*C1, P]: stage 2's permute
    blocks: Optional[torch.Tensor] = None  # [P, G + 1] device: rows from (mate, source host)


class ByHostBudgetDispatcher(TokenDispatcher):
    """--moe-dispatch-hierarchy node with --moe-dispatch-budget (module docstring): both
    stages in fixed blocks of `ByHostBudget`, no host read; the rows reach the experts in
    once per rank's order already (`dispatch`)."""

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device, mode: DispatchMode,
                 budget: Optional[DispatchBudget] = None, *, routing):
        super().__init__(comm, num_experts, topk, ops, device, mode, budget, routing=routing)
        self.route = routing.route
        # per mate: a block per source host, then its empty slots -> per source host; and back
        self._blocks_to_source_major, self._blocks_to_mate_major = padded_block_transpose(
            self.route.per_host, self.route.hosts, device)

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        budget, route, hosts = self.budget, self.route, self.route.hosts
        block = budget.block_rows
        send_G = (row_id_map[:, :hosts] >= 0).sum(dim=0)
        budget.note(send_G)
        send_index, return_index = budget_indices(send_G, block, permuted_NH.shape[0])
        recv_M1H, recv_probs_M1K = _send_blocks(self.ops, route.between, permuted_NH,
                                                permuted_probs_N, send_index, return_index)
        rows_NH, probs_NL, within_map = once_per_peer(
            self.ops, recv_M1H, recv_probs_M1K, recv_probs_M1K >= 0, route.per_host,
            recv_M1H.shape[0] * min(self.topk, route.per_host))
        send_P = (within_map >= 0).sum(dim=0)
        budget.note_within(send_P)
        within_send, within_return = budget_indices(send_P, budget.within_rows,
                                                    rows_NH.shape[0])
        recv_MH, recv_probs_ML = _send_blocks(self.ops, route.within, rows_NH, probs_NL,
                                              within_send, within_return)
        blocks = self._received_blocks(within_map, block, budget.within_rows)
        recv_MH, recv_probs_ML = (
            self.ops.sort_chunks_by_idxs(t, blocks.reshape(-1), self._blocks_to_source_major)[0]
            for t in (recv_MH, recv_probs_ML))
        expert_rows = budget.expert_rows
        recv_probs_ML = cut_expert_pairs(budget, recv_probs_ML, expert_rows, self.topk)
        meta = ByHostBudgetMeta(
            input_splits=None, output_splits=None,
            recv_counts_RL=(recv_probs_ML >= 0).sum(dim=0, keepdim=True),
            tokens_per_local_expert=None, block_rows=block, send_index=send_index,
            return_index=return_index, expert_rows=expert_rows,
            within_send_index=within_send, within_return_index=within_return,
            within_row_id_map=within_map, blocks=blocks)
        return recv_MH, recv_probs_ML, meta

    def _received_blocks(self, within_map, block: int, within_rows: int) -> torch.Tensor:
        """[P, G + 1]: the rows each host mate's block for this rank holds from each source
        host, then its empty slots. Counted where they are sent (this rank's own blocks for its
        mates, per source host, cut at the block) and exchanged in a small all-to-all."""
        hosts, per_host = self.route.hosts, self.route.per_host
        sent_PG = (within_map >= 0).view(hosts, block, per_host).sum(dim=1).t()
        kept_PG = kept_counts(sent_PG, within_rows)
        got_PG = all_to_all(self.route.within, kept_PG.contiguous(), None, None)
        return torch.cat([got_PG, within_rows - got_PG.sum(dim=1, keepdim=True)], dim=1)

    def local_expert_rows(self, meta: DispatchMeta) -> int:
        return meta.expert_rows

    def combine(self, expert_out_MH, meta: ByHostBudgetMeta, row_id_map_TE):
        """Back to the mates' blocks, inside the host back (each forwarded row to its slot),
        each stage-1 row sums its ranks'; between hosts back, each token sums its hosts'."""
        route = self.route
        sizes = meta.blocks.reshape(-1).index_select(0, self._blocks_to_source_major)
        rows = self.ops.sort_chunks_by_idxs(expert_out_MH, sizes, self._blocks_to_mate_major)[0]
        gather = self.ops.gather_rows
        back_NH = move_rows(all_to_all(route.within, rows, None, None),
                            meta.within_return_index, meta.within_send_index, gather)
        rows_M1H = self.ops.unpermute(back_NH, meta.within_row_id_map)
        back_NH = move_rows(all_to_all(route.between, rows_M1H, None, None), meta.return_index,
                            meta.send_index, gather)
        return self.ops.unpermute(back_NH, row_id_map_TE[:, :route.hosts].contiguous())


def _send_blocks(ops: MoEOps, comm: ExpertComm, rows_NH, probs_NK, send_index, return_index):
    """One stage in fixed blocks: the rows to their slots (empty: zero rows, probs -1), then
    equal-split all-to-alls of rows and probs. -> (rows, probs) received."""
    block_XH = move_rows(rows_NH, send_index, return_index, ops.gather_rows)
    probs_XK = torch.where((send_index >= 0).unsqueeze(1),
                           move_rows(probs_NK, send_index, return_index, ops.gather_rows), -1.0)
    return all_to_all(comm, block_XH, None, None), all_to_all(comm, probs_XK, None, None)


def _send_rows(comm: ExpertComm, rows_NH, probs_NK, recv: list[int], send: list[int]):
    """One stage's all-to-alls: the rows, then their probs. -> (rows, probs) received."""
    return all_to_all(comm, rows_NH, recv, send), all_to_all(comm, probs_NK, recv, send)
