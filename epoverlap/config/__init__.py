"""The one configuration module: every default, every CLI flag, every cross-field rule.

Owns the config dataclasses (one per concern, orthogonal fields), the argparse surface with the
flag names Megatron users type, the named presets, and `validate_config`, which checks every
rule and raises `ConfigError` naming the flag, the value and what is allowed. Validation needs
only the world size, whether CUDA is present and the file system (output paths must be
writable: tried with a temporary file, nothing is created), so a bad invocation exits before
any process group work. The memory estimate, which needs the device's size, is
training/memory.py's. The CUDA-graph surface (with its deprecated forms) lives in
`graphs/config.py` and is validated from here, with the facts the model states about itself:
whether the MoE dispatch reads the host (`config.dispatch.DispatchMode`). Flags renamed to Megatron-core's spelling
keep their old one as a deprecated alias (`FLAG_ALIASES`, through `flag_aliases`).

The parser (`CliParser`) has no prefix matching, a one-line usage, each flag's default in
--help and, at its end, what each preset sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from epoverlap.config.dispatch import DispatchMode
from epoverlap.data.tokenizers import TOKENIZER_TYPES
from epoverlap.errors import ConfigError
from epoverlap.flag_aliases import FlagAlias, apply_aliases
from epoverlap.graphs.config import (CUDA_GRAPH_IMPLS, CUDA_GRAPH_MODULES, INFERENCE_SCOPES,
                                     CudaGraphConfig, add_cuda_graph_args,
                                     cuda_graph_config_from_args, validate_cuda_graph_config)

MAX_LAYERS = 4096
SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = ("fp32", "fp64")
KERNEL_BACKENDS = ("auto", "torch", "triton")
DROP_POLICIES = ("probs", "position")  # as epoverlap.kernels.capacity
DEVICES = ("auto", "cpu", "cuda")
OVERLAP_PLANS = ("combined_1f1b", "combined_1f1b_early_release", "combined_1f1b_paired_ends")
COMM_MODES = ("real", "local_copy")
COMM_STREAM_PRIORITIES = ("high", "normal")
NCCL_MAX_CHANNELS = 64  # NCCL's MAXCHANNELS: the most CTAs a collective may use
MAX_SM_CARVEOUT = 64  # the most SMs the grouped GEMMs may leave free (H100/H200 have 132)
# The allowed values of every flag that takes a name, by flag (the help texts and validation use
# the same tuples; the config fuzz test draws from this table).
CHOICES: dict[str, tuple[str, ...]] = {
    "--moe-router-score-function": SCORE_FUNCTIONS, "--moe-router-dtype": ROUTER_DTYPES,
    "--kernel-backend": KERNEL_BACKENDS, "--device": DEVICES, "--overlap-plan": OVERLAP_PLANS,
    "--comm-mode": COMM_MODES, "--comm-stream-priority": COMM_STREAM_PRIORITIES,
    "--moe-token-drop-policy": DROP_POLICIES,
    "--cuda-graph-impl": CUDA_GRAPH_IMPLS,
    "--cuda-graph-modules": CUDA_GRAPH_MODULES, "--inference-cuda-graph-scope": INFERENCE_SCOPES,
}
MIN_TIMEOUT_MINUTES = 0.05


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 128
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    seq_length: int = 128
    vocab_size: int = 256  # not a flag: the data's tokenizer sets it (main.py); 256 = bytes
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    num_experts: Optional[int] = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_dtype: Optional[str] = None
    moe_layer_freq: str = "1"
    moe_first_k_dense_replace: int = 0
    moe_router_force_load_balancing: bool = False
    moe_expert_capacity_factor: Optional[float] = None  # negative = None (Megatron-core's reading)
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_dispatch_budget: Optional[float] = None
    moe_dispatch_once_per_rank: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.num_experts)

    @property
    def capacity_factor(self) -> Optional[float]:
        """The capacity factor in force: None when unset or negative (dropless)."""
        factor = self.moe_expert_capacity_factor
        return None if factor is None or factor < 0 else factor


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    expert_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None  # Megatron's older form of V
    num_virtual_stages_per_pipeline_rank: Optional[int] = None  # its newer form: V itself
    distributed_timeout_minutes: float = 10.0
    # NCCL's CTA budget of the expert-parallel communicator (its all-to-alls); None: NCCL's own
    moe_a2a_nccl_max_ctas: Optional[int] = None
    moe_a2a_nccl_min_ctas: Optional[int] = None
    # SMs the experts' grouped GEMMs leave free for the all-to-alls beside them; None: all
    moe_grouped_gemm_sm_carveout: Optional[int] = None


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    micro_batch_size: int = 2
    num_microbatches: int = 4
    global_batch_size: Optional[int] = None  # when set, for_world derives num_microbatches
    train_iters: int = 20
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 2
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    bf16: bool = False
    deterministic_mode: bool = False
    deterministic_fill_uninitialized_memory: bool = False
    device: str = "auto"
    skip_optimizer_step: bool = False
    check_for_nan_in_loss_and_grad: bool = False
    no_gradient_accumulation_fusion: bool = False


@dataclass(kw_only=True, frozen=True)
class OverlapConfig:
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    overlap_plan: str = "combined_1f1b"
    comm_stream_priority: str = "high"  # of the comm lane's CUDA stream (the overlap's)
    comm_mode: str = "real"
    overlap_probe_steps: int = 0  # >0: time the overlap plan against sequential, keep the faster

    @property
    def comm_stream_high_priority(self) -> bool:
        return self.comm_stream_priority == "high"


@dataclass(kw_only=True, frozen=True)
class KernelConfig:
    kernel_backend: str = "auto"


DEFAULT_SPLIT = "969,30,1"


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """One source: raw text (`data`, byte tokens; the default, Python's own sources), Megatron
    indexed datasets (`data_path`, read through a tokenizer's vocabulary) or `mock_data`."""

    data: Optional[str] = None
    data_path: tuple[str, ...] = ()
    split: Optional[str] = None
    mock_data: bool = False
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None

    @property
    def text_source(self) -> Optional[str]:
        """The raw-text source when neither --data-path nor --mock-data is given."""
        if self.data_path or self.mock_data:
            return None
        return self.data or "stdlib"

    @property
    def blend(self) -> tuple[list[str], Optional[list[float]]]:
        return parse_blend(self.data_path)

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        return parse_split(self.split or DEFAULT_SPLIT)


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None


@dataclass(kw_only=True, frozen=True)
class LogConfig:
    log_interval: int = 1
    log_json: Optional[str] = None
    profile_steps: Optional[str] = None
    profile_dir: Optional[str] = None
    use_pytorch_profiler: bool = False
    tensorboard_dir: Optional[str] = None

    @property
    def profile_range(self) -> Optional[tuple[int, int]]:
        if self.profile_steps is None:
            return None
        start, end = self.profile_steps.split(":")
        return int(start), int(end)


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
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)

    def moe_layer_pattern(self) -> list[bool]:
        """For each layer: True if it is an MoE layer."""
        return moe_layer_pattern(self.model.num_layers, self.moe)

    @property
    def plan_name(self) -> str:
        """The schedule a step runs: --overlap-plan with the overlap on, else sequential."""
        o = self.overlap
        return o.overlap_plan if o.overlap_moe_expert_parallel_comm else "sequential"

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

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that read different data: one pipeline of PP stages per DP rank."""
        return world_size // self.parallel.pipeline_model_parallel_size

    def resolved_device(self, cuda_available: bool) -> str:
        if self.train.device == "auto":
            return "cuda" if cuda_available else "cpu"
        return self.train.device

    def resolved_kernel_backend(self, device: str) -> str:
        if self.kernels.kernel_backend == "auto":
            return "triton" if device == "cuda" else "torch"
        return self.kernels.kernel_backend

    def for_world(self, world_size: int) -> "RunConfig":
        """This config with num_microbatches derived from --global-batch-size, if given (each
        data-parallel rank reads its own data: DP = world / PP)."""
        gbs = self.train.global_batch_size
        if gbs is None:
            return self
        microbatches = gbs // (self.train.micro_batch_size * self.data_parallel_size(world_size))
        return dataclasses.replace(self, train=dataclasses.replace(
            self.train, num_microbatches=microbatches))

    def with_vocab_size(self, vocab_size: int) -> "RunConfig":
        """This config with the model's vocabulary set (to the data's tokenizer's)."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model,
                                                                   vocab_size=vocab_size))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def moe_layer_pattern(num_layers: int, moe: MoEConfig) -> list[bool]:
    """--moe-layer-freq N (every N-th layer, from layer 0) or a 0/1 list, minus first-k dense."""
    if not moe.enabled:
        return [False] * num_layers
    freq = moe.moe_layer_freq.strip()
    if "," in freq or freq.startswith("["):
        pattern = [bool(int(x)) for x in freq.strip("[]").split(",") if x.strip()]
    else:
        every = int(freq)
        pattern = [layer % every == 0 for layer in range(num_layers)]
    return [is_moe and layer >= moe.moe_first_k_dense_replace
            for layer, is_moe in enumerate(pattern)]


