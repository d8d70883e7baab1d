"""The decoder-only MoE language model, exposed as node callables.

Owns the model: embedding; layers of [RMSNorm, causal GQA self-attention with rotary
embeddings (torch SDPA; `model.attention`), residual, RMSNorm, MoE or dense SwiGLU MLP,
residual]; final norm; output head; cross-entropy. It knows nothing of schedules: each layer
exposes its nodes (`NodeSpec`s) and `forward` simply runs them in order under one autograd
graph.

Nodes of an MoE layer (overlap.md):
  attn     (compute) norm, attention, residual, pre-MLP norm, shared expert, router, permute
  dispatch (comm)    split-size exchange (the one host sync), all-to-all of tokens and probs
  mlp      (compute) sort by local expert, grouped SwiGLU experts, unsort
  combine  (comm)    all-to-all back, unpermute, + shared expert output, + residual
With --moe-a2a-waves K the dispatch, mlp and combine are cut into K waves of local experts
(`model.waves`): dispatch_w0..w(K-1), mlp_wI and return_wI per wave, then combine.
A dense layer has `attn` (norm, attention, residual, pre-MLP norm) and `mlp` (MLP + residual).
Plus `embed` (tokens -> hidden) and `loss` (final norm, head, cross-entropy), and with pipeline
parallelism `recv` / `send` (comm) at the start / end of a stage's chunk (`model.stages`).
With `one_node_moe_layers` (CUDA graphs that span the MoE layer: `--cuda-graph-modules moe`
or the whole layer, only without the EP overlap) an MoE layer is one compute node `moe_layer`
whose segments are attn, moe_router, moe_preprocess, moe_dispatch, moe_experts, moe_combine:
the same callables in the same order under one autograd graph.
With --attention-dropout / --hidden-dropout, attention dropout and the hidden dropout of each
block's output before its residual add (`model.dropout`) draw their masks from the microbatch's
dropout seed, a named input (`DROPOUT_SEED`) of attn, of a dense layer's mlp and of combine.
The MoE layers' dispatch steps (preprocess, dispatch, sort, unsort, combine) are one
`model.dispatch.TokenDispatcher`, the strategy of the configured dispatch mode, built once per
model (`MoEModel.dispatcher`) and shared by its MoE layers; `node_specs(dispatch=...)` binds
the nodes to another (the tuner's once-per-rank path), switching nothing. Value names between nodes come from
`model.nodes` (`hidden_value`, `layer_value`).

Under context parallelism (--context-parallel-size, `model.context`) the embed and loss nodes
take this rank's chunks of each sequence, the rotary positions are those chunks', and the core
attention exchanges K/V over the CP group: inside `attn` (the p2p ring), or by a comm node
`kv_gather` between `qkv` (norm, projection, rotary) and `attn` (the all-gather); every other
node is the same code over this rank's tokens.

The embedding and output head have the vocabulary padded to --make-vocab-size-divisible-by
rows (`ModelConfig.padded_vocab_size`, aligned logit GEMMs); the loss takes the real vocabulary,
so the padding columns are out of its softmax and the loss is the unpadded model's.

Shape legend: B microbatch sequences, S sequence length, T = B*S tokens, H hidden, V vocab,
Q query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import nn

from epoverlap.kernels import MoEOps

from epoverlap.parallel.comm import ContextComm, ExpertComm, PipelineComm
from epoverlap.config import ModelConfig, ModelOptions, MoEConfig, moe_layer_pattern
from epoverlap.config.dispatch import DispatchMode
from epoverlap.model.budget import DispatchBudget
from epoverlap.model.waves import WaveMoE
from epoverlap.model.attention import Attention, RMSNorm
from epoverlap.model.waves_budget import make_waves
from epoverlap.model.context import ContextParallel, layer_contexts
from epoverlap.model.dispatch import TokenDispatcher, make_dispatcher
from epoverlap.model.documents import Documents
from epoverlap.model.dropout import (ATTENTION_OUT, DROPOUT_SEED, MLP_OUT, hidden_dropout,
                                     uses_dropout)
from epoverlap.model.linear import fused_main_grad, linear
from epoverlap.model.init import param_seed, seeded_normal_, vocab_parameter
from epoverlap.model.moe import GroupedSwiGLUExperts, Router, SwiGLU
from epoverlap.model.nodes import (COMM, COMPUTE, RECV, SEND, NodeSpec, Segment, hidden_value,
                                   layer_value, segmented)
from epoverlap.model.stages import stage_chunks


class _FanOut(torch.autograd.Function):
    """`n` aliases of x for `n` consumers; the backward sums their grads in index order, so the
    sum does not depend on which consumer's backward the autograd engine happens to run first
    (it differs when a consumer runs inside a CUDA graph and another outside)."""

    @staticmethod
    def forward(ctx, x, n: int):
        return tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for grad in grads:
            if grad is not None:
                total = grad if total is None else total + grad
        return total, None


def _by(dispatcher: TokenDispatcher, fn):
    """A node's callable bound to the dispatcher its path runs by (`node_specs(dispatch=...)`)."""
    return functools.partial(fn, dispatcher=dispatcher)


