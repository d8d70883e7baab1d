"""The chunked MoE all-to-all (--moe-a2a-chunks K): an MoE layer's dispatch, experts and
combine cut into K chunks, each a group of a rank's local experts with its own all-to-alls, so
the dispatch of chunk i+1 and the combine of chunk i run while the experts compute chunk i,
forward and backward, inside one microbatch (the executor chains each chunk on its own event:
`schedule.executor.Chains`).

Owns `expert_groups` (the K groups), `ChunkedMeta` (each chunk's split sizes, read once on the
host) and `ChunkedMoE`, the node callables of a chunked layer and their `NodeSpec`s:

  dispatch_c0  (comm)    read the split sizes; cut the permuted rows into the K chunks' send
                         buffers; all-to-all of chunk 0
  dispatch_cI  (comm)    all-to-all of chunk I's buffer
  mlp_cI       (compute) sort chunk I's rows by expert, its experts' grouped SwiGLU, unsort
  return_cI    (comm)    all-to-all of chunk I's expert outputs back
  combine      (comm)    the returned chunks back into the permuted layout, unpermute (+ the
                         layer's tail: shared expert, dropout, residual)

Why groups of experts and not slices of tokens: an expert then sees the rows it sees unchunked,
in the same order (its rows from each source rank, rank by rank), its weight grad sums the same
rows in the same order, and the combine puts every returned row back where the unchunked
all-to-all would have before the unpermute sums a token's rows: the same bits as K = 1. Cutting
and reassembling are copies (split and cat), never sums. Chunk c sends to rank r the rows of
rank r's experts in group c: one run of the expert-major permuted rows per rank.

Shape legend: R EP ranks, L local experts, G a group's experts, K chunks, N permuted rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from epoverlap.model.dispatch import ExpertOrder, TokenDispatcher
from epoverlap.model.moe import GroupedSwiGLUExperts
from epoverlap.model.nodes import COMM, COMPUTE, NodeSpec, hidden_value, layer_value
from epoverlap.parallel.comm import SplitExchange, all_to_all


def expert_groups(num_local: int, chunks: int) -> list[tuple[int, int]]:
    """K contiguous groups (start, end) of the local experts, sizes differing by at most one
    (the first ones larger)."""
    if not 1 <= chunks <= num_local:
        raise ValueError(f"{chunks} chunks of {num_local} local experts")
    base, extra = divmod(num_local, chunks)
    bounds = [0]
    for c in range(chunks):
        bounds.append(bounds[-1] + base + (c < extra))
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class ChunkedMeta:
    """What a chunked layer's nodes need after the split sizes are read (host lists), and the
    received counts on the device."""

    groups: list[tuple[int, int]]
    send_RK: list[list[int]]  # rows this rank sends rank r in chunk k
    recv_RK: list[list[int]]  # rows this rank receives from rank r in chunk k
    recv_RL: list[list[int]]  # rows received per (source rank, local expert)
    recv_counts_RL: torch.Tensor  # [R, L] device: the same, for the sorts

    @classmethod
    def of(cls, groups: list[tuple[int, int]], sent_RL: list, recv_RL: list,
           recv_counts_RL: torch.Tensor) -> "ChunkedMeta":
        def per_chunk(rows_RL):
            return [[sum(row[a:b]) for a, b in groups] for row in rows_RL]
        return cls(groups, per_chunk(sent_RL), per_chunk(recv_RL), recv_RL, recv_counts_RL)

    def send_splits(self, chunk: int) -> list[int]:
        return [row[chunk] for row in self.send_RK]

    def recv_splits(self, chunk: int) -> list[int]:
        return [row[chunk] for row in self.recv_RK]

    def expert_rows(self, chunk: int) -> list[int]:
        """Rows of each of the chunk's experts, summed over source ranks (host)."""
        start, end = self.groups[chunk]
        return [sum(row[e] for row in self.recv_RL) for e in range(start, end)]


