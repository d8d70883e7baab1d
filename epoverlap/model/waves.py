"""The MoE all-to-all in waves (--moe-a2a-waves K): an MoE layer's dispatch, experts and
combine cut into K waves, each a group of a rank's local experts with its own all-to-alls, so
the dispatch of wave i+1 and the combine of wave i run while the experts compute wave i,
forward and backward, inside one microbatch (the executor chains each wave on its own event:
`schedule.executor.Chains`).

Owns `expert_groups` (the K groups), `WaveMeta` (each wave's split sizes, read once on the
host) and `WaveMoE`, the node callables of a layer in waves and their `NodeSpec`s:

  dispatch_w0  (comm)    read the split sizes; cut the permuted rows into the K waves' send
                         buffers; all-to-all of wave 0
  dispatch_wI  (comm)    all-to-all of wave I's buffer
  mlp_wI       (compute) sort wave I's rows by expert, its experts' grouped SwiGLU, unsort
  return_wI    (comm)    all-to-all of wave I's expert outputs back
  combine      (comm)    the returned waves back into the permuted layout, unpermute (+ the
                         layer's tail: shared expert, dropout, residual)

Why groups of experts and not slices of tokens: an expert then sees the rows it sees unsplit,
in the same order (its rows from each source rank, rank by rank), its weight grad sums the same
rows in the same order, and the combine puts every returned row back where the unsplit
all-to-all would have before the unpermute sums a token's rows: the same bits as K = 1. Cutting
and reassembling are copies (split and cat), never sums. Wave c sends to rank r the rows of
rank r's experts in group c: one run of the expert-major permuted rows per rank.

Shape legend: R EP ranks, L local experts, G a group's experts, K waves, N permuted rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from epoverlap.model.dispatch import TokenDispatcher
from epoverlap.model.dispatch.rows import ExpertOrder
from epoverlap.model.moe import GroupedSwiGLUExperts
from epoverlap.model.nodes import COMM, COMPUTE, NodeSpec, hidden_value, layer_value
from epoverlap.parallel.comm import SplitExchange, all_to_all


def expert_groups(num_local: int, waves: int) -> list[tuple[int, int]]:
    """K contiguous groups (start, end) of the local experts, sizes differing by at most one
    (the first ones larger)."""
    if not 1 <= waves <= num_local:
        raise ValueError(f"{waves} waves of {num_local} local experts")
    base, extra = divmod(num_local, waves)
    bounds = [0]
    for c in range(waves):
        bounds.append(bounds[-1] + base + (c < extra))
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class WaveMeta:
    """What the nodes of a layer in waves need after the split sizes are read (host lists), and the
    received counts on the device."""

    groups: list[tuple[int, int]]
    send_RK: list[list[int]]  # rows this rank sends rank r in wave k
    recv_RK: list[list[int]]  # rows this rank receives from rank r in wave k
    recv_RL: list[list[int]]  # rows received per (source rank, local expert)
    recv_counts_RL: torch.Tensor  # [R, L] device: the same, for the sorts

    @classmethod
    def of(cls, groups: list[tuple[int, int]], sent_RL: list, recv_RL: list,
           recv_counts_RL: torch.Tensor) -> "WaveMeta":
        def per_wave(rows_RL):
            return [[sum(row[a:b]) for a, b in groups] for row in rows_RL]
        return cls(groups, per_wave(sent_RL), per_wave(recv_RL), recv_RL, recv_counts_RL)

    def send_splits(self, wave: int) -> list[int]:
        return [row[wave] for row in self.send_RK]

    def recv_splits(self, wave: int) -> list[int]:
        return [row[wave] for row in self.recv_RK]

    def expert_rows(self, wave: int) -> list[int]:
        """Rows of each of the wave's experts, summed over source ranks (host)."""
        start, end = self.groups[wave]
        return [sum(row[e] for row in self.recv_RL) for e in range(start, end)]