class TransformerLayer(nn.Module):
    """One decoder layer; MoE or dense. Exposes its nodes through `node_specs`."""

    def __init__(self, m: ModelConfig, moe: MoEConfig, options: ModelOptions, layer: int,
                 is_moe: bool, comm: ExpertComm, ep_rank: int, ops: MoEOps, *, dtype, device,
                 queue, dispatcher: Optional[TokenDispatcher] = None, one_node: bool = False,
                 data_rank: int = 0, context: Optional[ContextParallel] = None,
                 documents: Optional[Documents] = None):
        """`dispatcher`: the model's dispatch strategy (MoE layers; shared by all of them);
        `data_rank`: the data-parallel rank whose tokens this layer routes; `context`: the
        attention's view of the CP group, `documents`: its packed samples' rules
        (`Attention`)."""
        super().__init__()
        seed = options.seed
        std, out_std = m.init_method_std, m.init_method_std / math.sqrt(2 * m.num_layers)
        self.layer, self.is_moe, self.one_node = layer, is_moe, one_node
        self.hidden_dropout_p = m.hidden_dropout
        # the microbatch's dropout seed, a named input of the nodes that drop (model.dropout)
        self._seed = (DROPOUT_SEED,) if uses_dropout(m) else ()
        # the microbatch's tokens, a named input of the attention's nodes with per-document
        # positions or masks (model.documents)
        self._docs = ("tokens",) if documents is not None else ()
        self.input_norm = RMSNorm(m.hidden_size, m.norm_epsilon, ops, dtype, device)
        self.attention = Attention(m, seed, layer, ops, dtype=dtype, device=device, queue=queue,
                                   context=context, documents=documents)
        self.pre_mlp_norm = RMSNorm(m.hidden_size, m.norm_epsilon, ops, dtype, device)
        mlp_kwargs = dict(seed=seed, std=std, out_std=out_std, dtype=dtype, device=device,
                          queue=queue, ops=ops)
        self.shared_expert = self.router = self.experts = self.dense_mlp = None
        self.dispatcher = dispatcher if is_moe else None
        if not is_moe:
            self.dense_mlp = SwiGLU(m.hidden_size, m.ffn_hidden_size, name=f"mlp{layer}",
                                    **mlp_kwargs)
            return
        ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size
        self.router = Router(moe, m.hidden_size, layer, ops, seed=seed, std=std, dtype=dtype,
                             device=device, aux_loss_scale=1.0 / options.num_microbatches,
                             mode=dispatcher.mode, data_rank=data_rank,
                             seq_length=m.seq_length,
                             cp_comm=context.comm if context is not None else None)
        self.experts = GroupedSwiGLUExperts(
            moe, m.hidden_size, ffn, layer, ep_rank, comm.size, **mlp_kwargs,
            sm_carveout=options.moe_grouped_gemm_sm_carveout)
        if moe.moe_shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(m.hidden_size, moe.moe_shared_expert_intermediate_size,
                                        name=f"shared{layer}", **mlp_kwargs)
        self._in_waves: dict[tuple, WaveMoE] = {}  # by (waves, its dispatcher), when asked
        self._device = device

    # ----------------------------------------------------------------- node segments
    def _hidden_dropout(self, x, dropout_seed: Optional[int], site: str):
        """Hidden dropout of a block's output before its residual add (training only)."""
        p = self.hidden_dropout_p if self.training else 0.0
        return hidden_dropout(x, p, dropout_seed, self.layer, site)

    def attention_segment(self, hidden, dropout_seed=None, tokens=None):
        """norm, attention, residual, pre-MLP norm (the `attn` region). In an MoE layer the
        normed tokens go to three consumers (router, shared expert, permute), each through its
        own alias whose grads are summed in that fixed order (`_FanOut`)."""
        attn_out = self.attention(self.input_norm(hidden), dropout_seed, tokens)
        return self._attention_tail(hidden, attn_out, dropout_seed)

    def gathered_attention_segment(self, skip, q, kv_all, dropout_seed=None, tokens=None):
        """The `attn` region after the comm lane's K/V gather (`model.context`): the local
        queries over every rank's keys and values, then as `attention_segment`; `skip` is the
        layer's input, handed on by the `qkv` node."""
        attention = self.attention
        attn_out = attention.output(attention.context.attend_gathered(q, kv_all, tokens))
        return self._attention_tail(skip, attn_out, dropout_seed)

    def qkv_forward(self, hidden, tokens=None):
        """The `qkv` node before the K/V gather: norm, projection, rotary; the layer's input
        goes on to the residual through an alias of its own (`_FanOut`)."""
        skip, attn_in = _FanOut.apply(hidden, 2)
        q, k, v = self.attention.project(self.input_norm(attn_in), tokens)
        return {"skip": skip, "q": q, "kv": torch.stack([k, v])}

    def kv_gather_forward(self, kv):
        """The `kv_gather` node (comm lane): every CP rank's [K, V]."""
        return {"kv_all": self.attention.context.gather(kv)}

    def _attention_tail(self, hidden, attn_out, dropout_seed):
        """Residual, pre-MLP norm and, in an MoE layer, the normed tokens' three aliases."""
        residual = hidden + self._hidden_dropout(attn_out, dropout_seed, ATTENTION_OUT)
        normed = self.pre_mlp_norm(residual)
        if not self.is_moe:
            return {"residual": residual, "normed": normed}
        router_in, shared_in, permute_in = _FanOut.apply(normed, 3)
        out = {"residual": residual, "normed_router": router_in, "normed_permute": permute_in}
        if self.shared_expert is not None:
            out["normed_shared"] = shared_in
        return out

    def router_segment(self, normed_router, normed_shared=None):
        """Router, and the shared expert beside it (the `moe_router` region)."""
        probs, routing_map, counts = self.router(normed_router)
        out = {"probs": probs, "routing_map": routing_map, "expert_counts": counts}
        if self.shared_expert is not None:
            out["shared_out"] = self.shared_expert(normed_shared)
        return out

    def preprocess_segment(self, normed_permute, probs, routing_map, *, dispatcher):
        """Permute token copies into expert-major rows (the `moe_preprocess` region)."""
        permuted, permuted_probs, row_id_map = dispatcher.preprocess(normed_permute, probs,
                                                                     routing_map)
        return {"permuted_tokens": permuted, "permuted_probs": permuted_probs,
                "row_id_map": row_id_map}

    def split_exchange_segment(self, expert_counts, row_id_map, *, dispatcher):
        """Start the dispatch's split-size exchange as soon as the router has counted and the
        tokens are permuted (eager, never graphed: it reads nothing on the host; the dispatch
        does)."""
        return {"split_exchange": dispatcher.start_split_exchange(expert_counts, row_id_map)}

    def _splits_early(self, dispatcher) -> bool:
        """Whether the dispatch reads split sizes on the host, from an exchange started at the
        end of the `attn` node (else it takes the device counts)."""
        return self.is_moe and dispatcher.reads_host

    def _dispatch_sizes(self, dispatcher) -> str:
        """What sizes the dispatch: the early split-size exchange, or the device counts."""
        return "split_exchange" if self._splits_early(dispatcher) else "expert_counts"

    def _dispatch_inputs(self, dispatcher) -> tuple[str, ...]:
        """Once per rank without an exchange (the budget), the rows per rank come from the
        preprocess's [T, R] row-id map."""
        rank_rows = (self.is_moe and dispatcher.once_per_rank
                     and not self._splits_early(dispatcher))
        return (("permuted_tokens", "permuted_probs", self._dispatch_sizes(dispatcher))
                + (("row_id_map",) if rank_rows else ()))

    def dense_mlp_segment(self, normed, residual, dropout_seed=None):
        mlp_out = self._hidden_dropout(self.dense_mlp(normed), dropout_seed, MLP_OUT)
        return {"hidden": residual + mlp_out}

    # ----------------------------------------------------------------- node callables
    def dispatch_forward(self, permuted_tokens, permuted_probs, expert_counts=None,
                         split_exchange=None, row_id_map=None, *, dispatcher):
        recv, recv_probs, meta = dispatcher.dispatch(permuted_tokens, permuted_probs,
                                                     expert_counts, split_exchange, row_id_map)
        return {"recv_tokens": recv, "recv_probs": recv_probs, "meta": meta}

    def moe_mlp_forward(self, recv_tokens, recv_probs, meta, *, dispatcher):
        tokens, probs, local_map = dispatcher.sort_by_expert(recv_tokens, recv_probs, meta)
        out = self.experts(tokens, probs, meta.recv_counts_RL.sum(dim=0),
                           meta.tokens_per_local_expert)
        return {"expert_out": dispatcher.unsort(out, meta, local_map)}

    def combine_forward(self, expert_out, meta, row_id_map, residual, shared_out=None,
                        dropout_seed=None, *, dispatcher):
        """All-to-all back, unpermute, + shared expert, hidden dropout, + residual. On the comm
        lane: its dropout mask comes from a generator of its own, never the global RNG."""
        moe_out = dispatcher.combine(expert_out, meta, row_id_map)
        return {"hidden": self._moe_tail(moe_out, residual, shared_out, dropout_seed)}

    def waves_combine_forward(self, meta, row_id_map, residual, shared_out=None,
                                dropout_seed=None, *, in_waves: WaveMoE, **returned):
        """The combine of a layer in waves (`model.waves`): the returned waves `returned_w0`,
        `returned_w1`, ... back into the permuted layout, unpermute, then the same tail."""
        rows = [returned[f"returned_w{k}"] for k in range(len(returned))]
        moe_out = in_waves.combine(rows, meta, row_id_map)
        return {"hidden": self._moe_tail(moe_out, residual, shared_out, dropout_seed)}

    def _moe_tail(self, moe_out, residual, shared_out, dropout_seed):
        """+ shared expert output, hidden dropout, + residual."""
        if shared_out is not None:
            moe_out = moe_out + shared_out
        return residual + self._hidden_dropout(moe_out, dropout_seed, MLP_OUT)

    def combine_segment(self, *, dispatcher, **inputs):
        """`combine_forward` inside the one-node layer (its output named apart from the input)."""
        return {"layer_out": self.combine_forward(**inputs, dispatcher=dispatcher)["hidden"]}

    def _moe_segments(self, dispatcher) -> tuple[Segment, ...]:
        """dispatch, experts, combine as segments of the one-node MoE layer."""
        shared = ("shared_out",) if self.shared_expert is not None else ()
        recv = ("recv_tokens", "recv_probs", "meta")
        return (Segment("moe_dispatch", _by(dispatcher, self.dispatch_forward),
                        self._dispatch_inputs(dispatcher), recv),
                Segment("moe_experts", _by(dispatcher, self.moe_mlp_forward), recv,
                        ("expert_out",)),
                Segment("moe_combine", _by(dispatcher, self.combine_segment),
                        ("expert_out", "meta", "row_id_map", "residual") + shared + self._seed,
                        ("layer_out",)))
    @property
    def _gathers_on_comm_lane(self) -> bool:
        """Whether the attention's K/V gather is a comm node of its own, between `qkv` and
        `attn` (`model.context`)."""
        context = self.attention.context
        return context is not None and context.on_comm_lane and not self.one_node

    def _attn_head(self) -> tuple:
        """The `attn` region's function and inputs: from the layer's input, or after the
        K/V gather."""
        if self._gathers_on_comm_lane:
            return (self.gathered_attention_segment,
                    ("skip", "q", "kv_all") + self._seed + self._docs)
        return self.attention_segment, ("hidden",) + self._seed + self._docs

    def _attn_node_inputs(self) -> dict:
        docs = {name: name for name in self._docs}
        if self._gathers_on_comm_lane:
            return {**self._inputs(self._values("skip", "q", "kv_all")), **docs}
        return {**self._inputs({"hidden": hidden_value(self.layer)}), **docs}

    def _kv_specs(self) -> list[NodeSpec]:
        """`qkv` (compute) and `kv_gather` (comm) before `attn`, where the gather is a node."""
        if not self._gathers_on_comm_lane:
            return []
        L = self.layer
        return [NodeSpec(name="qkv", layer=L, lane=COMPUTE, fn=self.qkv_forward,
                         inputs={"hidden": hidden_value(L), **{n: n for n in self._docs}},
                         outputs=self._values("skip", "q", "kv"), has_weights=True),
                NodeSpec(name="kv_gather", layer=L, lane=COMM, fn=self.kv_gather_forward,
                         inputs=self._values("kv"), outputs=self._values("kv_all"))]

    def _attn_segments(self, dispatcher=None) -> tuple[Segment, ...]:
        head_fn, head_inputs = self._attn_head()
        if not self.is_moe:
            return (Segment("attn", head_fn, head_inputs, ("residual", "normed")),)
        shared = self.shared_expert is not None
        normed = ("normed_router",) + (("normed_shared",) if shared else ()) + ("normed_permute",)
        router_out = ("probs", "routing_map", "expert_counts") + (("shared_out",) if shared
                                                                   else ())
        segments = (Segment("attn", head_fn, head_inputs, ("residual",) + normed),
                    Segment("moe_router", self.router_segment, normed[:-1], router_out),
                    Segment("moe_preprocess", _by(dispatcher, self.preprocess_segment),
                            ("normed_permute", "probs", "routing_map"),
                            ("permuted_tokens", "permuted_probs", "row_id_map")))
        if self._splits_early(dispatcher):
            segments += (Segment("moe_split_exchange", _by(dispatcher,
                                                           self.split_exchange_segment),
                                 ("expert_counts", "row_id_map"), ("split_exchange",)),)
        return segments

    def _values(self, *names: str) -> dict:
        """Local name -> this layer's value name, for `names`."""
        return {name: layer_value(self.layer, name) for name in names}

    def _inputs(self, values: dict) -> dict:
        """A dropping node's inputs: `values` and the microbatch's dropout seed, if any."""
        return {**values, **{name: name for name in self._seed}}

    def node_specs(self, waves: int = 1,
                   dispatch: Optional[TokenDispatcher] = None) -> list[NodeSpec]:
        """This layer's nodes; an MoE layer's all-to-alls in `waves` waves (1: one wave; one
        node of the whole layer takes none) by `dispatch` (default: the model's dispatcher).
        Pure: nothing here changes."""
        if not self.is_moe:
            return self._dense_node_specs()
        dispatcher = dispatch or self.dispatcher
        if self.one_node:
            segments = self._attn_segments(dispatcher) + self._moe_segments(dispatcher)
            return [NodeSpec(name="moe_layer", layer=self.layer, lane=COMPUTE,
                             fn=segmented(segments, ("layer_out",)),
                             inputs=self._attn_node_inputs(),
                             outputs={"layer_out": hidden_value(self.layer + 1)},
                             has_weights=True, segments=segments)]
        return self._moe_node_specs(waves, dispatcher)

    def _dense_node_specs(self) -> list[NodeSpec]:
        L, attn_segments = self.layer, self._attn_segments()
        mlp_segments = (Segment("mlp", self.dense_mlp_segment,
                                ("normed", "residual") + self._seed, ("hidden",)),)
        return self._kv_specs() + [
            NodeSpec(name="attn", layer=L, lane=COMPUTE,
                     fn=segmented(attn_segments, ("residual", "normed")),
                     inputs=self._attn_node_inputs(),
                     outputs=self._values("residual", "normed"),
                     has_weights=True, segments=attn_segments),
            NodeSpec(name="mlp", layer=L, lane=COMPUTE,
                     fn=segmented(mlp_segments, ("hidden",)),
                     inputs=self._inputs(self._values("normed", "residual")),
                     outputs={"hidden": hidden_value(L + 1)},
                     has_weights=True, segments=mlp_segments)]

    def _moe_attn_spec(self, dispatcher) -> NodeSpec:
        L, attn_segments = self.layer, self._attn_segments(dispatcher)
        shared = ("shared_out",) if self.shared_expert is not None else ()
        attn_out = self._values("residual", "permuted_tokens", "permuted_probs",
                                self._dispatch_sizes(dispatcher), "row_id_map", *shared)
        return NodeSpec(name="attn", layer=L, lane=COMPUTE,
                        fn=segmented(attn_segments, tuple(attn_out)),
                        inputs=self._attn_node_inputs(), outputs=attn_out,
                        has_weights=True, segments=attn_segments)

    def _waves(self, waves: int, dispatcher) -> WaveMoE:
        """The layer in waves of `waves` waves over `dispatcher` (made when first asked)."""
        key = (waves, id(dispatcher))
        if key not in self._in_waves:
            self._in_waves[key] = make_waves(dispatcher, self.experts, waves, self._device)
        return self._in_waves[key]

    def _waves_moe_node_specs(self, waves: int, dispatcher) -> list[NodeSpec]:
        """attn, then the nodes of the layer in waves (`model.waves`), its combine ending here."""
        shared = ("shared_out",) if self.shared_expert is not None else ()
        combine_inputs = self._inputs(self._values("meta", "row_id_map", "residual", *shared))
        in_waves = self._waves(waves, dispatcher)
        combine = functools.partial(self.waves_combine_forward, in_waves=in_waves)
        return (self._kv_specs() + [self._moe_attn_spec(dispatcher)]
                + in_waves.node_specs(self.layer, combine, combine_inputs))

    def _moe_node_specs(self, waves: int, dispatcher) -> list[NodeSpec]:
        """attn, dispatch, mlp, combine (see the module docstring)."""
        if waves > 1:
            return self._waves_moe_node_specs(waves, dispatcher)
        L = self.layer
        shared = ("shared_out",) if self.shared_expert is not None else ()
        recv = self._values("recv_tokens", "recv_probs", "meta")
        d = dispatcher
        return self._kv_specs() + [
            self._moe_attn_spec(d),
            NodeSpec(name="dispatch", layer=L, lane=COMM, fn=_by(d, self.dispatch_forward),
                     inputs=self._values(*self._dispatch_inputs(d)), outputs=recv),
            NodeSpec(name="mlp", layer=L, lane=COMPUTE, fn=_by(d, self.moe_mlp_forward),
                     inputs=dict(recv), outputs=self._values("expert_out"), has_weights=True),
            NodeSpec(name="combine", layer=L, lane=COMM, fn=_by(d, self.combine_forward),
                     inputs=self._inputs(self._values("expert_out", "meta", "row_id_map",
                                                      "residual", *shared)),
                     outputs={"hidden": hidden_value(L + 1)})]


