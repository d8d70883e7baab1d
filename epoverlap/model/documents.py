"""Packed samples: the documents of a sample, as Megatron-LM's --reset-position-ids and
--reset-attention-mask see them (its `get_ltor_masks_and_position_ids`).

Owns `Documents` (the rules a run asks for and the end-of-document id) and what they make of a
microbatch's tokens [B, S]: which document each position belongs to (an end-of-document token
belongs to the document it ends; the next position starts a new one), each position's place in
its document (the rotary position, with --reset-position-ids), and which keys a query may see
(with --reset-attention-mask: the earlier keys of its own document; else every earlier key).
The tokens are whole sequences on every rank (under context parallelism too), so every rank
knows every position's document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    """The run's document rules and its end-of-document id."""

    eod: int
    reset_positions: bool
    reset_mask: bool
    capacity: int  # documents a sample may hold (--max-documents-per-sample)

    def check_capacity(self, tokens_BS: torch.Tensor) -> None:
        """Stops the run, naming the flag, when a sample of these host tokens holds more
        documents than the capacity (per-document attention's table, `model.varlen`)."""
        if not self.reset_mask:
            return
        most = int((tokens_BS[:, :-1] == self.eod).sum(dim=1).max()) + 1
        if most > self.capacity:
            raise ValueError(f"--max-documents-per-sample={self.capacity}: a sample holds "
                             f"{most} documents; give at least {most}")

    def check_batches(self, batches) -> None:
        """`check_capacity` of each (tokens, labels) of a step's host batches."""
        for tokens_BS, _ in batches:
            self.check_capacity(tokens_BS)

    def ids(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """[B, S] the document index of each position (0 for the first document)."""
        ends_BS = (tokens_BS == self.eod).long()
        return ends_BS.cumsum(dim=1) - ends_BS

    def positions(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """[B, S] each position's rotary position: its index, or with --reset-position-ids its
        place in its document."""
        seq = tokens_BS.shape[1]
        index_BS = torch.arange(seq, device=tokens_BS.device).expand_as(tokens_BS)
        if not self.reset_positions:
            return index_BS
        return index_BS - _running_start(index_BS, self.ids(tokens_BS))

    def visible(self, doc_BS: torch.Tensor, q_pos, k_pos) -> torch.Tensor:
        """[B, 1, n, m] whether query positions `q_pos` [n] see key positions `k_pos` [m]:
        causal, and with --reset-attention-mask inside the query's document only."""
        causal_nm = k_pos.view(1, -1) <= q_pos.view(-1, 1)
        if not self.reset_mask:
            return causal_nm.view(1, 1, *causal_nm.shape)
        same_Bnm = doc_BS[:, q_pos].unsqueeze(2) == doc_BS[:, k_pos].unsqueeze(1)
        return (same_Bnm & causal_nm).unsqueeze(1)


def _running_start(index_BS: torch.Tensor, doc_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] the first index of each position's document."""
    first_BS = torch.where(doc_BS.diff(dim=1, prepend=doc_BS[:, :1] - 1) != 0, index_BS, 0)
    return first_BS.cummax(dim=1).values
