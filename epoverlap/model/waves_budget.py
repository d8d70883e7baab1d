"""The MoE all-to-all in waves over the budget dispatch (--moe-a2a-waves K with
--moe-dispatch-budget F): `WaveBudgetMoE`, the nodes of `model.waves` with no host read,
so a graph over the whole iteration can hold them; and `make_waves`, which picks the form of
a layer's dispatcher.

Wave k sends every rank one fixed-size block for that rank's expert group k, of
`GroupBudget.rows[k]` slots (`model.budget`: F x the balanced share of the group, per rank
pair), its rows for the group's experts in order, then empty slots (zero rows, prob 0). The
counts are exchanged on the device (`ExpertComm.exchange_counts`). A rank whose rows for one
rank's group overflow the block sends the first block of them and records its demand
(`GroupBudget.note`); after the step the trainer reruns at the budget level that holds it, as
for the unsplit budget (`training.loop.step`). The blocks are cut from the permuted rows and put
back by one row move each way (`model.dispatch.rows.move_rows`: copies, grads copied back), so a
step that fits gives the unsplit dropless layer's bits: an expert sees its rows from each
source rank, rank by rank, padding after the group's last expert.

Shape legend: R EP ranks, L local experts, G a group's experts, C_k wave k's slots per rank,
N permuted rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epoverlap.model.waves import WaveMoE
from epoverlap.model.dispatch import TokenDispatcher
from epoverlap.model.dispatch.rows import (block_indices, kept_counts, move_rows,
                                           padded_block_transpose)
from epoverlap.model.moe import GroupedSwiGLUExperts
from epoverlap.parallel.comm import all_to_all


@dataclass
class WaveBudgetMeta:
    """What a budget layer in waves's nodes need after `dispatch_w0`, all on the device but the
    static wave sizes."""

    rows_K: list[int]  # slots per rank in wave k's buffer (host: the level's sizes)
    send_index: torch.Tensor  # [sum R*C_k]: slot of the K buffers end to end -> row or -1
    return_index: torch.Tensor  # [N]: permuted row -> slot, or -1 (cut)
    kept_RL: torch.Tensor  # [R, L]: rows received per (source rank, local expert), kept


class WaveBudgetMoE(WaveMoE):
    """`WaveMoE` over a `model.dispatch.sizing.BudgetDispatcher` (module docstring)."""

    SIZES = "expert_counts"

    def __init__(self, dispatcher: TokenDispatcher, experts: GroupedSwiGLUExperts,
                 waves: int, device: torch.device):
        super().__init__(dispatcher, experts, waves, device)
        self.budget = dispatcher.budget.group_budget(
            [end - start for start, end in self.groups], dispatcher.topk,
            dispatcher.num_experts)
        self._transposes = {size: padded_block_transpose(self.ranks, size, device)
                            for size in {end - start for start, end in self.groups}}

    def dispatch_first(self, permuted_tokens, permuted_probs, sizes: torch.Tensor):
        """Count the rows per (rank, group) on the device, record the demand, cut the rows into
        the waves' fixed blocks; send wave 0."""
        rows_K, num_rows = self.budget.rows, permuted_tokens.shape[0]
        self.dispatcher.budget.check_rows(num_rows)
        counts_RL = sizes.view(self.ranks, -1)
        send_RK = torch.stack([counts_RL[:, a:b].sum(dim=1) for a, b in self.groups], dim=1)
        self.budget.note(send_RK)
        self.dispatcher.budget.note_wire(send_RK.sum(dim=1), sum(rows_K))
        recv_RL = self.comm.exchange_counts(sizes)
        send, return_index = block_indices(send_RK, rows_K, num_rows)
        send_index = torch.cat(send)
        blocks = [self.ranks * rows for rows in rows_K]
        gather = self.ops.gather_rows
        tokens = move_rows(permuted_tokens, send_index, return_index, gather).split(blocks)
        probs = move_rows(permuted_probs, send_index, return_index, gather).split(blocks)
        kept_RL = torch.cat([kept_counts(recv_RL[:, a:b], rows)
                             for (a, b), rows in zip(self.groups, rows_K)], dim=1)
        meta = WaveBudgetMeta(rows_K, send_index, return_index, kept_RL)
        out = self.dispatch_wave(0, tokens[0], probs[0], meta)
        out["meta"] = meta
        for k in range(1, self.waves):
            out[f"send_tokens_w{k}"], out[f"send_probs_w{k}"] = tokens[k], probs[k]
        return out

    def dispatch_wave(self, wave: int, send_tokens, send_probs, meta) -> dict:
        return {f"recv_tokens_w{wave}": all_to_all(self.comm, send_tokens, None, None),
                f"recv_probs_w{wave}": all_to_all(self.comm, send_probs, None, None)}

    def experts_wave(self, wave: int, recv_tokens, recv_probs, meta) -> dict:
        """Wave `wave`'s blocks (source rank: its rows per expert, then padding) -> expert
        major, paddings last -> its experts -> back."""
        start, end = self.groups[wave]
        to_experts, to_ranks = self._transposes[end - start]
        kept_RG = meta.kept_RL[:, start:end]
        pad_R1 = meta.rows_K[wave] - kept_RG.sum(dim=1, keepdim=True)
        sizes = torch.cat([kept_RG, pad_R1], dim=1).reshape(-1)
        tokens, probs = self.ops.sort_chunks_by_idxs(recv_tokens, sizes, to_experts, recv_probs)
        out = self.experts(tokens, probs, kept_RG.sum(dim=0), None, experts=(start, end))
        back = self.ops.sort_chunks_by_idxs(out, sizes.index_select(0, to_experts), to_ranks)[0]
        return {f"expert_out_w{wave}": back}

    def return_wave(self, wave: int, expert_out, meta) -> dict:
        return {f"returned_w{wave}": all_to_all(self.comm, expert_out, None, None)}

    def combine(self, returned, meta: WaveBudgetMeta, row_id_map) -> torch.Tensor:
        """The returned blocks onto the permuted rows (a cut row's come back as zeros), each
        token's rows summed."""
        rows = move_rows(torch.cat(list(returned)), meta.return_index, meta.send_index,
                         self.ops.gather_rows)
        return self.ops.unpermute(rows, row_id_map)


def make_waves(dispatcher: TokenDispatcher, experts: GroupedSwiGLUExperts, waves: int,
                 device: torch.device) -> WaveMoE:
    """The layer in waves of `dispatcher`'s form: host-read split sizes, or the budget's."""
    budget_form = dispatcher.budget is not None and not dispatcher.reads_host
    return (WaveBudgetMoE if budget_form else WaveMoE)(dispatcher, experts, waves,
                                                             device)
