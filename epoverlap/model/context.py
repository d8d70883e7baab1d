"""Context parallelism (CP): each sequence split over the ranks of a CP group, and the
attention of each rank's queries over every rank's keys and values.

Owns the causal load balance (`local_positions`): the sequence is cut into 2 x CP equal chunks
and rank i holds chunks i and 2CP-1-i (Megatron-LM's get_batch_on_this_cp_rank), so under the
causal mask every rank has the same work. The model takes this rank's tokens and labels
(`ContextParallel.local`) in its embed and loss nodes, so the data path reads whole sequences,
as Megatron-LM's does, and its rotary positions are the held chunks' (`model.transformer`).
Everything but the core attention sees this rank's tokens only: norms, MLPs, router, dispatch.

`ContextParallel.attention` exchanges K/V over the CP group (`parallel.comm.ContextComm`) as
--cp-comm-type says:

  allgather  every rank's K/V gathered (backward: each rank's K/V grads summed on their owner,
             in rank order); each local query chunk then attends to the keys up to its own
             end, causal aligned lower right (SDPA).
  p2p        a ring of CP - 1 steps, each passing the K/V block held on to the next rank;
             each step's partial attention (its output and log-sum-exp, `partial_attention`)
             is merged into the running one (`merge`). With the load balance every block but
             the rank's own is mask-free: a block from an earlier rank is seen by every local
             query through its first chunk only, a block from a later rank by the second
             local chunk only. Backward: autograd through the merges and the transfers (a
             transfer's backward goes the other way round the ring).

With --reset-attention-mask (`model.documents`) each query also sees only the keys of its own
document: an explicit mask over the gathered keys, or per ring step (a query that sees nothing
of a block adds nothing to the merge: its partial log-sum-exp is -inf).

The ring runs inside the attn node, on the compute lane, and blocks it while it transfers.
The all-gather is a node of its own on the comm lane where the model has the lane's
communicator (`ContextComm.lane`): `qkv` (compute: norm, projection, rotary) -> `kv_gather`
(comm) -> `attn` (compute: `attend_gathered`, then the rest of the attn node), so the
combined 1F1B hides the gather, forward and backward, behind another microbatch's compute
(`schedule.plan`); without it (one-node layers, tests) the gather runs inside the attention.

Under per-layer CUDA graphs (`graphs.capture`) the attention is captured as it runs: with the
gather a node of its own the `attn` graph holds compute only (the gather stays eager on the
comm lane); the ring, or the gather inside the attention, is captured with it (NCCL
collectives on the CP group, replayed in the same order on every rank). Nothing in the
attention reads the host or copies from it: every rank's positions are on the device from
the start (`held`), the masks are made from them on the device.

Dynamic CP (--dynamic-context-parallel, `DynamicContext`): each microbatch runs at a size n
of a set (powers of 2 from --min-dynamic-context-parallel-size to CP), the smallest whose
segments of n x s tokens hold whole documents in every sequence (`DynamicContext.size_of`:
an end-of-document token before every segment boundary; CP always qualifies). The CP group
then works as CP / n groups of n consecutive ranks (made at start, `ContextComm.sizes`), group
j taking segment j with the same load balance inside it: every rank still holds s tokens of
the microbatch, no rank idles and every token is computed once; with per-document attention
(required) the segments do not see each other, so the losses are those of the whole group.
The segment is cut on the host before the batch goes to the device (`segments`), and the
size is read back in each node from the length of the tokens it is given (S: the whole
group's), so nodes of two microbatches at two sizes interleave under the overlapped
schedule. The ring or gather runs inside `attn` at the microbatch's size (under CUDA graphs
in the graphs of that size's runner, `graphs.banks.SizeBanks`); the counts of
--eod-mask-loss and the aux loss stay summed over the whole CP group (one microbatch).

Shape legend: B sequences, Q query heads, G key/value heads, s = S / CP local tokens,
c = s / 2 tokens of a chunk, D head dim, X = n x s a segment's tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from epoverlap.kernels.cross_entropy import IGNORE_INDEX
from epoverlap.model.documents import Documents
from epoverlap.model.dropout import grouped_kv
from epoverlap.model.varlen import uses_varlen, varlen_document_attention
from epoverlap.parallel.comm import ContextComm

COMM_TYPES = ("p2p", "allgather")


def local_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[s] the positions rank `cp_rank` holds: chunks cp_rank and 2CP-1-cp_rank of 2CP."""
    chunk = seq_length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


