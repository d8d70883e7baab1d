"""`RunConfig`: the whole configuration, one field per section (config.sections), and the values
derived from several sections at once: the plan's name, virtual stages, data-parallel and stage
sizes, the device and kernel backend `auto` resolves to; `ModelOptions` (what the model reads of
the run beyond its own sections, built by `RunConfig.model_options`); `SECTIONS` (each field's
section class) and `moe_layer_pattern`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from epoverlap.config.compat import CompatConfig
from epoverlap.config.cuda_graphs import CudaGraphConfig
from epoverlap.config.layer_freq import layer_freq_list
from epoverlap.config.sections import (CheckpointConfig, DataConfig, EvalConfig, KernelConfig,
                                       LogConfig, ModelConfig, MoEConfig, OverlapConfig,
                                       ParallelConfig, TrainConfig)


@dataclass(kw_only=True, frozen=True)
class ModelOptions:
    """What the model (`model.transformer.MoEModel`) reads of the run beyond its own sections
    (`ModelConfig`, `MoEConfig`): built once from the RunConfig (`RunConfig.model_options`), so
    the model never sees the whole config. The chunks of the all-to-alls are not here: a path
    asks for them (`MoEModel.node_specs`)."""
    seed: int  # --seed: every parameter's init
    num_microbatches: int  # the router's aux loss is scaled by 1 / microbatches
    microbatch_tokens: int  # tokens of one microbatch on one rank (the dispatch budget's size)
    moe_grouped_gemm_sm_carveout: Optional[int]  # the experts' GEMMs' SMs left to the comm
    pipeline_model_parallel_size: int  # stages (`model.stages`)
    virtual_stages: int  # model chunks per stage (`RunConfig.virtual_stages`)
    cp_comm_types: tuple[str, ...]  # --cp-comm-type of each layer
    dynamic_context_parallel: bool  # --dynamic-context-parallel
    eod_mask_loss: bool  # --eod-mask-loss: the loss under CP is scaled by counted labels


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    # the flags whose `auto` default config.resolve set (for the run's path line); not a flag
    defaulted: tuple[str, ...] = ()
    link: str = ""  # not a flag: the link config.resolve found on CUDA, `kind (why)`

    def moe_layer_pattern(self) -> list[bool]:
        """For each layer: True if it is an MoE layer."""
        return moe_layer_pattern(self.model.num_layers, self.moe)

    @property
    def plan_name(self) -> str:
        """The schedule a step runs: --overlap-plan with the overlap on, else sequential."""
        o = self.overlap
        return o.overlap_plan_name if o.overlap_moe_expert_parallel_comm else "sequential"

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline stage (V): --num-virtual-stages-per-pipeline-rank, or
        layers / (P x --num-layers-per-virtual-pipeline-stage); 1 without either."""
        p = self.parallel
        if p.num_virtual_stages_per_pipeline_rank is not None:
            return p.num_virtual_stages_per_pipeline_rank
        if p.num_layers_per_virtual_pipeline_stage:
            return self.model.num_layers // (p.pipeline_model_parallel_size
                                             * p.num_layers_per_virtual_pipeline_stage)
        return 1

    def stage_size(self, world_size: int) -> int:
        """Ranks of one pipeline stage, CP x DP (a PP size below 1, which validation refuses,
        counts as 1 so nothing divides by it first)."""
        return world_size // max(1, self.parallel.pipeline_model_parallel_size)

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that read different data: a stage's ranks over CP (a CP group reads one
        sequence; a CP size below 1, which validation refuses, counts as 1)."""
        return self.stage_size(world_size) // max(1, self.parallel.context_parallel_size)

    @property
    def microbatch_tokens(self) -> int:
        """Tokens of one microbatch on one rank: micro batch x sequence / CP."""
        cp = max(1, self.parallel.context_parallel_size)
        return self.train.micro_batch_size * self.model.seq_length // cp

    def cp_comm_types(self) -> list[str]:
        """--cp-comm-type of each layer (one value given: every layer's)."""
        types = self.parallel.cp_comm_type
        return list(types) * self.model.num_layers if len(types) == 1 else list(types)

    def model_options(self) -> ModelOptions:
        """The model's slice of the other sections (`ModelOptions`), the one place it is made."""
        p = self.parallel
        return ModelOptions(
            seed=self.train.seed, num_microbatches=self.train.num_microbatches,
            microbatch_tokens=self.microbatch_tokens,
            moe_grouped_gemm_sm_carveout=p.moe_grouped_gemm_sm_carveout,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            virtual_stages=self.virtual_stages, cp_comm_types=tuple(self.cp_comm_types()),
            dynamic_context_parallel=p.dynamic_context_parallel,
            eod_mask_loss=self.data.eod_mask_loss)

    def resolved_device(self, cuda_available: bool) -> str:
        if self.train.device == "auto":
            return "cuda" if cuda_available else "cpu"
        return self.train.device

    def resolved_kernel_backend(self, device: str) -> str:
        if self.kernels.kernel_backend == "auto":
            return "triton" if device == "cuda" else "torch"
        return self.kernels.kernel_backend

    def for_world(self, world_size: int) -> "RunConfig":
        """This config with num_microbatches derived from --global-batch-size and train_iters
        from --train-samples, if given (each data-parallel rank reads its own data: DP = world
        / (PP x CP); a step reads micro batch x microbatches x DP sequences)."""
        t, dp = self.train, self.data_parallel_size(world_size)
        changes = {}
        if t.micro_batch_size < 1 or dp < 1:  # refused by validation; nothing to derive
            return self
        if t.global_batch_size is not None:
            changes["num_microbatches"] = t.global_batch_size // (t.micro_batch_size * dp)
        microbatches = changes.get("num_microbatches", t.num_microbatches)
        per_step = t.micro_batch_size * microbatches * dp
        if t.train_samples is not None:
            changes["train_iters"] = max(1, t.train_samples // per_step)
        if t.lr_decay_samples is not None or t.lr_warmup_samples is not None:
            changes["samples_per_step"] = per_step
        if not changes:
            return self
        return dataclasses.replace(self, train=dataclasses.replace(t, **changes))

    def with_vocab_size(self, vocab_size: int) -> "RunConfig":
        """This config with the model's vocabulary set (to the data's tokenizer's)."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model,
                                                                   vocab_size=vocab_size))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The sections the command line fills, in --help order.
SECTIONS: dict[str, type] = {
    "model": ModelConfig, "moe": MoEConfig, "parallel": ParallelConfig, "train": TrainConfig,
    "overlap": OverlapConfig, "kernels": KernelConfig, "data": DataConfig, "log": LogConfig,
    "checkpoint": CheckpointConfig, "eval": EvalConfig, "compat": CompatConfig,
    "cuda_graph": CudaGraphConfig}


def moe_layer_pattern(num_layers: int, moe: MoEConfig) -> list[bool]:
    """--moe-layer-freq N (every N-th layer, from layer 0) or a 0/1 list, minus first-k dense."""
    if not moe.enabled:
        return [False] * num_layers
    items = layer_freq_list(moe.moe_layer_freq)
    every = int(moe.moe_layer_freq) if items is None else 1
    pattern = [bool(item) for item in items] if items is not None else \
        [layer % every == 0 for layer in range(num_layers)]
    return [is_moe and layer >= moe.moe_first_k_dense_replace
            for layer, is_moe in enumerate(pattern)]