# --------------------------------------------------------------------------- data flag syntax
def parse_split(text: str) -> tuple[float, float, float]:
    """"969,30,1" -> normalized (train, valid, test) proportions. Raises ValueError."""
    parts = [p.strip() for p in re.split(r"[,/]", text) if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError("expected up to three comma-separated proportions, e.g. 969,30,1") \
            from None
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or not values[0] > 0:
        raise ValueError("up to three proportions >= 0 with the train one > 0, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(v / total for v in values)  # type: ignore[return-value]


def parse_blend(items: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """`--data-path` items -> (prefixes, weights or None). Raises ValueError.

    Either prefixes only (A B ...), or weight-prefix pairs (0.3 A 0.7 B), as Megatron-core
    reads them.
    """
    items = list(items)
    if not items:
        raise ValueError("give at least one PREFIX (of PREFIX.bin / PREFIX.idx)")
    if len(items) % 2 == 0 and all(_is_number(w) for w in items[0::2]):
        weights = [float(w) for w in items[0::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError("weights must be >= 0 and not all 0")
        return items[1::2], weights
    numbers = [item for item in items if _is_number(item)]
    if numbers:
        raise ValueError(f"{numbers[0]} looks like a weight: give WEIGHT PREFIX pairs for every "
                         "dataset, or prefixes only")
    return items, None


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# --------------------------------------------------------------------------- presets
PRESETS: dict[str, dict] = {
    # The main job's default: a small byte-level MoE LM that trains in about a minute on 2 CPUs.
    "tiny": dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                 num_query_groups=2, seq_length=128, num_experts=8, moe_router_topk=2,
                 moe_ffn_hidden_size=128, moe_aux_loss_coeff=1e-2, micro_batch_size=4,
                 num_microbatches=4,
                 train_iters=30, lr=3e-3, min_lr=3e-4, lr_warmup_iters=3),
    # A GPU-sized small model.
    "small": dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
                  num_query_groups=4, seq_length=1024, num_experts=16, moe_router_topk=2,
                  moe_ffn_hidden_size=1024, moe_shared_expert_intermediate_size=1024,
                  # aux 5e-2: byte-level text collapses the router at init (imbalance 8 by
                  # step 10); 1e-2 (the Mixtral recipe) left 2.1-2.6 at step 200 on one H200,
                  # 5e-2 1.79 (benchmarks/determinism.md)
                  moe_aux_loss_coeff=5e-2, micro_batch_size=4, num_microbatches=4,
                  train_iters=50, lr=1e-3, min_lr=1e-4,
                  lr_warmup_iters=5),
    # The Megatron-core comparison shape (environment.md), first row.
    "megatron-cmp": dict(num_layers=4, hidden_size=2048, ffn_hidden_size=8192,
                         num_attention_heads=16, seq_length=2048, num_experts=32,
                         moe_router_topk=4, moe_ffn_hidden_size=1024, micro_batch_size=2,
                         num_microbatches=8, moe_router_force_load_balancing=True),
    "mixtral-proxy": dict(num_layers=4, hidden_size=4096, ffn_hidden_size=14336,
                          num_attention_heads=32, num_query_groups=8, seq_length=2048,
                          num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336,
                          micro_batch_size=1, num_microbatches=4),
    "dsv3-proxy": dict(num_layers=2, hidden_size=7168, ffn_hidden_size=18432,
                       num_attention_heads=56, num_query_groups=8, seq_length=4096,
                       num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                       moe_shared_expert_intermediate_size=2048, moe_router_num_groups=8,
                       moe_router_group_topk=4, moe_router_score_function="sigmoid",
                       moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                       moe_first_k_dense_replace=0, micro_batch_size=1, num_microbatches=4),
}


# --------------------------------------------------------------------------- argparse surface
def _opt_int(text: str) -> Optional[int]:
    return None if text.lower() in ("none", "") else int(text)


def _opt_float(text: str) -> Optional[float]:
    return None if text.lower() in ("none", "") else float(text)


# (flag, dataclass section, field, type, help). bool fields become store_true flags.
_FLAGS: list[tuple[str, str, str, object, str]] = [
    ("--num-layers", "model", "num_layers", int, "transformer layers"),
    ("--hidden-size", "model", "hidden_size", int, "model width"),
    ("--ffn-hidden-size", "model", "ffn_hidden_size", int, "dense MLP width"),
    ("--num-attention-heads", "model", "num_attention_heads", int, "query heads"),
    ("--num-query-groups", "model", "num_query_groups", _opt_int, "key/value heads (GQA)"),
    ("--seq-length", "model", "seq_length", int, "tokens per sequence"),
    ("--rotary-base", "model", "rotary_base", float, "rotary embedding base"),
    ("--init-method-std", "model", "init_method_std", float, "weight init std"),
    ("--num-experts", "moe", "num_experts", _opt_int, "routed experts (0/none: dense model)"),
    ("--moe-router-topk", "moe", "moe_router_topk", int, "experts per token"),
    ("--moe-ffn-hidden-size", "moe", "moe_ffn_hidden_size", _opt_int, "expert FFN width"),
    ("--moe-shared-expert-intermediate-size", "moe", "moe_shared_expert_intermediate_size",
     _opt_int, "shared expert FFN width (none: no shared expert)"),
    ("--moe-router-score-function", "moe", "moe_router_score_function", str,
     f"one of {SCORE_FUNCTIONS}"),
    ("--moe-router-pre-softmax", "moe", "moe_router_pre_softmax", bool,
     "softmax before top-k"),
    ("--moe-router-num-groups", "moe", "moe_router_num_groups", _opt_int, "expert groups"),
    ("--moe-router-group-topk", "moe", "moe_router_group_topk", _opt_int, "groups kept"),
    ("--moe-router-topk-scaling-factor", "moe", "moe_router_topk_scaling_factor", _opt_float,
     "multiplies routing probs"),
    ("--moe-router-enable-expert-bias", "moe", "moe_router_enable_expert_bias", bool,
     "aux-loss-free expert bias (sigmoid)"),
    ("--moe-router-bias-update-rate", "moe", "moe_router_bias_update_rate", float,
     "expert bias step per iteration"),
    ("--moe-aux-loss-coeff", "moe", "moe_aux_loss_coeff", float, "Switch aux loss coefficient"),
    ("--moe-z-loss-coeff", "moe", "moe_z_loss_coeff", _opt_float, "router z-loss coefficient"),
    ("--moe-router-dtype", "moe", "moe_router_dtype", str, f"router gate dtype {ROUTER_DTYPES}"),
    ("--moe-layer-freq", "moe", "moe_layer_freq", str,
     "every N-th layer is MoE, or a 0/1 list like 0,1,1,1"),
    ("--moe-first-k-dense-replace", "moe", "moe_first_k_dense_replace", int,
     "first k layers dense"),
    ("--moe-router-force-load-balancing", "moe", "moe_router_force_load_balancing", bool,
     "benchmark only: random router logits (balanced routing)"),
    ("--moe-expert-capacity-factor", "moe", "moe_expert_capacity_factor", _opt_float,
     "expert capacity = ceil(tokens x topk / experts x FACTOR); routed tokens over it are "
     "dropped and counted (Megatron-core semantics; negative or none: dropless)"),
    ("--moe-pad-expert-input-to-capacity", "moe", "moe_pad_expert_input_to_capacity", bool,
     "pad every expert's input to the capacity: static all-to-all sizes, no host sync"),
    ("--moe-token-drop-policy", "moe", "moe_token_drop_policy", str,
     f"which tokens an expert over capacity keeps: one of {DROP_POLICIES}"),
    ("--moe-dispatch-budget", "moe", "moe_dispatch_budget", _opt_float,
     "dropless without a host sync: fixed all-to-all buffers of FACTOR x the balanced rows "
     "per rank; a step that overflows them is rerun with a larger budget"),
    ("--moe-dispatch-once-per-rank", "moe", "moe_dispatch_once_per_rank", bool,
     "send each token once to every EP rank that holds one of its top-k experts (not once "
     "per expert), with the probs of that rank's experts; the receiving rank copies it to "
     "them and sums their outputs before the combine sends one row back. All-to-all volume "
     "/ up to min(topk, EP); the experts' rows and grads are the same, the combined output "
     "is summed per rank first (another rounding order). Dropless, capacity (unpadded) and "
     "budget dispatches"),
    ("--expert-model-parallel-size", "parallel", "expert_model_parallel_size", int,
     "EP size: experts are sharded over EP ranks and replicated over world/EP (EDP) ranks; "
     "dense layers are data-parallel over the stage's DP ranks"),
    ("--distributed-timeout-minutes", "parallel", "distributed_timeout_minutes", float,
     "collective timeout of every process group: a peer rank that does not answer for this "
     "long ends the job, naming it (fractions allowed, >= 0.05)"),
    ("--moe-a2a-nccl-max-ctas", "parallel", "moe_a2a_nccl_max_ctas", _opt_int,
     f"NCCL: at most N CTAs (SMs) for each all-to-all of the expert-parallel group (its "
     f"communicator's max_ctas, 1..{NCCL_MAX_CHANNELS}; none: NCCL's choice); other groups "
     "keep NCCL's defaults"),
    ("--moe-a2a-nccl-min-ctas", "parallel", "moe_a2a_nccl_min_ctas", _opt_int,
     f"NCCL: at least N CTAs for each all-to-all of the expert-parallel group (min_ctas, "
     f"1..{NCCL_MAX_CHANNELS}, <= the max)"),
    ("--moe-grouped-gemm-sm-carveout", "parallel", "moe_grouped_gemm_sm_carveout", _opt_int,
     "CUDA: the experts' grouped GEMMs run on all SMs but N (torch's SM carveout), leaving N "
     "free for the all-to-all kernels that run beside them under "
     "--overlap-moe-expert-parallel-comm; pair it with --moe-a2a-nccl-max-ctas N. The "
     "persistent grouped GEMM otherwise holds every SM: an all-to-all started beside it waits "
     "for SMs, and its last CTAs wait for the all-to-all. Same bits (each output tile is "
     "still one CTA's full-K sum); none: every SM"),
    ("--pipeline-model-parallel-size", "parallel", "pipeline_model_parallel_size", int,
     "PP size: pipeline stages (1F1B schedule; ranks laid out as Megatron-core's "
     "tp-cp-ep-dp-pp)"),
    ("--num-layers-per-virtual-pipeline-stage", "parallel",
     "num_layers_per_virtual_pipeline_stage", _opt_int,
     "layers per model chunk: interleaved 1F1B with layers / (PP x this) chunks per stage"),
    ("--num-virtual-stages-per-pipeline-rank", "parallel",
     "num_virtual_stages_per_pipeline_rank", _opt_int,
     "model chunks per stage (interleaved 1F1B); the newer form of the flag above"),
    ("--micro-batch-size", "train", "micro_batch_size", int, "sequences per microbatch"),
    ("--num-microbatches", "train", "num_microbatches", int, "microbatches per step"),
    ("--global-batch-size", "train", "global_batch_size", _opt_int,
     "sequences per step over all ranks (Megatron's form): sets --num-microbatches to "
     "it / (--micro-batch-size x ranks)"),
    ("--train-iters", "train", "train_iters", int, "optimizer steps"),
    ("--lr", "train", "lr", float, "peak learning rate"),
    ("--min-lr", "train", "min_lr", float, "final learning rate"),
    ("--lr-warmup-iters", "train", "lr_warmup_iters", int, "linear warmup steps"),
    ("--weight-decay", "train", "weight_decay", float, "AdamW weight decay"),
    ("--adam-beta1", "train", "adam_beta1", float, "AdamW beta1"),
    ("--adam-beta2", "train", "adam_beta2", float, "AdamW beta2"),
    ("--adam-eps", "train", "adam_eps", float, "AdamW epsilon"),
    ("--clip-grad", "train", "clip_grad", float, "global grad-norm clip (0: off)"),
    ("--seed", "train", "seed", int, "random seed"),
    ("--bf16", "train", "bf16", bool, "bf16 params and compute (GPU)"),
    ("--deterministic-mode", "train", "deterministic_mode", bool, "deterministic algorithms"),
    ("--deterministic-fill-uninitialized-memory", "train",
     "deterministic_fill_uninitialized_memory", bool,
     "with --deterministic-mode: also fill every new tensor's memory (NaN, or the largest "
     "integer) before use, torch's check that no result reads memory nothing wrote; one more "
     "kernel per allocation. Off: the results are the same bits (tested), at a lower price"),
    ("--device", "train", "device", str, f"one of {DEVICES}"),
    ("--skip-optimizer-step", "train", "skip_optimizer_step", bool,
     "benchmark only: forward+backward+grad reduce, no update"),
    ("--check-for-nan-in-loss-and-grad", "train", "check_for_nan_in_loss_and_grad", bool,
     "stop at a NaN/Inf loss or grad (before the optimizer step), naming rank and parameter"),
    ("--no-gradient-accumulation-fusion", "train", "no_gradient_accumulation_fusion", bool,
     "fp32 training: dense weight-grad GEMMs write a product that is then added to main_grad, "
     "instead of adding into main_grad inside the GEMM (bf16/fp16 always take the two ops)"),
    ("--overlap-moe-expert-parallel-comm", "overlap", "overlap_moe_expert_parallel_comm", bool,
     "combined 1F1B schedule hiding EP all-to-all"),
    ("--delay-wgrad-compute", "overlap", "delay_wgrad_compute", bool,
     "split weight grads out and run them in the comm gaps"),
    ("--overlap-plan", "overlap", "overlap_plan", str,
     f"one of {OVERLAP_PLANS}: the combined 1F1B (F0 alone, F(i) beside B(i-1), B(M-1) "
     "alone); its early_release form (B.attn before F.mlp, for memory); paired_ends (F0 "
     "beside F1 and B(M-2) beside B(M-1): the ends overlap too, for one microbatch's "
     "activations more; one pipeline stage)"),
    ("--comm-stream-priority", "overlap", "comm_stream_priority", str,
     f"one of {COMM_STREAM_PRIORITIES}: CUDA priority of the overlap's comm stream (its "
     "all-to-alls run there); high lets their kernels start ahead of waiting compute kernels"),
    ("--overlap-probe-steps", "overlap", "overlap_probe_steps", int,
     "with --overlap-moe-expert-parallel-comm: after the first step, time N steps of "
     "the overlap plan and N of the sequential schedule, alternating, and run the rest of the "
     "training with the faster (both give the same bits); with --cuda-graph-impl local or "
     "full_iteration each schedule replays its own graphs (captured before the timed steps); "
     "0 (default): always the overlap"),
    ("--comm-mode", "overlap", "comm_mode", str,
     f"benchmark only: {COMM_MODES} (local_copy replaces all-to-alls by local copies)"),
    ("--kernel-backend", "kernels", "kernel_backend", str, f"one of {KERNEL_BACKENDS}"),
    ("--data", "data", "data", str,
     "raw text file or folder read as byte tokens, or 'stdlib' (Python's own sources; the "
     "default when no --data-path or --mock-data is given)"),
    ("--data-path", "data", "data_path", list,
     "Megatron indexed datasets: PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...] "
     "(PREFIX.bin + PREFIX.idx; epoverlap-convert-data writes them)"),
    ("--split", "data", "split", str,
     f"train,valid,test proportions of each --data-path dataset's documents (default "
     f"{DEFAULT_SPLIT}); training reads the train part"),
    ("--mock-data", "data", "mock_data", bool,
     "synthetic tokens (a learnable random bigram chain) instead of data"),
    ("--tokenizer-type", "data", "tokenizer_type", str,
     f"one of {TOKENIZER_TYPES}: the vocabulary of --data-path / --mock-data"),
    ("--tokenizer-model", "data", "tokenizer_model", str,
     "HuggingFaceTokenizer: a tokenizer.json or a folder holding one"),
    ("--vocab-size", "data", "vocab_size", int,
     "NullTokenizer: ids 0..N-1 (the model's vocabulary is N + 1, with end-of-document N)"),
    ("--log-interval", "log", "log_interval", int, "steps between log lines"),
    ("--log-json", "log", "log_json", str, "write one JSON record per step here"),
    ("--profile-steps", "log", "profile_steps", str, "START:END steps to record spans for"),
    ("--profile-dir", "log", "profile_dir", str, "where span files go"),
    ("--use-pytorch-profiler", "log", "use_pytorch_profiler", bool,
     "also capture torch.profiler traces of the --profile-steps"),
    ("--tensorboard-dir", "log", "tensorboard_dir", str,
     "write TensorBoard scalars here (needs the 'tensorboard' extra)"),
    ("--save", "checkpoint", "save", str,
     "checkpoint folder (DIR/iter_NNNNNNN, torch.distributed.checkpoint; shared by all ranks)"),
    ("--save-interval", "checkpoint", "save_interval", int,
     "save every N steps (and after the last); without it, only after the last"),
    ("--load", "checkpoint", "load", str,
     "resume from the newest complete checkpoint in DIR (or from DIR itself); any EP size"),
]
_FLAG_OF_FIELD = {name: flag for flag, _, name, _, _ in _FLAGS}
_FIELD_OF_FLAG = {flag: name for name, flag in _FLAG_OF_FIELD.items()}

# Old spellings, still accepted with one warning each (the mechanism: `flag_aliases`).
FLAG_ALIASES = (
    FlagAlias("--deterministic", "--deterministic-mode"),
    FlagAlias("--profile-torch", "--use-pytorch-profiler"),
    FlagAlias("--data", "--mock-data", True, old_value="synthetic"),
    FlagAlias("--dist-timeout-minutes", "--distributed-timeout-minutes"),
)
_SECTIONS = {"model": ModelConfig, "moe": MoEConfig, "parallel": ParallelConfig,
             "train": TrainConfig, "overlap": OverlapConfig, "kernels": KernelConfig,
             "data": DataConfig, "log": LogConfig, "checkpoint": CheckpointConfig}
USAGE = "%(prog)s [--preset NAME] [FLAG VALUE ...]   (--help lists every flag)"


def flag_of(field_name: str) -> str:
    """The CLI flag for a config field name (for error messages)."""
    return _FLAG_OF_FIELD.get(field_name, "--" + field_name.replace("_", "-"))


def _dest_of(flag: str) -> str:
    return _FIELD_OF_FLAG.get(flag, flag.lstrip("-").replace("-", "_"))


class CliParser(argparse.ArgumentParser):
    """argparse without prefix matching (`--train 1` is an error, as in Megatron-core); with
    `printing` False (every rank but the first of a node) usage, help and errors stay silent
    while the exit status is the same, so a torchrun job prints one usage block, not one per
    rank."""

    def __init__(self, *args, printing: bool = True, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.printing = printing

    def print_usage(self, file=None) -> None:
        if self.printing:
            super().print_usage(file)

    def print_help(self, file=None) -> None:
        if self.printing:
            super().print_help(file)

    def exit(self, status=0, message=None):
        super().exit(status, message if self.printing else None)


def _default_text(section: str, name: str, kind) -> str:
    if kind is bool:
        return "off unless given"
    default = {f.name: f.default for f in dataclasses.fields(_SECTIONS[section])}[name]
    return "none" if default is None else str(default)


def presets_help() -> str:
    """What each preset sets, as flags (the --help epilog)."""
    lines = ["presets (--preset NAME sets these; flags given explicitly win):"]
    for name in sorted(PRESETS):
        flags = " ".join(flag_of(key) if value is True else f"{flag_of(key)} {value}"
                         for key, value in PRESETS[name].items())
        lines += textwrap.wrap(flags, width=96, initial_indent=f"  {name:<14}",
                               subsequent_indent=" " * 16, break_on_hyphens=False,
                               break_long_words=False)
    return "\n".join(lines)


def build_parser(prog: str = "epoverlap-train", printing: bool = True) -> CliParser:
    parser = CliParser(
        prog=prog, usage=USAGE, printing=printing, epilog=presets_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train an MoE language model with expert parallelism (and EP overlap).\n"
                    "Defaults below are those without --preset.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, metavar="NAME",
                        help=f"one of {', '.join(sorted(PRESETS))}: named model/run sizes "
                             "(what each sets: the list at the end); explicit flags win")
    for flag, section, name, kind, help_text in _FLAGS:
        help_text = f"{help_text} (default: {_default_text(section, name, kind)})"
        if kind is bool:
            parser.add_argument(flag, dest=name, action="store_true", default=None,
                                help=help_text)
        elif kind is list:
            parser.add_argument(flag, dest=name, nargs="+", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=None, help=help_text)
    for alias in FLAG_ALIASES:
        if alias.old in _FIELD_OF_FLAG:  # the old spelling is a flag of its own (--data)
            continue
        kind = next((k for f, _, _, k, _ in _FLAGS if f == alias.new), bool)
        if kind is bool:
            parser.add_argument(alias.old, dest=_dest_of(alias.old), action="store_true",
                                default=None, help=f"deprecated: use {alias.new}")
        else:
            parser.add_argument(alias.old, dest=_dest_of(alias.old), type=kind, default=None,
                                help=f"deprecated: use {alias.new}")
    add_cuda_graph_args(parser)
    return parser


def config_from_args(args: argparse.Namespace,
                     warn: Callable[[str], None] = lambda msg: None) -> RunConfig:
    """Defaults <- preset <- explicit flags (old spellings migrated, one `warn` each once the
    whole command line is accepted). No validation here (see validate_config)."""
    notes: list[str] = []
    dests = [name for _, _, name, _, _ in _FLAGS] + [_dest_of(a.old) for a in FLAG_ALIASES]
    given = apply_aliases({name: getattr(args, name) for name in dests}, FLAG_ALIASES,
                          _dest_of, notes)
    values = dict(PRESETS[args.preset]) if args.preset else {}
    if given["global_batch_size"] is not None:
        if given["num_microbatches"] is not None:
            raise ConfigError("--global-batch-size", given["global_batch_size"],
                              "give it or --num-microbatches, not both")
        values.pop("num_microbatches", None)  # derived by RunConfig.for_world
    values.update({name: given[name] for _, _, name, _, _ in _FLAGS if given[name] is not None})
    sections: dict[str, dict] = {}
    for _, section, name, kind, _ in _FLAGS:
        if name in values:
            value = tuple(values[name]) if kind is list else values[name]
            sections.setdefault(section, {})[name] = value
    built = {section: cls(**sections.get(section, {})) for section, cls in _SECTIONS.items()}
    config = RunConfig(**built, cuda_graph=cuda_graph_config_from_args(args, notes.append))
    for note in notes:
        warn(note)
    return config


def parse_config(argv: Optional[list[str]] = None,
                 warn: Callable[[str], None] = lambda msg: None,
                 printing: bool = True) -> RunConfig:
    return config_from_args(build_parser(printing=printing).parse_args(argv), warn)


# --------------------------------------------------------------------------- validation
def _require(ok: bool, field_name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(flag_of(field_name), value, allowed)


def _validate_finite(cfg: RunConfig) -> None:
    """Every float flag: NaN and infinity are refused (they would only surface mid-training)."""
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for _, section, name, kind, _ in _FLAGS:
        value = getattr(sections[section], name)
        if kind in (float, _opt_float) and value is not None:
            _require(math.isfinite(value), name, value, "must be a finite number")


def _validate_model(m: ModelConfig) -> None:
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "vocab_size"):
        _require(getattr(m, name) >= 1, name, getattr(m, name), "must be >= 1")
    # layer lists are built per layer from here on: an absurd count is refused, not allocated
    _require(m.num_layers <= MAX_LAYERS, "num_layers", m.num_layers, f"must be <= {MAX_LAYERS}")
    _require(m.seq_length >= 2, "seq_length", m.seq_length, "must be >= 2")
    _require(m.hidden_size % m.num_attention_heads == 0, "num_attention_heads",
             m.num_attention_heads, f"must divide --hidden-size={m.hidden_size}")
    _require(m.head_dim % 2 == 0, "hidden_size", m.hidden_size,
             f"head dim hidden/heads={m.head_dim} must be even (rotary embeddings)")
    _require(m.rotary_base > 0, "rotary_base", m.rotary_base, "must be > 0")
    _require(m.init_method_std >= 0, "init_method_std", m.init_method_std, "must be >= 0")
    if m.num_query_groups is not None:
        _require(m.num_query_groups >= 1 and m.num_attention_heads % m.num_query_groups == 0,
                 "num_query_groups", m.num_query_groups,
                 f"must divide --num-attention-heads={m.num_attention_heads}")


def _validate_layer_pattern(num_layers: int, moe: MoEConfig) -> None:
    freq = moe.moe_layer_freq.strip()
    is_list = "," in freq or freq.startswith("[")
    try:
        items = [int(x) for x in freq.strip("[]").split(",") if x.strip()] if is_list \
            else [int(freq)]
    except ValueError:
        raise ConfigError("--moe-layer-freq", freq, "an integer N or a 0/1 list") from None
    if is_list:
        _require(len(items) == num_layers and set(items) <= {0, 1}, "moe_layer_freq", freq,
                 f"a 0/1 list needs exactly --num-layers={num_layers} entries")
    else:
        _require(items[0] >= 1, "moe_layer_freq", freq, "must be >= 1")
    _require(0 <= moe.moe_first_k_dense_replace <= num_layers, "moe_first_k_dense_replace",
             moe.moe_first_k_dense_replace, f"must be in [0, --num-layers={num_layers}]")


def _validate_router(moe: MoEConfig) -> None:
    num_experts = moe.num_experts
    _require(1 <= moe.moe_router_topk <= num_experts, "moe_router_topk", moe.moe_router_topk,
             f"must be in [1, --num-experts={num_experts}]")
    _require(moe.moe_router_score_function in SCORE_FUNCTIONS, "moe_router_score_function",
             moe.moe_router_score_function, f"allowed: {', '.join(SCORE_FUNCTIONS)}")
    _require(not moe.moe_router_pre_softmax or moe.moe_router_score_function == "softmax",
             "moe_router_pre_softmax", True, "only with --moe-router-score-function softmax")
    _require(not moe.moe_router_enable_expert_bias or moe.moe_router_score_function == "sigmoid",
             "moe_router_enable_expert_bias", True,
             "only with --moe-router-score-function sigmoid")
    _require(moe.moe_router_dtype in (None,) + ROUTER_DTYPES, "moe_router_dtype",
             moe.moe_router_dtype, f"allowed: {', '.join(ROUTER_DTYPES)}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(moe, name)
        _require(value is None or value >= 0, name, value, "must be >= 0")
    scaling = moe.moe_router_topk_scaling_factor
    _require(scaling is None or scaling > 0, "moe_router_topk_scaling_factor", scaling,
             "must be > 0")
    groups, group_topk = moe.moe_router_num_groups, moe.moe_router_group_topk
    _require((groups is None) == (group_topk is None), "moe_router_group_topk", group_topk,
             "set together with --moe-router-num-groups (both or neither)")
    if groups is not None:
        _require(groups >= 1 and num_experts % groups == 0, "moe_router_num_groups", groups,
                 f"must divide --num-experts={num_experts}")
        _require(1 <= group_topk <= groups, "moe_router_group_topk", group_topk,
                 f"must be in [1, --moe-router-num-groups={groups}]")
        _require(moe.moe_router_topk % group_topk == 0, "moe_router_topk", moe.moe_router_topk,
                 f"must be divisible by --moe-router-group-topk={group_topk}")
        per_group = num_experts // groups
        _require(moe.moe_router_topk // group_topk <= per_group, "moe_router_topk",
                 moe.moe_router_topk,
                 f"topk/group_topk must be <= experts per group ({per_group})")


def _validate_pipeline(cfg: RunConfig, world_size: int) -> None:
    """--pipeline-model-parallel-size and the virtual-stage flags: every stage and every model
    chunk holds the same whole number of layers."""
    p, layers = cfg.parallel, cfg.model.num_layers
    pp = p.pipeline_model_parallel_size
    _require(pp >= 1 and world_size % pp == 0, "pipeline_model_parallel_size", pp,
             f"must divide the world size {world_size}")
    _require(layers % pp == 0, "pipeline_model_parallel_size", pp,
             f"must divide --num-layers={layers} (every stage holds as many layers)")
    per_stage = layers // pp
    given = [(name, getattr(p, name)) for name in ("num_layers_per_virtual_pipeline_stage",
                                                    "num_virtual_stages_per_pipeline_rank")
             if getattr(p, name) is not None]
    if len(given) == 2:
        raise ConfigError(flag_of(given[1][0]), given[1][1],
                          f"give it or {flag_of(given[0][0])}, not both")
    for name, value in given:
        _require(value >= 1, name, value, "must be >= 1")
        _require(pp > 1, name, value, "needs --pipeline-model-parallel-size > 1 (virtual "
                 "stages interleave a pipeline)")
        _require(per_stage % value == 0, name, value,
                 f"must divide the {per_stage} layers of each stage (--num-layers={layers} / "
                 f"--pipeline-model-parallel-size={pp})")


def _validate_microbatches(cfg: RunConfig, world_size: int) -> None:
    """A pipeline of P stages needs at least P microbatches per step (one in flight each)."""
    pp, t = cfg.parallel.pipeline_model_parallel_size, cfg.train
    if pp == 1:
        return
    if t.global_batch_size is not None:
        dp = cfg.data_parallel_size(world_size)
        count = t.global_batch_size // (t.micro_batch_size * dp)
        _require(count >= pp, "global_batch_size", t.global_batch_size,
                 f"gives {count} microbatches per step (/ --micro-batch-size x data-parallel "
                 f"ranks = {t.micro_batch_size} x {dp}); --pipeline-model-parallel-size={pp} "
                 f"needs at least {pp}")
    else:
        _require(t.num_microbatches >= pp, "num_microbatches", t.num_microbatches,
                 f"must be >= --pipeline-model-parallel-size={pp} (every stage needs a "
                 "microbatch in flight)")


def _validate_moe(cfg: RunConfig, world_size: int) -> None:
    moe, ep = cfg.moe, cfg.parallel.expert_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    _require(ep >= 1 and world_size % (ep * pp) == 0, "expert_model_parallel_size", ep,
             f"must divide the world size {world_size}" if pp == 1 else
             f"EP x PP = {ep} x {pp} must divide the world size {world_size}")
    if not moe.enabled:
        _require(ep == 1, "expert_model_parallel_size", ep, "must be 1 without --num-experts")
        for name in ("moe_expert_capacity_factor", "moe_dispatch_budget"):
            _require(getattr(moe, name) is None, name, getattr(moe, name),
                     "needs MoE layers (--num-experts)")
        return
    _require(moe.num_experts >= 1 and moe.num_experts % ep == 0, "num_experts", moe.num_experts,
             f"must be divisible by --expert-model-parallel-size={ep}")
    _validate_router(moe)
    _validate_layer_pattern(cfg.model.num_layers, moe)
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(moe, name)
        _require(value is None or value >= 1, name, value, "must be >= 1")
    _validate_dispatch(cfg)


def _validate_dispatch(cfg: RunConfig) -> None:
    """Capacity (Megatron-core's drop/pad) or the dropless budget; see epoverlap.model.moe."""
    moe = cfg.moe
    factor, budget = moe.moe_expert_capacity_factor, moe.moe_dispatch_budget
    _require(moe.moe_token_drop_policy in DROP_POLICIES, "moe_token_drop_policy",
             moe.moe_token_drop_policy, f"allowed: {', '.join(DROP_POLICIES)}")
    _require(factor != 0, "moe_expert_capacity_factor", factor,
             "must be > 0 (a negative value means no capacity: dropless, as Megatron-core "
             "reads it)")
    pad = moe.moe_pad_expert_input_to_capacity
    _require(not pad or moe.capacity_factor is not None, "moe_pad_expert_input_to_capacity",
             True, "needs --moe-expert-capacity-factor > 0 (the capacity to pad to)")
    if budget is not None:
        _require(budget > 0, "moe_dispatch_budget", budget,
                 "must be > 0 (1.0 = the balanced share of rows per EP rank)")
        _require(moe.capacity_factor is None, "moe_dispatch_budget", budget,
                 "is dropless and --moe-expert-capacity-factor drops tokens: give one of them")
    _require(not (moe.moe_dispatch_once_per_rank and pad), "moe_pad_expert_input_to_capacity",
             True, "cannot be combined with --moe-dispatch-once-per-rank (a padded capacity "
             "fixes the rows per expert, once per rank sends a row per rank)")
    if pad:
        from epoverlap.kernels.capacity import get_capacity
        tokens = cfg.train.micro_batch_size * cfg.model.seq_length
        capacity = get_capacity(tokens * moe.moe_router_topk, moe.num_experts, factor)
        _require(capacity <= tokens, "moe_expert_capacity_factor", factor,
                 f"with --moe-pad-expert-input-to-capacity the capacity ({capacity}) must not "
                 f"exceed the {tokens} tokens of a microbatch (Megatron-core's padded permute "
                 f"fails there): use a factor <= num_experts / topk = "
                 f"{moe.num_experts / moe.moe_router_topk:g}")


def _validate_train(t: TrainConfig, dp_size: int, cuda_available: bool) -> None:
    for name in ("micro_batch_size", "num_microbatches", "train_iters"):
        _require(getattr(t, name) >= 1, name, getattr(t, name), "must be >= 1")
    per_microbatch = t.micro_batch_size * dp_size
    _require(t.global_batch_size is None or (t.global_batch_size >= per_microbatch and
                                             t.global_batch_size % per_microbatch == 0),
             "global_batch_size", t.global_batch_size, f"must be a multiple of "
             f"--micro-batch-size x ranks = {t.micro_batch_size} x {dp_size}")
    _require(t.lr > 0, "lr", t.lr, "must be > 0")
    _require(0 <= t.min_lr <= t.lr, "min_lr", t.min_lr, f"must be in [0, --lr={t.lr}]")
    _require(t.lr_warmup_iters >= 0, "lr_warmup_iters", t.lr_warmup_iters, "must be >= 0")
    _require(t.clip_grad >= 0, "clip_grad", t.clip_grad, "must be >= 0 (0 disables clipping)")
    for name in ("adam_beta1", "adam_beta2"):
        _require(0 <= getattr(t, name) < 1, name, getattr(t, name), "must be in [0, 1)")
    for name in ("adam_eps", "weight_decay"):
        _require(getattr(t, name) >= 0, name, getattr(t, name), "must be >= 0")
    _require(0 <= t.seed < 2**63, "seed", t.seed, "must be in [0, 2**63)")
    _require(t.device in DEVICES, "device", t.device, f"allowed: {', '.join(DEVICES)}")
    _require(t.device != "cuda" or cuda_available, "device", t.device,
             "no CUDA device is visible here; use --device cpu or auto")
    on_gpu = t.device == "cuda" or (t.device == "auto" and cuda_available)
    _require(not t.bf16 or on_gpu, "bf16", True, "needs a CUDA device (CPU runs are fp32)")
    _require(t.deterministic_mode or not t.deterministic_fill_uninitialized_memory,
             "deterministic_fill_uninitialized_memory", True, "needs --deterministic-mode")


def _validate_overlap(cfg: RunConfig, cuda_available: bool) -> None:
    o = cfg.overlap
    _require(o.overlap_plan in OVERLAP_PLANS, "overlap_plan", o.overlap_plan,
             f"allowed: {', '.join(OVERLAP_PLANS)}")
    _require(o.comm_mode in COMM_MODES, "comm_mode", o.comm_mode,
             f"allowed: {', '.join(COMM_MODES)}")
    if o.overlap_plan == "combined_1f1b_paired_ends":
        _require(cfg.parallel.pipeline_model_parallel_size == 1, "overlap_plan", o.overlap_plan,
                 "pairs the first two forwards and the last two backwards of one stage: needs "
                 "--pipeline-model-parallel-size 1")
    if o.overlap_moe_expert_parallel_comm and cfg.parallel.pipeline_model_parallel_size == 1:
        # with pipeline stages there are always transfers to hide (the P2P on the comm lane)
        _require(cfg.parallel.expert_model_parallel_size > 1, "overlap_moe_expert_parallel_comm",
                 True, "requires --expert-model-parallel-size > 1 or "
                 "--pipeline-model-parallel-size > 1 (there is no communication to hide)")
        _require(any(cfg.moe_layer_pattern()), "overlap_moe_expert_parallel_comm", True,
                 "requires at least one MoE layer (--num-experts, --moe-layer-freq) or "
                 "--pipeline-model-parallel-size > 1")
    _require(not o.delay_wgrad_compute or o.overlap_moe_expert_parallel_comm,
             "delay_wgrad_compute", True, "requires --overlap-moe-expert-parallel-comm")
    _require(o.comm_stream_priority in COMM_STREAM_PRIORITIES, "comm_stream_priority",
             o.comm_stream_priority, f"allowed: {', '.join(COMM_STREAM_PRIORITIES)}")
    _validate_overlap_probe(cfg)
    if o.comm_stream_priority != "high":
        _require(o.overlap_moe_expert_parallel_comm and cfg.resolved_device(cuda_available)
                 == "cuda", "comm_stream_priority", o.comm_stream_priority,
                 "sets the CUDA stream of the overlap's comm lane: needs a CUDA device and "
                 "--overlap-moe-expert-parallel-comm (without them there is no comm stream)")


def _validate_overlap_probe(cfg: RunConfig) -> None:
    """--overlap-probe-steps: the two schedules of one pipeline stage, eager or each
    replaying its own CUDA graphs (per-layer, or one full-iteration graph per schedule)."""
    steps = cfg.overlap.overlap_probe_steps
    _require(steps >= 0, "overlap_probe_steps", steps, "must be >= 0 (0: no probe)")
    if steps == 0:
        return
    _require(cfg.overlap.overlap_moe_expert_parallel_comm, "overlap_probe_steps", steps,
             "compares the overlap with the sequential schedule: needs "
             "--overlap-moe-expert-parallel-comm")
    impl = cfg.cuda_graph.impl
    _require(impl in ("none", "local", "full_iteration"), "overlap_probe_steps", steps,
             f"compares two schedules, each replaying its own graphs; --cuda-graph-impl {impl} "
             "is not built: use --cuda-graph-impl none, local or full_iteration")
    _require(cfg.parallel.pipeline_model_parallel_size == 1, "overlap_probe_steps", steps,
             "needs --pipeline-model-parallel-size 1 (one stage's plan is switched)")
    if impl == "none":
        needed, before = 2 * steps + 1, "the first step"
    else:  # the graphs' warm-up (the overlap's capture), one sequential step (its capture)
        needed = cfg.cuda_graph.warmup_steps + 1 + 2 * steps
        before = (f"{cfg.cuda_graph.warmup_steps} graph warm-up step(s), one sequential "
                  "step that captures its graphs")
    _require(cfg.train.train_iters >= needed, "overlap_probe_steps", steps,
             f"needs --train-iters >= {needed} ({before}, then {steps} of each schedule), "
             f"got --train-iters={cfg.train.train_iters}")


def _validate_nccl_ctas(cfg: RunConfig, cuda_available: bool) -> None:
    """The expert-parallel communicator's CTA budget: NCCL only, and only where it has
    all-to-alls to shape (EP > 1). Refused rather than ignored on gloo."""
    p = cfg.parallel
    given = [(name, getattr(p, name)) for name in ("moe_a2a_nccl_max_ctas",
                                                    "moe_a2a_nccl_min_ctas")
             if getattr(p, name) is not None]
    for name, value in given:
        _require(1 <= value <= NCCL_MAX_CHANNELS, name, value,
                 f"must be in [1, {NCCL_MAX_CHANNELS}] (NCCL's most CTAs per collective)")
        _require(cfg.resolved_device(cuda_available) == "cuda", name, value,
                 "sets the NCCL communicator of the expert-parallel group: this run is on "
                 "CPU, where the groups use gloo (no CTAs to budget)")
        _require(p.expert_model_parallel_size > 1, name, value,
                 "needs --expert-model-parallel-size > 1 (with EP 1 there is no all-to-all)")
        reason = nccl_config_unavailable()
        _require(reason is None, name, value, reason or "")
    carveout = p.moe_grouped_gemm_sm_carveout
    if carveout is not None:
        _require(1 <= carveout <= MAX_SM_CARVEOUT, "moe_grouped_gemm_sm_carveout", carveout,
                 f"must be in [1, {MAX_SM_CARVEOUT}] (SMs left free; the GPU's SM count "
                 "bounds it further at the first GEMM)")
        _require(cfg.resolved_device(cuda_available) == "cuda", "moe_grouped_gemm_sm_carveout",
                 carveout, "leaves SMs of a CUDA device free: this run is on CPU")
        _require(cfg.moe.enabled, "moe_grouped_gemm_sm_carveout", carveout,
                 "needs MoE layers (--num-experts): it applies to the experts' grouped GEMMs")
    if len(given) == 2:
        _require(p.moe_a2a_nccl_min_ctas <= p.moe_a2a_nccl_max_ctas, "moe_a2a_nccl_min_ctas",
                 p.moe_a2a_nccl_min_ctas,
                 f"must be <= --moe-a2a-nccl-max-ctas={p.moe_a2a_nccl_max_ctas}")


def nccl_config_unavailable() -> Optional[str]:
    """Why this torch build cannot configure an NCCL communicator's CTAs (None: it can).
    `ProcessGroupNCCL.Options().config` (an ncclConfig_t with max_ctas / min_ctas) exists in
    builds with NCCL >= 2.17, torch 2.1 onwards (2.11 and 2.13 included)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_nccl_available():
        return "this torch build has no NCCL"
    config = getattr(dist.ProcessGroupNCCL.Options(), "config", None)
    if config is None or not all(hasattr(config, f) for f in ("max_ctas", "min_ctas")):
        return ("this torch build's NCCL takes no communicator config (needs NCCL >= 2.17): "
                "set NCCL_MAX_CTAS / NCCL_MIN_CTAS in the environment instead (every group)")
    return None


def _validate_kernels_data_log(cfg: RunConfig, cuda_available: bool) -> None:
    backend = cfg.kernels.kernel_backend
    _require(backend in KERNEL_BACKENDS, "kernel_backend", backend,
             f"allowed: {', '.join(KERNEL_BACKENDS)}")
    device = cfg.resolved_device(cuda_available)
    if cfg.resolved_kernel_backend(device) == "triton":
        from epoverlap.kernels import triton_unavailable_reason
        reason = triton_unavailable_reason()
        _require(reason is None, "kernel_backend", backend, reason or "")
    _validate_data(cfg.data)
    _require(cfg.log.log_interval >= 1, "log_interval", cfg.log.log_interval, "must be >= 1")
    device = cfg.resolved_device(cuda_available)
    _validate_profile(cfg.log, device)
    if cfg.log.log_json is not None:
        _require_writable("log_json", cfg.log.log_json, directory=False)
    _validate_tensorboard(cfg.log)


def _validate_data(d: DataConfig) -> None:
    """Flag-level rules; the files themselves are checked by `training.data.open_data_source`."""
    given = [flag for flag, on in (("--data", d.data is not None),
                                   ("--data-path", bool(d.data_path)),
                                   ("--mock-data", d.mock_data)) if on]
    if len(given) > 1:
        raise ConfigError(given[1], True, f"give one data source; {given[0]} is given too")
    if d.data not in (None, "stdlib"):
        _require(Path(d.data).exists(), "data", d.data,
                 "no such file or folder (or use 'stdlib', --data-path or --mock-data)")
    if d.data_path:
        try:
            d.blend
        except ValueError as error:
            raise ConfigError("--data-path", d.data_path, str(error)) from None
        _require(d.tokenizer_type is not None, "data_path", d.data_path,
                 "needs --tokenizer-type (NullTokenizer with --vocab-size, or "
                 "HuggingFaceTokenizer with --tokenizer-model)")
    if d.split is not None:
        _require(bool(d.data_path), "split", d.split, "applies to --data-path datasets only")
        try:
            d.split_fractions
        except ValueError as error:
            raise ConfigError("--split", d.split, str(error)) from None
    _validate_tokenizer(d)


def _validate_tokenizer(d: DataConfig) -> None:
    kind = d.tokenizer_type
    if kind is not None:
        _require(kind in TOKENIZER_TYPES, "tokenizer_type", kind,
                 f"allowed: {', '.join(TOKENIZER_TYPES)}")
        _require(d.text_source is None, "tokenizer_type", kind, "--data reads raw bytes "
                 "(vocabulary 256); a tokenizer applies to --data-path and --mock-data")
    _require(d.vocab_size is None or kind == "NullTokenizer", "vocab_size", d.vocab_size,
             "only with --tokenizer-type NullTokenizer")
    _require(kind != "NullTokenizer" or (d.vocab_size or 0) >= 1, "vocab_size", d.vocab_size,
             "--tokenizer-type NullTokenizer needs --vocab-size >= 1")
    _require(d.tokenizer_model is None or kind == "HuggingFaceTokenizer", "tokenizer_model",
             d.tokenizer_model, "only with --tokenizer-type HuggingFaceTokenizer")
    _require(kind != "HuggingFaceTokenizer" or bool(d.tokenizer_model), "tokenizer_model",
             d.tokenizer_model, "--tokenizer-type HuggingFaceTokenizer needs a tokenizer.json "
             "or a folder holding one")


def _validate_tensorboard(log: LogConfig) -> None:
    if log.tensorboard_dir is None:
        return
    # the path first: the same answer whether or not the package is installed
    _require(_writable_dir(Path(log.tensorboard_dir)), "tensorboard_dir", log.tensorboard_dir,
             "not a writable directory (nor creatable)")
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError:
        raise ConfigError("--tensorboard-dir", log.tensorboard_dir, "needs the tensorboard "
                          "package: pip install 'epoverlap[tensorboard]'") from None


def _writable_dir(path: Path) -> bool:
    """True if `path` is a writable directory or could be created as one."""
    while not path.exists():
        if path.parent == path:
            return False
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _validate_checkpoint(c: CheckpointConfig) -> None:
    """Paths only; what --load holds is checked by training.checkpoint_files, also early."""
    for name in ("save", "load"):
        path = getattr(c, name)
        _require(path is None or (path.strip() != "" and not Path(path).is_file()), name, path,
                 "must name a folder (it is a file, or empty)")
    if c.save_interval is not None:
        _require(c.save_interval >= 1, "save_interval", c.save_interval, "must be >= 1")
        _require(c.save is not None, "save_interval", c.save_interval, "needs --save DIR")


def _validate_profile(log: LogConfig, device: str) -> None:
    if log.profile_steps is None:
        _require(log.profile_dir is None, "profile_dir", log.profile_dir,
                 "needs --profile-steps START:END")
        _require(not log.use_pytorch_profiler, "use_pytorch_profiler", True,
                 "needs --profile-steps START:END (the steps to trace)")
        return
    _require(log.profile_dir is None or not Path(log.profile_dir).is_file(), "profile_dir",
             log.profile_dir, "is a file; give a folder")
    try:
        start, end = log.profile_range
    except ValueError:
        raise ConfigError("--profile-steps", log.profile_steps,
                          "expected START:END step numbers, e.g. 3:5") from None
    _require(1 <= start <= end, "profile_steps", log.profile_steps,
             "needs 1 <= START <= END (steps count from 1)")
    _require(log.profile_dir is not None, "profile_steps", log.profile_steps,
             "needs --profile-dir DIR")
    _require_writable("profile_dir", log.profile_dir, directory=True)
    _require(not log.use_pytorch_profiler or device == "cuda", "use_pytorch_profiler", True,
             "needs a CUDA device: its traces are read for GPU kernels (epoverlap-timeline "
             "--torch-trace); on CPU the span files of --profile-steps show both lanes")


def _require_writable(field_name: str, path_text: str, directory: bool) -> None:
    """`path_text` is (or can be made) a directory we can write in, or a file we can write.

    Nothing is created: the nearest existing folder must take a new file (tried with a
    temporary file, so root, read-only mounts and /proc are judged as the run would be)."""
    path = Path(path_text)
    if path.exists() and path.is_dir() != directory:
        _require(False, field_name, path_text, "is a folder; give a file path" if not directory
                 else "is a file; give a folder (created if missing)")
    folder = path if directory else path.parent
    nearest = folder
    while not nearest.exists():
        nearest = nearest.parent
    _require(nearest.is_dir(), field_name, path_text, f"{nearest} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as error:
        raise ConfigError(flag_of(field_name), path_text,
                          f"cannot create a file in {nearest} ({error.strerror})") from None


def _validate_cuda_graphs(cfg: RunConfig, cuda_available: bool) -> None:
    pattern = cfg.moe_layer_pattern()
    pp = cfg.parallel.pipeline_model_parallel_size
    _require(cfg.cuda_graph.impl == "none" or pp == 1, "cuda_graph_impl", cfg.cuda_graph.impl,
             f"not built with --pipeline-model-parallel-size={pp} yet (graphs capture a "
             "one-stage plan); use --cuda-graph-impl none")
    try:
        import transformer_engine  # noqa: F401
        te_available = True
    except ImportError:
        te_available = False
    device = cfg.resolved_device(cuda_available)
    mode = DispatchMode.of(cfg.moe)
    validate_cuda_graph_config(
        cfg.cuda_graph,
        overlap_moe_expert_parallel_comm=cfg.overlap.overlap_moe_expert_parallel_comm,
        has_moe_layers=any(pattern), has_dense_layers=not all(pattern),
        preprocess_syncs_host=mode.preprocess_syncs_host(cfg.resolved_kernel_backend(device)),
        dispatch_syncs_host=mode.dispatch_syncs_host,
        transformer_engine_available=te_available, cuda_available=device == "cuda")


def validate_config(cfg: RunConfig, world_size: int, cuda_available: bool) -> None:
    """Check every rule; raise ConfigError naming the flag. Touches no process group."""
    _validate_finite(cfg)
    _validate_model(cfg.model)
    timeout = cfg.parallel.distributed_timeout_minutes
    _require(timeout >= MIN_TIMEOUT_MINUTES, "distributed_timeout_minutes", timeout,
             f"must be >= {MIN_TIMEOUT_MINUTES} (3 s): the liveness checks need a few "
             "heartbeats within it")
    _validate_pipeline(cfg, world_size)
    _validate_moe(cfg, world_size)
    _validate_train(cfg.train, cfg.data_parallel_size(world_size), cuda_available)
    _validate_microbatches(cfg, world_size)
    _validate_overlap(cfg, cuda_available)
    _validate_nccl_ctas(cfg, cuda_available)
    _validate_kernels_data_log(cfg, cuda_available)
    _validate_checkpoint(cfg.checkpoint)
    _validate_cuda_graphs(cfg, cuda_available)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
