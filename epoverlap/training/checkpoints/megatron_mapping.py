"""Which tensor of a Megatron-core `GPTModel` is which parameter of epoverlap's model, and how
its layout differs: the mapping `epoverlap-convert-checkpoint` uses both ways
(`training.checkpoints.megatron_checkpoint` reads and writes the folders).

Names are the global keys of Megatron-core 0.16.1's sharded state dict (the torch_dist
checkpoint's keys), per layer I (the stacked and per-expert forms on disk are
`megatron_checkpoint`'s business). Megatron-core keeps a linear's weight as [out, in], as
epoverlap's dense weights are; epoverlap's grouped experts are [E, in, out].

  Megatron-core                                        epoverlap                    transform
  embedding.word_embeddings.weight  [V, H]             embedding                    -
  decoder.layers.I.self_attention.linear_qkv.layer_norm_weight
                                    [H]                layers.I.input_norm.weight   -
  decoder.layers.I.self_attention.linear_qkv.weight    layers.I.attention.qkv       regroup
                                    [G(Q/G+2)D, H]     [(Q+2G)D, H]
  decoder.layers.I.self_attention.linear_proj.weight   layers.I.attention.proj      -
  decoder.layers.I.self_attention.q_layernorm.weight   layers.I.attention.q_norm.weight -
                                    [D]                (--qk-layernorm; k_norm alike)
  decoder.layers.I.mlp.linear_fc1.layer_norm_weight    layers.I.pre_mlp_norm.weight -
  decoder.layers.I.mlp.linear_fc1.weight  [2F, H]      layers.I.dense_mlp.fc1       -
  decoder.layers.I.mlp.linear_fc2.weight  [H, F]       layers.I.dense_mlp.fc2       -
  decoder.layers.I.mlp.router.weight      [E, H]       layers.I.router.weight       -
  decoder.layers.I.mlp.router.expert_bias [E]          layers.I.router.expert_bias  - (buffer)
  decoder.layers.I.mlp.experts.experts.linear_fc1.weight
                                    [E, 2F, H]         layers.I.experts.fc1 [E, H, 2F]  transpose
  decoder.layers.I.mlp.experts.experts.linear_fc2.weight
                                    [E, H, F]          layers.I.experts.fc2 [E, F, H]   transpose
  decoder.layers.I.mlp.shared_experts.linear_fc1.weight  layers.I.shared_expert.fc1  -
  decoder.layers.I.mlp.shared_experts.linear_fc2.weight  layers.I.shared_expert.fc2  -
  decoder.final_layernorm.weight    [H]                final_norm.weight            -
  output_layer.weight               [V, H]             head                         -

V is the padded vocabulary in both (Megatron-LM's padded_vocab_size, epoverlap's
--make-vocab-size-divisible-by): the padding rows are copied as they are, both ways.

regroup: Megatron-core interleaves the fused QKV rows by key/value group (for each of the G
groups: its Q/G query heads, then its key head, then its value head, D rows each); epoverlap
keeps all query heads, then all key heads, then all value heads. Query head h belongs to group
h // (Q/G) in both, as SDPA's grouped-query attention reads it. Both SwiGLU fc1 weights hold
the gate rows first, then the up rows (silu(gate) * up); a tensor-parallel checkpoint stores
them globally in that order too. The norms are RMSNorm with weight [H] in both (the query and
key norms [D], shared by the heads; no bias, no zero-centred gamma); the input norm and the
pre-MLP norm are keyed by the linear after them, as Transformer Engine fuses them (the local
spec writes the same keys; `pre_mlp_layernorm.weight` and `input_layernorm.weight` are read
too).

What the tensors cannot show is checked against the Megatron-LM arguments a checkpoint's
common.pt may hold (`check_megatron_args`): top-k, the router's score function and options,
the rotary base, the norm epsilon, and the features epoverlap does not implement.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from epoverlap.config import (MoEConfig, ModelConfig, RunConfig, build_parser, config_from_args,
                              parse_config, validate_config)
from epoverlap.data.tokenizers import BYTE_VOCAB
from epoverlap.errors import ConfigError
from epoverlap.kernels import make_moe_ops
from epoverlap.model.moe import Router
from epoverlap.model.transformer import MoEModel
from epoverlap.parallel.comm import ExpertComm
from epoverlap.training.setup.data import tokenizer_vocab


class ConversionError(ValueError):
    """A checkpoint that cannot be converted: one line naming the file, tensor or flag."""


EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
_GLOBAL = {"embedding": EMBEDDING, "head": OUTPUT_LAYER,
           "final_norm.weight": "decoder.final_layernorm.weight"}
# epoverlap's name inside layer I -> Megatron-core's inside decoder.layers.I
_IN_LAYER = {
    "input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "attention.qkv": "self_attention.linear_qkv.weight",
    "attention.proj": "self_attention.linear_proj.weight",
    "attention.q_norm.weight": "self_attention.q_layernorm.weight",
    "attention.k_norm.weight": "self_attention.k_layernorm.weight",
    "pre_mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight",
    "dense_mlp.fc1": "mlp.linear_fc1.weight",
    "dense_mlp.fc2": "mlp.linear_fc2.weight",
    "router.weight": "mlp.router.weight",
    "router.expert_bias": "mlp.router.expert_bias",
    "experts.fc1": "mlp.experts.experts.linear_fc1.weight",
    "experts.fc2": "mlp.experts.experts.linear_fc2.weight",
    "shared_expert.fc1": "mlp.shared_experts.linear_fc1.weight",
    "shared_expert.fc2": "mlp.shared_experts.linear_fc2.weight",
}
# Other spellings read (a Transformer Engine spec's separate norms)
_ALIASES = {"self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
            "mlp.linear_fc1.layer_norm_weight": ("pre_mlp_layernorm.weight",)}
# The flags that size each tensor, for a mismatch's message
_SIZED_BY = {
    "embedding": "the vocabulary, which the data flags set (--tokenizer-type, --vocab-size, "
                 "--tokenizer-model), padded by --make-vocab-size-divisible-by, and "
                 "--hidden-size",
    "qkv": "--hidden-size, --num-attention-heads, --num-query-groups",
    "proj": "--hidden-size, --num-attention-heads",
    "q_norm": "--hidden-size / --num-attention-heads (the head dim)",
    "k_norm": "--hidden-size / --num-attention-heads (the head dim)",
    "dense_mlp": "--hidden-size, --ffn-hidden-size",
    "router": "--num-experts, --hidden-size",
    "experts": "--num-experts, --moe-ffn-hidden-size, --hidden-size",
    "shared_expert": "--moe-shared-expert-intermediate-size, --hidden-size",
    "norm": "--hidden-size", "head": "the vocabulary, which the data flags set, padded by "
                                     "--make-vocab-size-divisible-by, and --hidden-size"}


@dataclass(frozen=True)
class TensorMap:
    """One epoverlap tensor and the Megatron-core tensor it is."""

    ours: str  # parameter name, or a router's buffer (`expert_bias`)
    megatron: str  # the global per-layer key (experts: all E of the layer, leading dim E)
    shape: tuple  # epoverlap's whole tensor (experts: [E, ...], every expert)
    expert: bool
    buffer: bool
    layer: Optional[int]
    to_ours: Callable[[torch.Tensor], torch.Tensor]
    to_megatron: Callable[[torch.Tensor], torch.Tensor]

    @property
    def megatron_shape(self) -> tuple:
        return tuple(self.to_megatron(torch.empty(self.shape, device="meta")).shape)

    @property
    def aliases(self) -> tuple[str, ...]:
        if self.layer is None:
            return ()
        inside = self.megatron.split(f"decoder.layers.{self.layer}.", 1)[1]
        return tuple(f"decoder.layers.{self.layer}.{alias}" for alias in _ALIASES.get(inside, ()))

    @property
    def sized_by(self) -> str:
        for part, flags in _SIZED_BY.items():
            if part in self.ours:
                return flags
        return "--hidden-size"


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _transpose_experts(t: torch.Tensor) -> torch.Tensor:
    """[E, a, b] -> [E, b, a] (its own inverse)."""
    return t.transpose(-1, -2).contiguous()


def _qkv_transforms(m: ModelConfig) -> tuple[Callable, Callable]:
    """(Megatron-core's group-interleaved rows -> epoverlap's q|k|v rows, and back)."""
    groups, dim, per_group = m.kv_heads, m.head_dim, m.num_attention_heads // m.kv_heads

    def to_ours(t):
        hidden = t.shape[-1]
        grouped = t.reshape(groups, per_group + 2, dim, hidden)
        return torch.cat([grouped[:, :per_group].reshape(-1, hidden),
                          grouped[:, per_group].reshape(-1, hidden),
                          grouped[:, per_group + 1].reshape(-1, hidden)])

    def to_megatron(t):
        hidden = t.shape[-1]
        q, k, v = t.split([groups * per_group * dim, groups * dim, groups * dim])
        return torch.cat([q.reshape(groups, per_group, dim, hidden),
                          k.reshape(groups, 1, dim, hidden),
                          v.reshape(groups, 1, dim, hidden)], dim=1).reshape(-1, hidden)
    return to_ours, to_megatron


def shape_model(cfg: RunConfig) -> MoEModel:
    """The whole model of `cfg` at EP 1 on the meta device: names and shapes, no values."""
    return MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                    ExpertComm(None, 1), 0, make_moe_ops("torch"), dtype=torch.float32,
                    device=torch.device("meta"))


def tensor_maps(cfg: RunConfig) -> list[TensorMap]:
    """Every tensor an epoverlap checkpoint of `cfg` holds (its `model/` parameters in the
    model's order, then its routers' `buffer/` expert biases), each with its Megatron-core
    tensor."""
    model = shape_model(cfg)
    qkv = _qkv_transforms(cfg.model)
    named = [(name, p, False) for name, p in model.named_parameters() if p.requires_grad]
    named += [(f"{name}.expert_bias", module.expert_bias, True)
              for name, module in model.named_modules()
              if isinstance(module, Router) and module.expert_bias is not None]
    maps = []
    for name, tensor, buffer in named:
        expert = getattr(tensor, "is_expert", False)
        layer, megatron = _megatron_name(name)
        to_ours, to_megatron = (qkv if name.endswith("attention.qkv") else
                                (_transpose_experts,) * 2 if expert else (_same, _same))
        maps.append(TensorMap(ours=name, megatron=megatron, shape=tuple(tensor.shape),
                              expert=expert, buffer=buffer, layer=layer, to_ours=to_ours,
                              to_megatron=to_megatron))
    return maps


def _megatron_name(ours: str) -> tuple[Optional[int], str]:
    if ours in _GLOBAL:
        return None, _GLOBAL[ours]
    found = re.fullmatch(r"layers\.(\d+)\.(.+)", ours)
    if found is None or found.group(2) not in _IN_LAYER:
        raise RuntimeError(f"epoverlap parameter {ours} has no Megatron-core name "
                           "(training.checkpoints.megatron_mapping)")
    layer = int(found.group(1))
    return layer, f"decoder.layers.{layer}.{_IN_LAYER[found.group(2)]}"


# ------------------------------------------------------------------------ the config
def model_config_of(flags: list[str], prog: str) -> RunConfig:
    """The training flags' config with the model's vocabulary set from the data flags, as a
    training run sets it (the data itself is not read). Raises ConfigError naming the flag."""
    cfg = config_from_args(build_parser(prog=prog).parse_args(flags))
    # Only what shapes the model is checked: the layout flags of the run (EP, batch, data
    # paths) belong to the world it trains on, not to the conversion.
    defaults = parse_config([])
    validate_config(dataclasses.replace(defaults, model=cfg.model, moe=cfg.moe,
                                        compat=cfg.compat), 1, False)
    return cfg.with_vocab_size(data_vocab_size(cfg))


def data_vocab_size(cfg: RunConfig) -> int:
    """The model's vocabulary as training sets it: bytes for raw text, the tokenizer's."""
    d = cfg.data
    if d.text_source is not None:
        return BYTE_VOCAB
    return tokenizer_vocab(cfg) if d.tokenizer else cfg.model.vocab_size


def config_from_meta(saved: dict) -> RunConfig:
    """The model and MoE sections of an epoverlap checkpoint's meta.json config. One written
    before the vocabulary was padded has no --make-vocab-size-divisible-by: its embedding and
    head hold the vocabulary's own rows (a multiple of 1)."""
    defaults = parse_config([])

    def section(cls, values: dict):
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in fields})
    model = {"make_vocab_size_divisible_by": 1, **saved.get("model", {})}
    return dataclasses.replace(defaults, model=section(ModelConfig, model),
                               moe=section(MoEConfig, saved.get("moe", {})))