class ContextParallel:
    """One layer's view of the CP group: this rank's positions and the K/V exchange."""

    dynamic = False

    def __init__(self, comm: ContextComm, comm_type: str, seq_length: int,
                 device: torch.device, documents: Optional[Documents] = None):
        """`documents`: with --reset-attention-mask, attention stays inside each document
        (the keys' documents from the microbatch's whole tokens, which every rank has)."""
        if comm_type not in COMM_TYPES:
            raise ValueError(f"--cp-comm-type {comm_type}: allowed {', '.join(COMM_TYPES)}")
        self.comm, self.comm_type = comm, comm_type
        self.documents = documents if documents is not None and documents.reset_mask else None
        self.size, self.rank = comm.size, comm.rank
        # every rank's positions on the device, made once: the ring reads a block's source's
        # (a copy from the host inside attention would not capture in a CUDA graph)
        self.held = [local_positions(seq_length, self.size, r).to(device)
                     for r in range(self.size)]
        self.positions = self.held[self.rank]
        self.seq_length = seq_length

    def local(self, x_BS: torch.Tensor) -> torch.Tensor:
        """[B, S] (tokens, labels) -> [B, s]: this rank's chunks."""
        return x_BS[:, self.positions]

    def loss_share(self, loss: torch.Tensor, labels_Bs: torch.Tensor) -> torch.Tensor:
        """This rank's mean loss over its counted labels -> CP x its share of the sequence's
        mean (the grads and the reported loss average it over the CP ranks): the counts of
        labels are summed over the CP group, as Megatron-LM sums its loss mask's. Every rank
        counting alike (no masked labels), the factor is 1."""
        counted = (labels_Bs != IGNORE_INDEX).sum()
        total = self.comm.sum(counted)
        return loss * (counted.float() * self.size / total.clamp(min=1).float())

    def rotary_positions(self, tokens_BS: torch.Tensor, documents: Documents) -> torch.Tensor:
        """[B, s] this rank's tokens' rotary positions, restarting per document."""
        return self.local(documents.positions(tokens_BS))

    @property
    def on_comm_lane(self) -> bool:
        """Whether the K/V exchange is a node of its own on the comm lane (module doc)."""
        return self.comm_type == "allgather" and self.comm.lane is not None

    def attention(self, q_BQsD, k_BGsD, v_BGsD, tokens_BS=None) -> torch.Tensor:
        """Causal attention of the local queries over the whole sequence -> [B, Q, s, D]
        (`tokens_BS`: the whole sequences, read with per-document attention)."""
        if self.comm_type == "allgather" and self.size > 1:  # (size 1: dynamic CP's, no comm)
            kv_RKBGsD = self.comm.gather(torch.stack([k_BGsD, v_BGsD]))
            return self.attend_gathered(q_BQsD, kv_RKBGsD, tokens_BS)
        if self.size == 1 and self._varlen(q_BQsD):  # dynamic CP's size 1 on GPUs: no ring
            return varlen_document_attention(q_BQsD, k_BGsD, v_BGsD,
                                             self.documents.ids(tokens_BS),
                                             self.documents.capacity)
        return self._ring(q_BQsD, k_BGsD, v_BGsD, tokens_BS)

    def _visible(self, tokens_BS, q_pos, k_pos) -> Optional[torch.Tensor]:
        """[B, 1, n, m] the per-document mask of these positions (None without it)."""
        if self.documents is None:
            return None
        return self.documents.visible(self.documents.ids(tokens_BS), q_pos, k_pos)

    # ----------------------------------------------------------------- allgather
    def gather(self, kv_KBGsD: torch.Tensor) -> torch.Tensor:
        """[K, V] stacked [2, B, G, s, D] -> every rank's [CP, 2, B, G, s, D], on the comm
        lane's communicator (the `kv_gather` node)."""
        return self.comm.lane.gather(kv_KBGsD)

    def attend_gathered(self, q_BQsD, kv_RKBGsD, tokens_BS=None) -> torch.Tensor:
        """The local queries over every rank's gathered [K, V] -> [B, Q, s, D]."""
        k_BGSD, v_BGSD = in_sequence_order(kv_RKBGsD)
        c = q_BQsD.shape[2] // 2
        outs = []
        varlen = self._varlen(q_BQsD)  # per document, on GPUs in 16 bits (model.varlen)
        doc_BS = self.documents.ids(tokens_BS) if varlen else None
        for half, chunk in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            end = (chunk + 1) * c
            if varlen:
                outs.append(varlen_document_attention(
                    q_BQsD[:, :, half * c:(half + 1) * c], k_BGSD[:, :, :end],
                    v_BGSD[:, :, :end], doc_BS, self.documents.capacity, q_lo=chunk * c))
                continue
            q_pos = self.positions[half * c:(half + 1) * c]
            mask = self._visible(tokens_BS, q_pos, torch.arange(end, device=q_pos.device))
            outs.append(_sdpa(q_BQsD[:, :, half * c:(half + 1) * c], k_BGSD[:, :, :end],
                              v_BGSD[:, :, :end], mask))
        return torch.cat(outs, dim=2)

    def _varlen(self, q_BQsD: torch.Tensor) -> bool:
        """Whether attention runs per document on the variable-length kernel (without
        documents SDPA's lower-right causal bias is the faster: benchmarks/context_parallel.md)."""
        return self.documents is not None and uses_varlen(q_BQsD)

    # ----------------------------------------------------------------- p2p ring
    def _ring(self, q_BQsD, k_BGsD, v_BGsD, tokens_BS=None) -> torch.Tensor:
        kv = torch.stack([k_BGsD, v_BGsD])
        c, mine = q_BQsD.shape[2] // 2, self.positions
        out, lse = partial_attention(q_BQsD, k_BGsD, v_BGsD, causal=True,
                                     visible=self._visible(tokens_BS, mine, mine))
        for step in range(1, self.size):
            kv = self.comm.shift(kv)
            source = (self.rank - step) % self.size
            theirs = self.held[source]
            if source < self.rank:  # every local query sees the block's first chunk only
                mask = self._visible(tokens_BS, mine, theirs[:c])
                part = partial_attention(q_BQsD, kv[0][:, :, :c], kv[1][:, :, :c],
                                         visible=mask)
                out, lse = merge(out, lse, *part)
            else:  # the second local chunk sees the whole block, the first chunk none of it
                mask = self._visible(tokens_BS, mine[c:], theirs)
                part = partial_attention(q_BQsD[:, :, c:], kv[0], kv[1], visible=mask)
                tail = merge(out[:, :, c:], lse[:, :, c:], *part)
                out = torch.cat([out[:, :, :c], tail[0]], dim=2)
                lse = torch.cat([lse[:, :, :c], tail[1]], dim=2)
        return out.to(q_BQsD.dtype)


