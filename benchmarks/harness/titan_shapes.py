"""torchtitan's configs for the one-GPU peer benchmark: epoverlap's peer presets as
torchtitan's own Qwen3 decoder, trained by its own Trainer, at commit d84e83dc4 (the carried
`.titan/src`; benchmarks/peer.md says how to carry it):

    torchrun --nproc-per-node 1 -m torchtitan.train \
        --module benchmarks.harness.titan_shapes --config qwen3_proxy

torchtitan's ConfigManager imports this module by its dotted name (`--module`) and calls the
function `--config` names (`qwen3_proxy`, `mixtral_proxy`, `dsv3_proxy`: `peer_titan_1gpu.SHAPES`
pairs each with its epoverlap preset); each returns its `Trainer.Config`, which torchtitan's
flags then override (`--training.steps 30`, `--compile.enable`). This module imports
torchtitan: it runs where the carry is on the path (`peer_titan_1gpu.titan_env`).

The model is read from epoverlap's preset (`parse_config`), so both systems build one
definition: the same layers, hidden size, query heads and key/value heads of the same head
dim, rotary base, RMSNorm epsilon, experts, top-k, expert FFN, shared expert, dense FFN and
dense layers, sequence; untied embeddings and no QK norm, as epoverlap has; routing as
Megatron's (softmax then top-k renormalized = torchtitan's `route_norm`; with
`--moe-router-pre-softmax` not renormalized), the scores applied after the experts. Its
vocabulary is the data's (NullTokenizer's N ids); epoverlap's model adds one row for
NullTokenizer's end-of-document id (N + 1). Qwen3's block has every layer MoE or every layer
dense; `FirstDenseBlock` makes the first k dense as DeepSeek's does (torchtitan's own
DeepSeek-V3 block, which would, has MLA only).

Training as torchtitan's defaults at one GPU: fp32 parameters and fused AdamW states, the
forward under torch.autocast bf16 (no FSDP at world 1), no activation checkpointing, local
batch = micro-batch x microbatches of the preset (the whole step in one forward: 2 x 4096 =
8192 tokens), routing forced to balance (`debug.moe_force_load_balance`, round-robin), a step
line every step; epoverlap's AdamW and clip settings; uniform random tokens (`RandomTokens`).
torchtitan builds a tokenizer whatever the data: its test tokenizer, carried beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torchtitan
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import ActivationCheckpointConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import Embedding, FeedForward, GQAttention, Linear, RoPE
from torchtitan.models.common.moe import MoE, TokenChoiceTopKRouter
from torchtitan.models.common.rmsnorm import RMSNorm
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from benchmarks.harness.peer_titan_1gpu import SHAPES, epoverlap_config

# torchtitan's test tokenizer (tests/assets/tokenizer at its commit), carried beside its package
TOKENIZER = Path(torchtitan.__file__).resolve().parents[1] / "tests" / "assets" / "tokenizer"


class FirstDenseBlock(Qwen3TransformerBlock):
    """Qwen3's block with the first `n_dense_layers` layers dense (their `feed_forward`) and
    the rest MoE: DeepSeek's layer pattern, which Qwen3's all-or-none `moe_enabled` lacks."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3TransformerBlock.Config):
        n_dense_layers: int = 0

    def __init__(self, config: Config, *, layer_id: int, dim: int, n_layers: int):
        mine = dataclasses.replace(config, moe_enabled=layer_id >= config.n_dense_layers)
        super().__init__(mine, layer_id=layer_id, dim=dim, n_layers=n_layers)