# ------------------------------------------------------------------ Megatron-LM args
def _expected_args(cfg: RunConfig) -> list[tuple[str, object, str]]:
    """(Megatron-LM argument, the value this config needs, what to say if it differs)."""
    m, moe = cfg.model, cfg.moe
    same = [("rotary_base", m.rotary_base, "--rotary-base"),
            ("norm_epsilon", m.norm_epsilon, "--norm-epsilon"),
            ("qk_layernorm", m.qk_layernorm, "--qk-layernorm")]
    if moe.enabled:
        same += [(name, getattr(moe, name), "--" + name.replace("_", "-")) for name in
                 ("moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                  "moe_router_topk_scaling_factor", "moe_router_num_groups",
                  "moe_router_group_topk")]
    fixed = [("rotary_percent", 1.0, "partial rotary embeddings are not implemented"),
             ("rotary_interleaved", False, "epoverlap rotates the two halves of each head"),
             ("add_bias_linear", False, "epoverlap's linears have no biases"),
             ("add_qkv_bias", False, "epoverlap's linears have no biases"),
             ("normalization", "RMSNorm", "epoverlap's norms are RMSNorm"),
             ("apply_layernorm_1p", False, "zero-centred norm weights are not implemented"),
             ("swiglu", True, "epoverlap's MLPs are SwiGLU"),
             ("position_embedding_type", "rope", "epoverlap's positions are rotary"),
             ("use_rope_scaling", False, "rotary scaling is not implemented"),
             ("multi_latent_attention", False, "multi-latent attention is not implemented"),
             ("moe_shared_expert_gate", False, "the shared-expert gate is not implemented"),
             ("moe_apply_probs_on_input", False, "epoverlap weights the experts' outputs "
                                                 "by the routing probabilities")]
    return ([(arg, value, f"these flags give {flag} {value}") for arg, value, flag in same]
            + [(arg, value, why) for arg, value, why in fixed])


def check_megatron_args(args: object, cfg: RunConfig, where: str) -> None:
    """Refuse a checkpoint whose Megatron-LM arguments (common.pt's `args`) differ from `cfg`
    where the tensors cannot show it. Arguments it does not hold are not checked."""
    for name, ours, why in _expected_args(cfg):
        if not hasattr(args, name):
            continue
        theirs = getattr(args, name)
        if theirs is None and ours in (False, None):
            continue
        if isinstance(ours, (int, float)) and not isinstance(ours, bool) \
                and isinstance(theirs, (int, float)) and not isinstance(theirs, bool):
            if math.isclose(float(theirs), float(ours), rel_tol=1e-12):
                continue
        elif theirs == ours:
            continue
        flag = "--" + name.replace("_", "-")
        raise ConversionError(f"{where}: the Megatron-LM run had {flag} {theirs}: {why}")