class MoEModel(nn.Module):
    """Embedding, layers, final norm, output head, cross-entropy loss: the whole model, or with
    pipeline parallelism one stage of it (`stage`): only that stage's layers (global indices,
    so parameter names and init are the whole model's), the embedding on the stage holding
    layer 0, the final norm and head on the stage holding the last layer, and a `recv` / `send`
    node at every chunk boundary to another stage (through `pipe`)."""

    def __init__(self, m: ModelConfig, moe: MoEConfig, options: ModelOptions, comm: ExpertComm,
                 ep_rank: int, ops: MoEOps, *, dtype: torch.dtype, device: torch.device,
                 wgrad_queue=None, stage: int = 0, pipe: Optional[PipelineComm] = None,
                 one_node_moe_layers: bool = False, data_rank: int = 0,
                 cp_comm: Optional[ContextComm] = None, documents: Optional[Documents] = None):
        """`data_rank`: the data-parallel rank whose tokens this model reads (0: one token
        stream); the forced balance's routing draw differs by it (`Router`). `cp_comm`: the
        CP group (None without CP): the embed and loss nodes take this rank's chunks of each
        sequence and each layer's attention exchanges K/V over it (`model.context`).
        `documents`: the packed samples' rules (--reset-position-ids, --reset-attention-mask;
        `model.documents`), None without them. `options`: what the model reads of the run
        beyond its sections `m` and `moe` (`config.ModelOptions`)."""
        super().__init__()
        seed = options.seed
        self.pipe, self.ops, self.documents = pipe, ops, documents
        self.vocab_size, self.eod_mask_loss = m.vocab_size, options.eod_mask_loss
        contexts = layer_contexts(options.cp_comm_types, m.seq_length,
                                  options.dynamic_context_parallel, cp_comm, device, documents)
        self.context = contexts.get(0)  # whose positions the embed and loss take
        self.chunks = stage_chunks(m.num_layers, options.pipeline_model_parallel_size,
                                   options.virtual_stages, stage)
        if len(self.chunks) > 1 or not (self.chunks[0].has_embedding
                                        and self.chunks[0].has_loss):
            if pipe is None:
                raise ValueError(f"stage {stage} of a pipeline needs a PipelineComm")
        if any(chunk.has_embedding for chunk in self.chunks):
            self.embedding = vocab_parameter(m, seed, "embedding", dtype, device)
        pattern = moe_layer_pattern(m.num_layers, moe)
        self.dispatch_mode = DispatchMode.of(moe)  # the one place the model reads it
        self.dispatch_budget = self.dispatcher = None
        if any(pattern):
            self.dispatch_budget = DispatchBudget.of_model(moe, options.microbatch_tokens,
                                                          self.dispatch_mode, comm, device,
                                                          ep_rank)
            self.dispatcher = make_dispatcher(comm, moe.num_experts, moe.moe_router_topk,
                                              ops, device, self.dispatch_mode,
                                              self.dispatch_budget)
        self.layers = nn.ModuleDict({
            str(layer): TransformerLayer(m, moe, options, layer, pattern[layer], comm, ep_rank,
                                         ops, dtype=dtype, device=device, queue=wgrad_queue,
                                         dispatcher=self.dispatcher,
                                         one_node=one_node_moe_layers, data_rank=data_rank,
                                         context=contexts.get(layer), documents=documents)
            for chunk in self.chunks for layer in chunk.layers})
        if any(chunk.has_loss for chunk in self.chunks):
            self.final_norm = RMSNorm(m.hidden_size, m.norm_epsilon, ops, dtype, device)
            self.head = vocab_parameter(m, seed, "head", dtype, device)

    def embed_forward(self, tokens):
        """tokens [B, S] (this rank's chunks of them under CP) -> hidden [T, H]."""
        if self.context is not None:
            tokens = self.context.local(tokens)
        return {"hidden": self.ops.embedding(tokens.reshape(-1), self.embedding,
                                             main_grad=fused_main_grad(self.embedding))}

    def loss_forward(self, hidden, labels):
        """The mean loss of this microbatch's counted labels (--eod-mask-loss leaves some out;
        under CP, scaled to this rank's share of its CP group's counted labels)."""
        if self.context is not None:
            labels = self.context.local(labels)
        logits_TV = linear(self.final_norm(hidden), self.head)  # [T, padded V]
        loss = self.ops.cross_entropy(logits_TV, labels.reshape(-1),
                                      vocab=self.vocab_size)
        if self.context is not None and self.eod_mask_loss:
            loss = self.context.loss_share(loss, labels)
        return {"loss": loss}

    def transformer_layers(self) -> list[TransformerLayer]:
        """This stage's layers in forward order of its chunks."""
        return list(self.layers.values())

    def node_specs(self, waves: int = 1,
                   dispatch: Optional[TokenDispatcher] = None) -> list[NodeSpec]:
        """Every node of this stage in forward order, chunk by chunk; MoE layers with `waves`
        waves of experts (1: one wave; a path's, `TunePath.waves`, the one source), by
        `dispatch` (a path's dispatcher; default: the model's). Pure: each call builds nodes,
        nothing in the model changes."""
        specs = []
        for chunk in self.chunks:
            first, end = chunk.layers[0], chunk.layers[-1] + 1
            specs.append(self._embed_spec() if chunk.has_embedding
                         else self._recv_spec(first, chunk.prev_stage))
            for layer in chunk.layers:
                specs.extend(self.layers[str(layer)].node_specs(waves, dispatch))
            specs.append(self._loss_spec(end) if chunk.has_loss
                         else self._send_spec(end - 1, chunk.next_stage))
        return specs

    def _embed_spec(self) -> NodeSpec:
        return NodeSpec(name="embed", layer=None, lane=COMPUTE, fn=self.embed_forward,
                        inputs={"tokens": "tokens"}, outputs={"hidden": hidden_value(0)})

    def _loss_spec(self, end: int) -> NodeSpec:
        return NodeSpec(name="loss", layer=None, lane=COMPUTE, fn=self.loss_forward,
                        inputs={"hidden": hidden_value(end), "labels": "labels"},
                        outputs={"loss": "loss"}, loss="loss")

    def _recv_spec(self, layer: int, peer: int) -> NodeSpec:
        """Layer `layer`'s input from stage `peer`; its grad goes back there."""
        def receive():
            return {"hidden": self.pipe.recv(peer).requires_grad_(True)}

        def send_grad(hidden):
            self.pipe.send(hidden, peer)
            return {}
        return NodeSpec(name="recv", layer=layer, lane=COMM, fn=receive, inputs={},
                        outputs={"hidden": hidden_value(layer)}, p2p=RECV, backward=send_grad)

    def _send_spec(self, layer: int, peer: int) -> NodeSpec:
        """Layer `layer`'s output to stage `peer`; its grad comes back from there."""
        def send(hidden):
            self.pipe.send(hidden, peer)
            return {}

        def receive_grad():
            return {"hidden": self.pipe.recv(peer)}
        return NodeSpec(name="send", layer=layer, lane=COMM, fn=send,
                        inputs={"hidden": hidden_value(layer + 1)}, outputs={}, p2p=SEND,
                        backward=receive_grad)

    def layout(self, waves: int = 1) -> list[tuple[str, ...]]:
        """Node kinds of each layer, in forward order (what plan builders need), its MoE
        layers' all-to-alls in `waves` waves."""
        return [tuple(s.kind for s in layer.node_specs(waves))
                for layer in self.transformer_layers()]

    def routers(self) -> list[Router]:
        return [layer.router for layer in self.transformer_layers() if layer.router is not None]

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor,
                dropout_seed: Optional[int] = None) -> torch.Tensor:
        """Plain autograd forward through the same node callables, in order. -> loss.
        The whole model only (one stage). `dropout_seed`: the microbatch's (`model.dropout`),
        needed by a training forward with dropout."""
        if self.pipe is not None:
            raise RuntimeError("MoEModel.forward runs a whole model; a pipeline stage runs "
                               "through the executor")
        return self.stage_forward(tokens, labels, dropout_seed)

    def stage_forward(self, tokens: torch.Tensor, labels: torch.Tensor,
                      dropout_seed: Optional[int] = None,
                      dispatch: Optional[TokenDispatcher] = None,
                      waves: int = 1) -> Optional[torch.Tensor]:
        """One microbatch through this stage's nodes (by `dispatch`, default the model's
        dispatcher; MoE layers in `waves` waves) in order, chunk by chunk, receiving from and
        sending to the neighbor stages (forward only: evaluation). Every stage running its
        microbatches in the same order issues its transfers in the one chain's order, so they
        meet. -> the loss on the stage holding the head, else None."""
        values = {"tokens": tokens, "labels": labels, DROPOUT_SEED: dropout_seed}
        for spec in self.node_specs(waves, dispatch):
            out = spec.fn(**{local: values[name] for local, name in spec.inputs.items()})
            values.update({spec.outputs[local]: value for local, value in out.items()})
        return values.get("loss")


def model_dtype(bf16: bool) -> torch.dtype:
    """The parameters' and activations' dtype: bf16 under --bf16, else fp32."""
    return torch.bfloat16 if bf16 else torch.float32


def count_parameters(model: MoEModel, ep_size: int) -> dict:
    """Total parameters of the global model (experts counted over all EP ranks), and active."""
    dense = sum(p.numel() for p in model.parameters() if not getattr(p, "is_expert", False))
    expert_local = sum(p.numel() for p in model.parameters() if getattr(p, "is_expert", False))
    return {"dense": dense, "expert_global": expert_local * ep_size, "expert_local": expert_local}