def split_by_chunk(rows: torch.Tensor, send_RK: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Expert-major rows (rank r's runs for chunks 0..K-1, rank by rank) -> K send buffers
    (chunk k: its runs for ranks 0..R-1). Copies; the backward is the reverse copy."""
    chunks = len(send_RK[0])
    pieces = torch.split(rows, [n for row in send_RK for n in row])
    return [torch.cat(pieces[k::chunks]) for k in range(chunks)]


def join_chunks(chunk_rows: Sequence[torch.Tensor], send_RK: Sequence[Sequence[int]]
                ) -> torch.Tensor:
    """`split_by_chunk` reversed: K buffers (chunk k: runs for ranks 0..R-1) -> the rows in
    expert-major order."""
    per_chunk = [torch.split(rows, [row[k] for row in send_RK])
                 for k, rows in enumerate(chunk_rows)]
    return torch.cat([per_chunk[k][r] for r in range(len(send_RK))
                      for k in range(len(chunk_rows))])


class ChunkedMoE:
    """The node callables of one chunked MoE layer (module docstring), over the layer's
    dispatcher (dropless or capacity: split sizes read on the host) and experts. `SIZES`: the
    layer value `dispatch_c0` sizes the chunks by (the budget's form: `model.chunked_budget`)."""

    SIZES = "split_exchange"

    def __init__(self, dispatcher: TokenDispatcher, experts: GroupedSwiGLUExperts,
                 chunks: int, device: torch.device):
        self.dispatcher, self.experts = dispatcher, experts
        self.comm, self.ops = dispatcher.comm, dispatcher.ops
        self.ranks = dispatcher.comm.size
        self.groups = expert_groups(dispatcher.num_local, chunks)
        self._orders = {size: ExpertOrder(self.ranks, size, device)  # per chunk size
                        for size in {end - start for start, end in self.groups}}

    @property
    def chunks(self) -> int:
        return len(self.groups)

    def dispatch_first(self, permuted_tokens, permuted_probs, sizes: SplitExchange):
        """Read the split sizes; cut the rows into the chunks' send buffers; send chunk 0."""
        sent_RL, recv_RL = sizes.read_pairs()
        meta = ChunkedMeta.of(self.groups, sent_RL, recv_RL, sizes.recv_RL)
        routed = sum(map(sum, meta.send_RK))  # the rows past the routed ones are not sent
        tokens = split_by_chunk(permuted_tokens[:routed], meta.send_RK)
        probs = split_by_chunk(permuted_probs[:routed], meta.send_RK)
        out = self.dispatch_chunk(0, tokens[0], probs[0], meta)
        out["meta"] = meta
        for k in range(1, self.chunks):
            out[f"send_tokens_c{k}"], out[f"send_probs_c{k}"] = tokens[k], probs[k]
        return out

    def dispatch_chunk(self, chunk: int, send_tokens, send_probs, meta: ChunkedMeta) -> dict:
        splits = (meta.recv_splits(chunk), meta.send_splits(chunk))
        return {f"recv_tokens_c{chunk}": all_to_all(self.comm, send_tokens, *splits),
                f"recv_probs_c{chunk}": all_to_all(self.comm, send_probs, *splits)}

    def experts_chunk(self, chunk: int, recv_tokens, recv_probs, meta: ChunkedMeta) -> dict:
        """Chunk `chunk`'s rows (source rank, expert) -> expert-major -> its experts -> back."""
        start, end = self.groups[chunk]
        order, counts_RG = self._orders[end - start], meta.recv_counts_RL[:, start:end]
        tokens, probs = order.to_expert_major(self.ops, recv_tokens, recv_probs, counts_RG)
        out = self.experts(tokens, probs, counts_RG.sum(dim=0), meta.expert_rows(chunk),
                           experts=(start, end))
        return {f"expert_out_c{chunk}": order.to_rank_major(self.ops, out, counts_RG)}

    def return_chunk(self, chunk: int, expert_out, meta: ChunkedMeta) -> dict:
        return {f"returned_c{chunk}": all_to_all(self.comm, expert_out,
                                                 meta.send_splits(chunk),
                                                 meta.recv_splits(chunk))}

    def combine(self, returned: Sequence[torch.Tensor], meta: ChunkedMeta,
                row_id_map) -> torch.Tensor:
        """The returned chunks in the permuted layout, each token's rows summed."""
        return self.ops.unpermute(join_chunks(returned, meta.send_RK), row_id_map)

    def node_specs(self, layer: int, combine_fn, combine_inputs: dict) -> list[NodeSpec]:
        """The layer's nodes after `attn` (module docstring): dispatch_c0..c(K-1), then mlp_cI
        and return_cI per chunk, then `combine`, which runs `combine_fn` on the returned
        chunks (`returned_cI`) and `combine_inputs` (local name -> value name)."""
        def values(*names):
            return {name: layer_value(layer, name) for name in names}

        def chunk_node(name, k, lane, fn, inputs, outputs, **kind):
            return NodeSpec(name=f"{name}_c{k}", layer=layer, lane=lane,
                            fn=functools.partial(fn, k), inputs=inputs,
                            outputs=values(*outputs), chunk=k, **kind)

        sends = [f"send_{what}_c{k}" for k in range(1, self.chunks)
                 for what in ("tokens", "probs")]
        specs = [NodeSpec(name="dispatch_c0", layer=layer, lane=COMM, fn=self.dispatch_first,
                          inputs={**values("permuted_tokens", "permuted_probs"),
                                  "sizes": layer_value(layer, self.SIZES)},
                          outputs=values("recv_tokens_c0", "recv_probs_c0", "meta", *sends),
                          slot="dispatch", chunk=0)]
        meta = {"meta": layer_value(layer, "meta")}
        for k in range(1, self.chunks):
            specs.append(chunk_node(
                "dispatch", k, COMM, self.dispatch_chunk,
                {"send_tokens": layer_value(layer, f"send_tokens_c{k}"),
                 "send_probs": layer_value(layer, f"send_probs_c{k}"), **meta},
                (f"recv_tokens_c{k}", f"recv_probs_c{k}"), slot="dispatch"))
        for k in range(self.chunks):
            specs += [
                chunk_node("mlp", k, COMPUTE, self.experts_chunk,
                           {"recv_tokens": layer_value(layer, f"recv_tokens_c{k}"),
                            "recv_probs": layer_value(layer, f"recv_probs_c{k}"), **meta},
                           (f"expert_out_c{k}",), slot="mlp", has_weights=True),
                chunk_node("return", k, COMM, self.return_chunk,
                           {"expert_out": layer_value(layer, f"expert_out_c{k}"), **meta},
                           (f"returned_c{k}",), slot="mlp")]
        returned = values(*(f"returned_c{k}" for k in range(self.chunks)))
        return specs + [NodeSpec(name="combine", layer=layer, lane=COMM, fn=combine_fn,
                                 inputs={**combine_inputs, **returned},
                                 outputs={"hidden": hidden_value(layer + 1)})]
