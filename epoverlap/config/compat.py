"""Megatron-LM's pretrain flags that epoverlap has no setting of its own for: those accepted
(they state what epoverlap's architecture or runtime already is, or ask for something that
changes no result here; each says what is done instead) and those refused with a reason.

A pasted Megatron-LM MoE pretrain command line thus runs, or stops before training with one
line per refused flag naming what is supported. The flags epoverlap implements (the learning-
rate schedule, evaluation, dropouts, checkpoint loading options, exit handling, the vocabulary
padding --make-vocab-size-divisible-by, ...) are fields of their own sections; this module holds
the rest:

  CompatConfig      accepted flags, checked where a value matters (--normalization RMSNorm,
                    --tensor-model-parallel-size 1, ...)
  NOT_IMPLEMENTED   refused flags: (flag, values it takes, the reason)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from epoverlap.config.flags import flag
from epoverlap.errors import ConfigError

GROUP = "Megatron-LM flags accepted for pasted scripts"
REFUSED_GROUP = "Megatron-LM flags not implemented (each is refused with its reason)"
HYBRID_CP = ("hybrid context parallelism (sub-samples regrouped over the DP x CP ranks) is "
             "not implemented: give --dynamic-context-parallel (a CP size per microbatch)")
NO_TP = "tensor parallelism is not implemented; use expert/data/pipeline parallelism"
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")  # Megatron-core's AttnBackend
NOT_SHARDED = ("nothing is sharded: every rank keeps its parameters, grads and optimizer state "
               "whole and all-reduces the grads; the updates are the same")


def _accepted(help: str, note: str) -> object:
    """A Megatron-LM switch accepted with no effect: `note` says what epoverlap does."""
    return flag(False, help, note=note, group=GROUP)


@dataclass(kw_only=True, frozen=True)
class CompatConfig:
    use_mcore_models: bool = _accepted("Megatron-core models", "epoverlap has one model")
    swiglu: bool = _accepted("SwiGLU MLPs", "the MLPs are always SwiGLU")
    disable_bias_linear: bool = _accepted("no linear biases", "the linears have no biases")
    untie_embeddings_and_output_weights: bool = _accepted(
        "separate input and output embeddings", "they are always separate")
    use_rotary_position_embeddings: bool = _accepted("rotary positions", "positions are rotary")
    no_position_embedding: bool = _accepted("no learned positions",
                                            "there is no learned position embedding")
    group_query_attention: bool = flag(False, "grouped-query attention (with "
                                       "--num-query-groups)", group=GROUP)
    no_masked_softmax_fusion: bool = _accepted("attention kernel choice",
                                               "torch's SDPA picks the attention kernel")
    use_flash_attn: bool = _accepted("flash attention", "torch's SDPA picks the attention kernel")
    no_bias_swiglu_fusion: bool = _accepted("SwiGLU kernel choice",
                                            "--kernel-backend picks the SwiGLU kernel")
    moe_grouped_gemm: bool = _accepted("grouped expert GEMMs", "the experts' GEMMs are always "
                                       "grouped")
    moe_permute_fusion: bool = _accepted("fused token permutation", "--kernel-backend triton "
                                         "(the default on CUDA) fuses the permutation")
    moe_use_legacy_grouped_gemm: bool = _accepted("grouped GEMM choice",
                                                  "the grouped GEMM is torch's")
    moe_shared_expert_overlap: bool = _accepted(
        "shared expert beside the dispatch", "the shared expert runs in the node before the "
        "dispatch, beside another microbatch's all-to-all under the EP overlap")
    sequence_parallel: bool = _accepted("sequence parallelism", "with tensor parallel size 1 "
                                        "there is nothing to split")
    use_distributed_optimizer: bool = _accepted(
        "sharded optimizer state", "every rank keeps the optimizer state of its own "
        "parameters whole; the updates are the same")
    overlap_param_gather: bool = _accepted("parameter gather beside the forward",
                                           "parameters are not sharded, nothing is gathered")
    no_async_tensor_model_parallel_allreduce: bool = _accepted(
        "tensor-parallel all-reduce", "there is no tensor parallelism")
    accumulate_allreduce_grads_in_fp32: bool = _accepted(
        "fp32 grad reduction", "grads are accumulated and reduced in fp32 (main_grad)")
    log_throughput: bool = _accepted("tokens/s and TFLOP/s in the log",
                                     "every step line shows them")
    log_timers_to_tensorboard: bool = _accepted("timers in TensorBoard", "the step time is "
                                                "among the TensorBoard scalars")
    log_batch_size_to_tensorboard: bool = _accepted("batch size in TensorBoard", "the batch "
                                                    "size is fixed for a run")
    log_validation_ppl_to_tensorboard: bool = _accepted(
        "validation perplexity in TensorBoard", "it is logged with every validation loss")
    log_memory_to_tensorboard: bool = _accepted(
        "memory in TensorBoard", "TensorBoard gets no memory scalars; the end-of-run line has "
        "the peak memory")
    log_params_norm: bool = _accepted("the parameters' norm in the log",
                                      "the step line shows no parameter norm")
    log_num_zeros_in_grad: bool = _accepted("zero grads counted in the log",
                                            "the step line shows no count of zero grads")
    no_rope_fusion: bool = _accepted("rotary kernel choice", "epoverlap applies its own rotary "
                                     "embedding; fused or not, the same math")
    use_megatron_fsdp: bool = _accepted("Megatron-FSDP", NOT_SHARDED)
    fsdp_double_buffer: bool = _accepted("Megatron-FSDP's double buffers", NOT_SHARDED)
    use_nccl_ub: bool = _accepted("NCCL user buffers", "the collectives move the same bytes "
                                  "from epoverlap's own buffers")
    attention_softmax_in_fp32: bool = _accepted(
        "fp32 attention softmax", "torch's SDPA picks the attention kernel; in fp32 runs the "
        "softmax is fp32")
    auto_detect_ckpt_format: bool = _accepted("checkpoint format detection", "--load reads "
                                              "torch_dist folders")
    enable_experimental: bool = _accepted("Megatron-LM's experimental features",
                                          "epoverlap gates nothing behind it")
    init_model_with_meta_device: bool = _accepted(
        "initialization on the meta device", "each rank builds its parameters on its device "
        "from the same seeds")
    no_mmap_bin_files: bool = _accepted("reading .bin files without mmap", "the .bin files "
                                        "are memory-mapped; the same tokens")
    no_create_attention_mask_in_dataloader: bool = _accepted(
        "no attention mask from the data loader", "the attention is causal in the kernel; "
        "no mask is built")
    calculate_per_token_loss: bool = _accepted(
        "the loss averaged per token", "every sequence is full and no token is masked: the "
        "mean per token is the mean per microbatch (with --eod-mask-loss it is refused)")
    dist_ckpt_strictness: Optional[str] = flag(
        None, "how unexpected checkpoint keys are handled", note="--load checks every key "
        "against the model and refuses a mismatch in one line", group=GROUP)
    attention_backend: Optional[str] = flag(
        None, "the attention kernels", choices=ATTENTION_BACKENDS,
        note="epoverlap's local attention runs (torch's SDPA), whatever the backend",
        why="Megatron-core's backends", group=GROUP)
    logging_level: Optional[int] = flag(None, "Python logging level",
                                        note="the log lines are the same at every level",
                                        group=GROUP)
    num_distributed_optimizer_instances: Optional[int] = flag(
        None, "distributed optimizer copies", note=NOT_SHARDED, group=GROUP)
    data_parallel_sharding_strategy: Optional[str] = flag(
        None, "Megatron-FSDP's sharding", choices=("no_shard", "optim", "optim_grads",
                                                   "optim_grads_params"),
        note=NOT_SHARDED, why="Megatron-LM's strategies", group=GROUP)
    outer_dp_sharding_strategy: Optional[str] = flag(
        None, "Megatron-FSDP's sharding between hosts", choices=("no_shard", "optim"),
        note=NOT_SHARDED, why="Megatron-LM's strategies", group=GROUP)
    megatron_fsdp_main_params_dtype: Optional[str] = flag(
        None, "Megatron-FSDP's master weights dtype", choices=("fp32",),
        note="the master weights are fp32", why="the master weights are fp32; another dtype "
        "rounds every update", group=GROUP)
    megatron_fsdp_main_grads_dtype: Optional[str] = flag(
        None, "Megatron-FSDP's grad accumulation dtype", choices=("fp32",),
        note="grads are accumulated in fp32 (main_grad)", why="grads are accumulated in fp32 "
        "(main_grad); another dtype rounds them", group=GROUP)
    megatron_fsdp_grad_comm_dtype: Optional[str] = flag(
        None, "Megatron-FSDP's grad reduction dtype", choices=("fp32",),
        note="grads are reduced in fp32", why="grads are reduced in fp32; another dtype rounds "
        "them", group=GROUP)
    mscale: Optional[float] = flag(None, "YaRN's attention scale (multi-latent attention)",
                                   note="it scales only with --rotary-scaling-factor above 1, "
                                   "and rotary scaling is not implemented", group=GROUP)
    mscale_all_dim: Optional[float] = flag(
        None, "YaRN's attention scale of all dimensions (multi-latent attention)",
        note="it scales only with --rotary-scaling-factor above 1, and rotary scaling is not "
        "implemented", group=GROUP)
    normalization: str = flag("RMSNorm", "the norm layers", choices=("RMSNorm",),
                              why="the norms are RMSNorm", group=GROUP)
    position_embedding_type: str = flag("rope", "how positions are encoded", choices=("rope",),
                                        why="positions are rotary (RoPE)", group=GROUP)
    transformer_impl: str = flag("local", "the layers' implementation (transformer_engine: "
                                 "accepted, epoverlap's own layers run)",
                                 choices=("local", "transformer_engine"),
                                 why="epoverlap's own layers, no Transformer Engine", group=GROUP)
    moe_token_dispatcher_type: str = flag(
        "alltoall", "the MoE token dispatcher", choices=("alltoall",),
        why="the expert-parallel all-to-all dispatcher (see --moe-dispatch-budget and "
        "--moe-dispatch-once-per-rank for its modes)", group=GROUP)
    ckpt_format: str = flag("torch_dist", "the checkpoint format (fsdp_dtensor: only without "
                            "--save and --load)", choices=("torch_dist", "fsdp_dtensor"),
                            why="checkpoints are torch.distributed.checkpoint folders",
                            group=GROUP)
    distributed_backend: Optional[str] = flag(
        None, "the process groups' backend", choices=("nccl", "gloo"),
        note="NCCL on GPUs, gloo on CPUs", group=GROUP)
    tensor_model_parallel_size: int = flag(1, "tensor parallel size (only 1)", group=GROUP)
    expert_tensor_parallel_size: Optional[int] = flag(None, "expert tensor parallel size (only "
                                                      "1)", group=GROUP)
    max_position_embeddings: Optional[int] = flag(None, "the longest sequence (>= "
                                                  "--seq-length; rotary needs no table)",
                                                  group=GROUP)
    rotary_percent: float = flag(1.0, "the share of each head's dimensions rotated (only 1.0)",
                                 group=GROUP)
    rotary_scaling_factor: float = flag(1.0, "YaRN's rotary scaling for long context (only "
                                        "1.0: no scaling)", group=GROUP)
    ddp_bucket_size: Optional[int] = flag(None, "grad reduction bucket size",
                                          note="grads are reduced in flat buffers",
                                          group=GROUP)
    tensorboard_queue_size: Optional[int] = flag(None, "TensorBoard writer queue",
                                                 note="events are flushed every step",
                                                 group=GROUP)
    num_workers: Optional[int] = flag(None, "data loader worker processes",
                                      note="batches are read in the training process",
                                      group=GROUP)
    data_cache_path: Optional[str] = flag(None, "where dataset indices are cached",
                                          note="indices are built in memory at start",
                                          group=GROUP, metavar="DIR")


# Megatron-LM flags epoverlap does not implement: (flag, argparse nargs, why).
NOT_IMPLEMENTED: tuple[tuple[str, object, str], ...] = (
    ("--fp16", 0, "fp16 training is not implemented; use --bf16"),
    ("--fp8-format", 1, "FP8 training is not implemented; use --bf16"),
    ("--recompute-granularity", 1, "activation recomputation is not implemented"),
    ("--recompute-method", 1, "activation recomputation is not implemented"),
    ("--recompute-num-layers", 1, "activation recomputation is not implemented"),
    ("--recompute-activations", 0, "activation recomputation is not implemented"),
    ("--moe-layer-recompute", 0, "activation recomputation is not implemented"),
    ("--recompute-modules", "+", "activation recomputation is not implemented"),
    ("--multi-latent-attention", 0, "multi-latent attention is not implemented; the "
     "attention is grouped-query (--num-query-groups)"),
    ("--q-lora-rank", 1, "multi-latent attention is not implemented"),
    ("--kv-lora-rank", 1, "multi-latent attention is not implemented"),
    ("--qk-head-dim", 1, "multi-latent attention is not implemented"),
    ("--qk-pos-emb-head-dim", 1, "multi-latent attention is not implemented"),
    ("--v-head-dim", 1, "multi-latent attention is not implemented"),
    ("--apply-query-key-layer-scaling", 0, "query-key layer scaling is an fp16 measure; fp16 is "
     "not implemented"),
    ("--moe-input-jitter-eps", 1, "router input jitter is not implemented"),
    ("--num-shared-experts", 1, "give the shared experts' total width with "
     "--moe-shared-expert-intermediate-size"),
    ("--enable-shared-expert", 0, "give the shared experts' width with "
     "--moe-shared-expert-intermediate-size"),
    ("--hierarchical-context-parallel-sizes", "+", "hierarchical CP serves --cp-comm-type "
     "a2a+p2p, which is not implemented: give --context-parallel-size"),
    ("--hybrid-context-parallel", 0, HYBRID_CP),
    ("--train-data-path", "+", "give --data-path with --split (train, valid, test parts)"),
    ("--valid-data-path", "+", "give --data-path with --split (train, valid, test parts)"),
    ("--test-data-path", "+", "give --data-path with --split (train, valid, test parts)"),
    ("--dataloader-type", 1, "samples are read in Megatron-core's order by epoch (single); "
     "other orders are not implemented"),
    ("--moe-flex-dispatcher-backend", 1, "the flex dispatcher (DeepEP, HybridEP) is not "
     "implemented; the all-to-all dispatcher's modes are --moe-dispatch-budget and "
     "--moe-dispatch-once-per-rank"),
    ("--mtp-num-layers", 1, "multi-token prediction is not implemented"),
    ("--mtp-loss-scaling-factor", 1, "multi-token prediction is not implemented"),
    ("--rampup-batch-size", "+", "batch size ramp-up is not implemented"),
    ("--optimizer", 1, "the optimizer is AdamW"),
    ("--moe-expert-capacity-factor-per-layer", 1, "one capacity factor for all layers: "
     "--moe-expert-capacity-factor"),
    ("--tp-comm-overlap", 0, NO_TP),
)


class RefusedFlag(ConfigError):
    """A Megatron-LM flag given that epoverlap does not implement: `--flag=value: why`."""


def add_refused_flags(parser) -> None:
    """Register the NOT_IMPLEMENTED flags (so they are named and refused, not unrecognized)."""
    group = parser.add_argument_group(REFUSED_GROUP)
    for name, nargs, why in NOT_IMPLEMENTED:
        kwargs = (dict(action="store_true") if nargs == 0
                  else dict(nargs=None if nargs == 1 else nargs, metavar="VALUE"))
        group.add_argument(name, dest=_refused_dest(name), default=None,
                           help=f"refused: {why}", **kwargs)


def refused_flags(args) -> list[RefusedFlag]:
    """A RefusedFlag for every NOT_IMPLEMENTED flag given on the command line, in table order."""
    return [RefusedFlag(name, getattr(args, _refused_dest(name)), why)
            for name, _, why in NOT_IMPLEMENTED
            if getattr(args, _refused_dest(name), None) is not None]


def _refused_dest(name: str) -> str:
    return "refused_" + name.lstrip("-").replace("-", "_")


def compat_rules(cfg, require: Callable[[bool, str, object, str], None]) -> None:
    """The accepted flags whose value must agree with the model (`cfg` a RunConfig)."""
    c, m = cfg.compat, cfg.model
    for name in ("tensor_model_parallel_size", "expert_tensor_parallel_size"):
        value = getattr(c, name)
        require(value in (None, 1), name, value, f"must be 1: {NO_TP}")
    require(c.max_position_embeddings is None or c.max_position_embeddings >= m.seq_length,
            "max_position_embeddings", c.max_position_embeddings,
            f"must be >= --seq-length={m.seq_length}")
    require(c.rotary_percent == 1.0, "rotary_percent", c.rotary_percent,
            "must be 1.0: partial rotary embeddings are not implemented; every head dimension "
            "is rotated")
    require(c.rotary_scaling_factor == 1.0, "rotary_scaling_factor", c.rotary_scaling_factor,
            "must be 1.0: rotary scaling (long context) is not implemented")
    require(not (c.calculate_per_token_loss and cfg.data.eod_mask_loss),
            "calculate_per_token_loss", True, "with --eod-mask-loss the mean over the global "
            "batch's counted tokens differs from the mean of the microbatches' means, which is "
            "what runs here; not implemented")
    require(not c.group_query_attention or m.num_query_groups is not None,
            "group_query_attention", True, "needs --num-query-groups")
    require(c.ckpt_format != "fsdp_dtensor" or (cfg.checkpoint.save is None and
                                                 cfg.checkpoint.load is None),
            "ckpt_format", c.ckpt_format, "Megatron-FSDP's DTensor layout is not written or "
            "read: checkpoints are torch.distributed.checkpoint folders in epoverlap's layout "
            "(--ckpt-format torch_dist)")
    require(c.num_distributed_optimizer_instances is None or
            c.num_distributed_optimizer_instances >= 1, "num_distributed_optimizer_instances",
            c.num_distributed_optimizer_instances, "must be >= 1")


def compat_notes(cfg) -> list[str]:
    """'--flag VALUE (why)' for each value accepted because, beside the other flags given
    (`cfg` a RunConfig), it changes nothing here (what every value of a flag changes nothing:
    the flags' own notes, `Flag.note`)."""
    c, moe, ckpt = cfg.compat, cfg.moe, cfg.checkpoint
    notes = []
    if c.transformer_impl == "transformer_engine":
        notes.append("--transformer-impl transformer_engine (epoverlap's own layers and kernels "
                     "run; Transformer Engine is not used)")
    if c.ckpt_format == "fsdp_dtensor":
        notes.append("--ckpt-format fsdp_dtensor (no --save or --load: no checkpoint is written "
                     "or read)")
    if ckpt.save_interval is not None and ckpt.save is None:
        notes.append("--save-interval (no --save: nothing is saved)")
    if moe.moe_router_pre_softmax and moe.moe_router_score_function == "sigmoid":
        notes.append("--moe-router-pre-softmax (the scores are sigmoid's: Megatron-core applies "
                     "it to softmax scores only, and so does epoverlap)")
    return notes