def split_by_wave(rows: torch.Tensor, send_RK: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Expert-major rows (rank r's runs for waves 0..K-1, rank by rank) -> K send buffers
    (wave k: its runs for ranks 0..R-1). Copies; the backward is the reverse copy."""
    waves = len(send_RK[0])
    pieces = torch.split(rows, [n for row in send_RK for n in row])
    return [torch.cat(pieces[k::waves]) for k in range(waves)]


def join_waves(wave_rows: Sequence[torch.Tensor], send_RK: Sequence[Sequence[int]]
                ) -> torch.Tensor:
    """`split_by_wave` reversed: K buffers (wave k: runs for ranks 0..R-1) -> the rows in
    expert-major order."""
    per_wave = [torch.split(rows, [row[k] for row in send_RK])
                 for k, rows in enumerate(wave_rows)]
    return torch.cat([per_wave[k][r] for r in range(len(send_RK))
                      for k in range(len(wave_rows))])


class WaveMoE:
    """The node callables of one MoE layer in waves (module docstring), over the layer's
    dispatcher (dropless or capacity: split sizes read on the host) and experts. `SIZES`: the
    layer value `dispatch_w0` sizes the waves by (the budget's form: `model.waves_budget`)."""

    SIZES = "split_exchange"

    def __init__(self, dispatcher: TokenDispatcher, experts: GroupedSwiGLUExperts,
                 waves: int, device: torch.device):
        self.dispatcher, self.experts = dispatcher, experts
        self.comm, self.ops = dispatcher.comm, dispatcher.ops
        self.ranks = dispatcher.comm.size
        self.groups = expert_groups(dispatcher.num_local, waves)
        self._orders = {size: ExpertOrder(self.ranks, size, device)  # per wave size
                        for size in {end - start for start, end in self.groups}}

    @property
    def waves(self) -> int:
        return len(self.groups)

    def dispatch_first(self, permuted_tokens, permuted_probs, sizes: SplitExchange):
        """Read the split sizes; cut the rows into the waves' send buffers; send wave 0."""
        sent_RL, recv_RL = sizes.read_pairs()
        meta = WaveMeta.of(self.groups, sent_RL, recv_RL, sizes.recv_RL)
        routed = sum(map(sum, meta.send_RK))  # the rows past the routed ones are not sent
        tokens = split_by_wave(permuted_tokens[:routed], meta.send_RK)
        probs = split_by_wave(permuted_probs[:routed], meta.send_RK)
        out = self.dispatch_wave(0, tokens[0], probs[0], meta)
        out["meta"] = meta
        for k in range(1, self.waves):
            out[f"send_tokens_w{k}"], out[f"send_probs_w{k}"] = tokens[k], probs[k]
        return out

    def dispatch_wave(self, wave: int, send_tokens, send_probs, meta: WaveMeta) -> dict:
        splits = (meta.recv_splits(wave), meta.send_splits(wave))
        return {f"recv_tokens_w{wave}": all_to_all(self.comm, send_tokens, *splits),
                f"recv_probs_w{wave}": all_to_all(self.comm, send_probs, *splits)}

    def experts_wave(self, wave: int, recv_tokens, recv_probs, meta: WaveMeta) -> dict:
        """Wave `wave`'s rows (source rank, expert) -> expert-major -> its experts -> back."""
        start, end = self.groups[wave]
        order, counts_RG = self._orders[end - start], meta.recv_counts_RL[:, start:end]
        tokens, probs = order.to_expert_major(self.ops, recv_tokens, recv_probs, counts_RG)
        out = self.experts(tokens, probs, counts_RG.sum(dim=0), meta.expert_rows(wave),
                           experts=(start, end))
        return {f"expert_out_w{wave}": order.to_rank_major(self.ops, out, counts_RG)}

    def return_wave(self, wave: int, expert_out, meta: WaveMeta) -> dict:
        return {f"returned_w{wave}": all_to_all(self.comm, expert_out,
                                                 meta.send_splits(wave),
                                                 meta.recv_splits(wave))}

    def combine(self, returned: Sequence[torch.Tensor], meta: WaveMeta,
                row_id_map) -> torch.Tensor:
        """The returned waves in the permuted layout, each token's rows summed."""
        return self.ops.unpermute(join_waves(returned, meta.send_RK), row_id_map)

    def node_specs(self, layer: int, combine_fn, combine_inputs: dict) -> list[NodeSpec]:
        """The layer's nodes after `attn` (module docstring): dispatch_w0..w(K-1), then mlp_wI
        and return_wI per wave, then `combine`, which runs `combine_fn` on the returned
        waves (`returned_wI`) and `combine_inputs` (local name -> value name)."""
        def values(*names):
            return {name: layer_value(layer, name) for name in names}

        def wave_node(name, k, lane, fn, inputs, outputs, **kind):
            return NodeSpec(name=f"{name}_w{k}", layer=layer, lane=lane,
                            fn=functools.partial(fn, k), inputs=inputs,
                            outputs=values(*outputs), wave=k, **kind)

        sends = [f"send_{what}_w{k}" for k in range(1, self.waves)
                 for what in ("tokens", "probs")]
        specs = [NodeSpec(name="dispatch_w0", layer=layer, lane=COMM, fn=self.dispatch_first,
                          inputs={**values("permuted_tokens", "permuted_probs"),
                                  "sizes": layer_value(layer, self.SIZES)},
                          outputs=values("recv_tokens_w0", "recv_probs_w0", "meta", *sends),
                          slot="dispatch", wave=0)]
        meta = {"meta": layer_value(layer, "meta")}
        for k in range(1, self.waves):
            specs.append(wave_node(
                "dispatch", k, COMM, self.dispatch_wave,
                {"send_tokens": layer_value(layer, f"send_tokens_w{k}"),
                 "send_probs": layer_value(layer, f"send_probs_w{k}"), **meta},
                (f"recv_tokens_w{k}", f"recv_probs_w{k}"), slot="dispatch"))
        for k in range(self.waves):
            specs += [
                wave_node("mlp", k, COMPUTE, self.experts_wave,
                           {"recv_tokens": layer_value(layer, f"recv_tokens_w{k}"),
                            "recv_probs": layer_value(layer, f"recv_probs_w{k}"), **meta},
                           (f"expert_out_w{k}",), slot="mlp", has_weights=True),
                wave_node("return", k, COMM, self.return_wave,
                           {"expert_out": layer_value(layer, f"expert_out_w{k}"), **meta},
                           (f"returned_w{k}",), slot="mlp")]
        returned = values(*(f"returned_w{k}" for k in range(self.waves)))
        return specs + [NodeSpec(name="combine", layer=layer, lane=COMM, fn=combine_fn,
                                 inputs={**combine_inputs, **returned},
                                 outputs={"hidden": hidden_value(layer + 1)})]