class RandomTokens(BaseDataLoader):
    """Uniform random token ids without end: per batch one [local batch, seq + 1] draw, the
    input its first seq ids and the labels its last seq, as torchtitan's text loader yields
    them (`({"input": ids}, labels)`, on the CPU; its Trainer moves them)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 32000
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer,
                 seq_len: int, local_batch_size: int):
        self.config = config
        self.shape = (local_batch_size, seq_len + 1)
        self.generator = torch.Generator().manual_seed(config.seed * dp_world_size + dp_rank)
        self.batches = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            ids = torch.randint(0, self.config.vocab_size, self.shape, generator=self.generator)
            self.batches += 1
            yield {"input": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches = state_dict.get("batches", 0)


def _dense_layers(cfg) -> int:
    """How many leading layers are dense; ValueError where MoE layers are not all the rest."""
    pattern = cfg.moe_layer_pattern()
    dense = pattern.index(True) if True in pattern else len(pattern)
    if not all(pattern[dense:]):
        raise ValueError(f"MoE layer pattern {pattern}: torchtitan's blocks here take the "
                         "first k layers dense and the rest MoE only")
    return dense


def _moe(cfg) -> MoE.Config:
    m, moe = cfg.model, cfg.moe
    expert_ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size
    shared = moe.moe_shared_expert_intermediate_size or 0
    if shared % expert_ffn:
        raise ValueError(f"shared expert FFN {shared}: torchtitan's is a whole number of "
                         f"experts of FFN {expert_ffn}")
    router = TokenChoiceTopKRouter.Config(
        top_k=moe.moe_router_topk, score_func=moe.moe_router_score_function,
        route_norm=not moe.moe_router_pre_softmax,
        route_scale=moe.moe_router_topk_scaling_factor or 1.0,
        num_expert_groups=moe.moe_router_num_groups, num_limited_groups=moe.moe_router_group_topk,
        _debug_force_load_balance=moe.moe_router_force_load_balancing)
    return MoE.Config(hidden_dim=expert_ffn, num_experts=moe.num_experts,
                      num_shared_experts=shared // expert_ffn, score_before_experts=False,
                      router=router)


def model_config(cfg, vocab_size: int) -> Qwen3Model.Config:
    """torchtitan's Qwen3Model config of epoverlap's `cfg` (the module docstring lists what
    is kept) with `vocab_size` rows of embedding and output."""
    m = cfg.model
    norm = RMSNorm.Config(eps=m.norm_epsilon)
    layer = FirstDenseBlock.Config(
        n_dense_layers=_dense_layers(cfg), moe_enabled=True, attention_norm=norm, ffn_norm=norm,
        attention=GQAttention.Config(n_heads=m.num_attention_heads, n_kv_heads=m.kv_heads,
                                     head_dim=m.head_dim, attn_backend="sdpa",
                                     rope_backend="cos_sin"),
        moe=_moe(cfg), feed_forward=FeedForward.Config(hidden_dim=m.ffn_hidden_size))
    return Qwen3Model.Config(
        vocab_size=vocab_size, dim=m.hidden_size, n_layers=m.num_layers, norm=norm,
        tok_embeddings=Embedding.Config(), output=Linear.Config(), layer=layer,
        enable_weight_tying=False,
        rope=RoPE.Config(dim=m.head_dim, max_seq_len=m.seq_length, theta=float(m.rotary_base),
                         backend="cos_sin"))


def trainer_config(preset: str) -> Trainer.Config:
    """torchtitan's Trainer config of epoverlap's `preset` (with the peer flags)."""
    cfg = epoverlap_config(preset)
    t, vocab = cfg.train, cfg.data.vocab_size
    spec = ModelSpec(name="qwen3", flavor=preset, model=model_config(cfg, vocab),
                     parallelize_fn=parallelize_qwen3, pipelining_fn=pipeline_llm,
                     build_loss_fn=build_cross_entropy_loss, post_optimizer_build_fn=None,
                     state_dict_adapter=None)
    return Trainer.Config(
        hf_assets_path=str(TOKENIZER), model_spec=spec,
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        dataloader=RandomTokens.Config(vocab_size=vocab, seed=t.seed),
        optimizer=OptimizersContainer.Config(lr=t.lr, beta1=t.adam_beta1, beta2=t.adam_beta2,
                                             eps=t.adam_eps, weight_decay=t.weight_decay),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=t.lr_warmup_iters,
                                                  decay_type="cosine",
                                                  min_lr_factor=t.min_lr / t.lr),
        training=TrainingConfig(local_batch_size=t.micro_batch_size * t.num_microbatches,
                                seq_len=cfg.model.seq_length, steps=t.train_iters,
                                max_norm=t.clip_grad),
        activation_checkpoint=ActivationCheckpointConfig(mode="none"),
        debug=DebugConfig(moe_force_load_balance=cfg.moe.moe_router_force_load_balancing))


def qwen3_proxy() -> Trainer.Config:
    return trainer_config(SHAPES["qwen3"].preset)


def mixtral_proxy() -> Trainer.Config:
    return trainer_config(SHAPES["mixtral"].preset)


def dsv3_proxy() -> Trainer.Config:
    return trainer_config(SHAPES["dsv3"].preset)