def dynamic_sizes(cp_size: int, least: int) -> tuple[int, ...]:
    """Dynamic CP's sizes: the powers of 2 from `least` to `cp_size`, ascending."""
    return tuple(least << k for k in range((cp_size // least).bit_length()))


def layer_contexts(comm_types: tuple[str, ...], seq_length: int, dynamic: bool,
                   cp_comm: Optional[ContextComm], device: torch.device,
                   documents: Optional[Documents]) -> dict:
    """Every layer's view of the CP group ({} without CP): a `DynamicContext` under
    --dynamic-context-parallel (`dynamic`), else a `ContextParallel`; `comm_types`: each
    layer's --cp-comm-type."""
    if cp_comm is None:
        return {}
    kind = DynamicContext if dynamic else ContextParallel
    return {layer: kind(cp_comm, comm_type, seq_length, device, documents)
            for layer, comm_type in enumerate(comm_types)}


class DynamicContext:
    """One layer's view of dynamic CP (module doc): a `ContextParallel` per size over that
    size's group, the one in use read from the length X of the tokens a node is given."""

    dynamic, on_comm_lane = True, False

    def __init__(self, comm: ContextComm, comm_type: str, seq_length: int,
                 device: torch.device, documents: Documents):
        self.comm, self.size, self.rank = comm, comm.size, comm.rank
        self.documents = documents
        self.local_tokens = seq_length // comm.size
        self.views = {n: ContextParallel(sub, comm_type, n * self.local_tokens, device,
                                         documents) for n, sub in comm.sizes.items()}
        self.sizes = tuple(sorted(self.views))
        self.chosen: Counter = Counter()  # microbatches run at each size (`segments`)

    def view(self, x_BX: torch.Tensor) -> ContextParallel:
        return self.views[x_BX.shape[1] // self.local_tokens]

    def offset(self, size: int) -> int:
        """The first position of this rank's segment at `size`."""
        return (self.rank // size) * size * self.local_tokens

    def size_of(self, tokens_BS: torch.Tensor) -> int:
        """The smallest size whose segment boundaries all follow an end-of-document token."""
        ends_BS, seq = tokens_BS == self.documents.eod, tokens_BS.shape[1]
        for size in self.sizes:
            span = size * self.local_tokens
            if bool(ends_BS[:, span - 1:seq - 1:span].all()):
                return size
        return self.size

    def segments(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor):
        """Whole sequences (host) -> this rank's segment of tokens and labels [B, X] at the
        microbatch's size."""
        size = self.size_of(tokens_BS)
        self.chosen[size] += 1
        begin = self.offset(size)
        end = begin + size * self.local_tokens
        return tokens_BS[:, begin:end], labels_BS[:, begin:end]

    def report(self) -> str:
        """'dynamic CP: microbatches at size 1: 5, at 2: 11 (this rank's CP group)'."""
        sizes = ", at ".join(f"{size}: {self.chosen[size]}" for size in self.sizes)
        return f"dynamic CP: microbatches at size {sizes} (this rank's CP group)"

    def local(self, x_BX: torch.Tensor) -> torch.Tensor:
        """[B, X] (a segment, or whole sequences: X = S) -> [B, s] this rank's chunks."""
        return self.view(x_BX).local(x_BX)

    def loss_share(self, loss: torch.Tensor, labels_Bs: torch.Tensor) -> torch.Tensor:
        """As `ContextParallel.loss_share`, over the whole CP group (one microbatch)."""
        return self.views[self.size].loss_share(loss, labels_Bs)

    def attention(self, q_BQsD, k_BGsD, v_BGsD, tokens_BX) -> torch.Tensor:
        """The local queries over their segment's keys, at the segment's size."""
        return self.view(tokens_BX).attention(q_BQsD, k_BGsD, v_BGsD, tokens_BX)

    def rotary_positions(self, tokens_BX: torch.Tensor, documents: Documents) -> torch.Tensor:
        """[B, s] this rank's tokens' rotary positions in the whole sequence (restarting per
        document with --reset-position-ids)."""
        view = self.view(tokens_BX)
        if documents.reset_positions:
            return view.local(documents.positions(tokens_BX))
        at = self.offset(tokens_BX.shape[1] // self.local_tokens) + view.positions
        return at.expand(tokens_BX.shape[0], -1)


def in_sequence_order(kv_RKBGsD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's [K, V] (rank r holding chunks r and 2R-1-r) -> K, V [B, G, S, D] in
    position order."""
    ranks = kv_RKBGsD.shape[0]
    c = kv_RKBGsD.shape[4] // 2
    order = [(n, 0) if n < ranks else (2 * ranks - 1 - n, 1) for n in range(2 * ranks)]
    kv_KBGSD = torch.cat([kv_RKBGsD[r, :, :, :, half * c:(half + 1) * c] for r, half in order],
                         dim=3)
    return kv_KBGSD[0], kv_KBGSD[1]


def _sdpa(q_BQcD, k_BGnD, v_BGnD, mask=None) -> torch.Tensor:
    """SDPA under `mask` [B, 1, c, n], or causal with the last query at the last key's
    position (query i of c sees keys up to n - c + i)."""
    k_BGnD, v_BGnD, gqa = grouped_kv(q_BQcD, k_BGnD, v_BGnD)
    if mask is None:
        mask = causal_lower_right(q_BQcD.shape[2], k_BGnD.shape[2])
    return F.scaled_dot_product_attention(q_BQcD, k_BGnD, v_BGnD, attn_mask=mask,
                                          enable_gqa=gqa)


def partial_attention(q_BQnD, k_BGmD, v_BGmD, causal: bool = False,
                      visible: Optional[torch.Tensor] = None):
    """Attention of n queries over m keys (causal: top-left aligned, n = m; `visible`
    [B, 1, n, m]: which keys each query sees, instead), in fp32 -> (output [B, Q, n, D],
    log-sum-exp of each query's scores [B, Q, n]; a query that sees no key: 0 and -inf)."""
    repeat = q_BQnD.shape[1] // k_BGmD.shape[1]
    k = k_BGmD.float().repeat_interleave(repeat, dim=1)
    v = v_BGmD.float().repeat_interleave(repeat, dim=1)
    scores_BQnm = q_BQnD.float() @ k.transpose(-1, -2) / math.sqrt(q_BQnD.shape[-1])
    if visible is None and causal:
        n, m = scores_BQnm.shape[-2:]
        visible = torch.ones(n, m, dtype=torch.bool, device=q_BQnD.device).tril()
    if visible is not None:
        scores_BQnm = scores_BQnm.masked_fill(~visible, float("-inf"))
    lse_BQn = torch.logsumexp(scores_BQnm, dim=-1)
    finite_BQn = torch.where(torch.isfinite(lse_BQn), lse_BQn, 0.0)
    out = torch.exp(scores_BQnm - finite_BQn.unsqueeze(-1)) @ v
    return out, lse_BQn


def merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys -> their union's."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
           + torch.exp(lse_b - lse).unsqueeze(-1) * out_b)
    return out, lse
