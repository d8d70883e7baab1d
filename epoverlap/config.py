"""The one configuration module: every default, every CLI flag, every cross-field rule.

Owns the config dataclasses (one per concern, orthogonal fields), the argparse surface with the
flag names Megatron users type, the named presets, and `validate_config`, which checks every
rule and raises `ConfigError` naming the flag, the value and what is allowed. Validation needs
only the world size, whether CUDA is present and the file system (output paths must be
writable: tried with a temporary file, nothing is created), so a bad invocation exits before
any process group work. The memory estimate, which needs the device's size, is
training/memory.py's. The CUDA-graph surface (with its deprecated forms) lives in
`graphs/config.py` and is validated from here; flags renamed to Megatron-core's spelling keep
their old one as a deprecated alias (`RENAMED_FLAGS`), migrated the same way.

The parser (`CliParser`) has no prefix matching, a one-line usage, each flag's default in
--help and, at its end, what each preset sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from epoverlap.graphs.config import (CudaGraphConfig, add_cuda_graph_args,
                                cuda_graph_config_from_args, validate_cuda_graph_config)
from epoverlap.errors import ConfigError, alias_conflict, deprecation_note

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = ("fp32", "fp64")
KERNEL_BACKENDS = ("auto", "torch", "triton")
DEVICES = ("auto", "cpu", "cuda")
OVERLAP_PLANS = ("combined_1f1b", "combined_1f1b_early_release")
COMM_MODES = ("real", "local_copy")
MIN_TIMEOUT_MINUTES = 0.05


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 128
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    seq_length: int = 128
    vocab_size: int = 256
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

    @property
    def enabled(self) -> bool:
        return bool(self.num_experts)


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    expert_model_parallel_size: int = 1
    distributed_timeout_minutes: float = 10.0


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    micro_batch_size: int = 2
    num_microbatches: int = 4
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
    deterministic: bool = False
    device: str = "auto"
    skip_optimizer_step: bool = False


@dataclass(kw_only=True, frozen=True)
class OverlapConfig:
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    overlap_plan: str = "combined_1f1b"
    comm_stream_high_priority: bool = True
    comm_mode: str = "real"


@dataclass(kw_only=True, frozen=True)
class KernelConfig:
    kernel_backend: str = "auto"


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    data: str = "stdlib"


@dataclass(kw_only=True, frozen=True)
class LogConfig:
    log_interval: int = 1
    log_json: Optional[str] = None
    profile_steps: Optional[str] = None
    profile_dir: Optional[str] = None
    profile_torch: bool = False

    @property
    def profile_range(self) -> Optional[tuple[int, int]]:
        if not self.profile_steps:
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
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)

    def moe_layer_pattern(self) -> list[bool]:
        """For each layer: True if it is an MoE layer."""
        return moe_layer_pattern(self.model.num_layers, self.moe)

    def resolved_device(self, cuda_available: bool) -> str:
        if self.train.device == "auto":
            return "cuda" if cuda_available else "cpu"
        return self.train.device

    def resolved_kernel_backend(self, device: str) -> str:
        if self.kernels.kernel_backend == "auto":
            return "triton" if device == "cuda" else "torch"
        return self.kernels.kernel_backend

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
                  moe_aux_loss_coeff=1e-2, micro_batch_size=4, num_microbatches=4, train_iters=50, lr=1e-3, min_lr=1e-4,
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
    ("--expert-model-parallel-size", "parallel", "expert_model_parallel_size", int,
     "EP size: experts are sharded over EP ranks and replicated over world/EP (EDP) ranks; "
     "dense layers are data-parallel over the whole world"),
    ("--distributed-timeout-minutes", "parallel", "distributed_timeout_minutes", float,
     "collective timeout of every process group: a peer rank that does not answer for this "
     "long ends the job, naming it (fractions allowed, >= 0.05)"),
    ("--micro-batch-size", "train", "micro_batch_size", int, "sequences per microbatch"),
    ("--num-microbatches", "train", "num_microbatches", int, "microbatches per step"),
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
    ("--deterministic", "train", "deterministic", bool, "deterministic algorithms"),
    ("--device", "train", "device", str, f"one of {DEVICES}"),
    ("--skip-optimizer-step", "train", "skip_optimizer_step", bool,
     "benchmark only: forward+backward+grad reduce, no update"),
    ("--overlap-moe-expert-parallel-comm", "overlap", "overlap_moe_expert_parallel_comm", bool,
     "combined 1F1B schedule hiding EP all-to-all"),
    ("--delay-wgrad-compute", "overlap", "delay_wgrad_compute", bool,
     "split weight grads out and run them in the comm gaps"),
    ("--overlap-plan", "overlap", "overlap_plan", str, f"one of {OVERLAP_PLANS}"),
    ("--comm-mode", "overlap", "comm_mode", str,
     f"benchmark only: {COMM_MODES} (local_copy replaces all-to-alls by local copies)"),
    ("--kernel-backend", "kernels", "kernel_backend", str, f"one of {KERNEL_BACKENDS}"),
    ("--data", "data", "data", str,
     "text file or folder (byte tokens), 'stdlib' (Python's own sources) or 'synthetic'"),
    ("--log-interval", "log", "log_interval", int, "steps between log lines"),
    ("--log-json", "log", "log_json", str, "write one JSON record per step here"),
    ("--profile-steps", "log", "profile_steps", str, "START:END steps to record spans for"),
    ("--profile-dir", "log", "profile_dir", str, "where span files go"),
    ("--profile-torch", "log", "profile_torch", bool, "also capture torch.profiler traces"),
]
_FLAG_OF_FIELD = {name: flag for flag, _, name, _, _ in _FLAGS}
_SECTIONS = {"model": ModelConfig, "moe": MoEConfig, "parallel": ParallelConfig,
             "train": TrainConfig, "overlap": OverlapConfig, "kernels": KernelConfig,
             "data": DataConfig, "log": LogConfig}
# Flags renamed to Megatron-core's spelling: (old flag, field). The old spelling stays a
# deprecated alias, migrated as the CUDA-graph forms are (errors.deprecation_note/alias_conflict).
RENAMED_FLAGS: tuple[tuple[str, str], ...] = (
    ("--dist-timeout-minutes", "distributed_timeout_minutes"),
)
USAGE = "%(prog)s [--preset NAME] [FLAG VALUE ...]   (--help lists every flag)"


def flag_of(field_name: str) -> str:
    """The CLI flag for a config field name (for error messages)."""
    return _FLAG_OF_FIELD.get(field_name, "--" + field_name.replace("_", "-"))


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
        else:
            parser.add_argument(flag, dest=name, type=kind, default=None, help=help_text)
    for old, name in RENAMED_FLAGS:
        kind = next(k for f, _, n, k, _ in _FLAGS if n == name)
        parser.add_argument(old, dest=_old_dest(old), type=kind, default=None,
                            help=f"deprecated: use {flag_of(name)}")
    add_cuda_graph_args(parser)
    return parser


def _old_dest(old_flag: str) -> str:
    return "deprecated_" + old_flag[2:].replace("-", "_")


def _migrate_renamed(args: argparse.Namespace, explicit: dict, notes: list[str]) -> None:
    """Fold the deprecated spellings of RENAMED_FLAGS into `explicit` (field -> value)."""
    for old, name in RENAMED_FLAGS:
        old_value = getattr(args, _old_dest(old), None)
        if old_value is None:
            continue
        new = flag_of(name)
        if name in explicit and explicit[name] != old_value:
            raise alias_conflict(old, old_value, new, f"{new} {explicit[name]}")
        notes.append(deprecation_note(old, new))
        explicit[name] = old_value


def config_from_args(args: argparse.Namespace,
                     warn: Callable[[str], None] = lambda msg: None) -> RunConfig:
    """Defaults <- preset <- explicit flags. No validation here (see validate_config).

    Deprecation notes go to `warn` (one line each) once the whole command line is parsed."""
    notes: list[str] = []
    explicit = {name: getattr(args, name) for _, _, name, _, _ in _FLAGS
                if getattr(args, name) is not None}
    _migrate_renamed(args, explicit, notes)
    values = dict(PRESETS[args.preset]) if args.preset else {}
    values.update(explicit)
    sections: dict[str, dict] = {}
    for _, section, name, _, _ in _FLAGS:
        if name in values:
            sections.setdefault(section, {})[name] = values[name]
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


def _validate_model(m: ModelConfig) -> None:
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "vocab_size"):
        _require(getattr(m, name) >= 1, name, getattr(m, name), "must be >= 1")
    _require(m.seq_length >= 2, "seq_length", m.seq_length, "must be >= 2")
    _require(m.hidden_size % m.num_attention_heads == 0, "num_attention_heads",
             m.num_attention_heads, f"must divide --hidden-size={m.hidden_size}")
    _require(m.head_dim % 2 == 0, "hidden_size", m.hidden_size,
             f"head dim hidden/heads={m.head_dim} must be even (rotary embeddings)")
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
    _require(moe.moe_aux_loss_coeff >= 0, "moe_aux_loss_coeff", moe.moe_aux_loss_coeff,
             "must be >= 0")
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


def _validate_moe(cfg: RunConfig, world_size: int) -> None:
    moe, ep = cfg.moe, cfg.parallel.expert_model_parallel_size
    _require(ep >= 1 and world_size % ep == 0, "expert_model_parallel_size", ep,
             f"must divide the world size {world_size}")
    if not moe.enabled:
        _require(ep == 1, "expert_model_parallel_size", ep, "must be 1 without --num-experts")
        return
    _require(moe.num_experts >= 1 and moe.num_experts % ep == 0, "num_experts", moe.num_experts,
             f"must be divisible by --expert-model-parallel-size={ep}")
    _validate_router(moe)
    _validate_layer_pattern(cfg.model.num_layers, moe)
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(moe, name)
        _require(value is None or value >= 1, name, value, "must be >= 1")


def _validate_train(t: TrainConfig, cuda_available: bool) -> None:
    for name in ("micro_batch_size", "num_microbatches", "train_iters"):
        _require(getattr(t, name) >= 1, name, getattr(t, name), "must be >= 1")
    _require(t.lr > 0, "lr", t.lr, "must be > 0")
    _require(0 <= t.min_lr <= t.lr, "min_lr", t.min_lr, f"must be in [0, --lr={t.lr}]")
    _require(t.lr_warmup_iters >= 0, "lr_warmup_iters", t.lr_warmup_iters, "must be >= 0")
    _require(t.clip_grad >= 0, "clip_grad", t.clip_grad, "must be >= 0 (0 disables clipping)")
    _require(t.device in DEVICES, "device", t.device, f"allowed: {', '.join(DEVICES)}")
    _require(t.device != "cuda" or cuda_available, "device", t.device,
             "no CUDA device is visible here; use --device cpu or auto")
    on_gpu = t.device == "cuda" or (t.device == "auto" and cuda_available)
    _require(not t.bf16 or on_gpu, "bf16", True, "needs a CUDA device (CPU runs are fp32)")


def _validate_overlap(cfg: RunConfig) -> None:
    o = cfg.overlap
    _require(o.overlap_plan in OVERLAP_PLANS, "overlap_plan", o.overlap_plan,
             f"allowed: {', '.join(OVERLAP_PLANS)}")
    _require(o.comm_mode in COMM_MODES, "comm_mode", o.comm_mode,
             f"allowed: {', '.join(COMM_MODES)}")
    if o.overlap_moe_expert_parallel_comm:
        _require(cfg.parallel.expert_model_parallel_size > 1, "overlap_moe_expert_parallel_comm",
                 True, "requires --expert-model-parallel-size > 1 (there is no all-to-all "
                 "to hide with EP=1)")
        _require(any(cfg.moe_layer_pattern()), "overlap_moe_expert_parallel_comm", True,
                 "requires at least one MoE layer (--num-experts, --moe-layer-freq)")
    _require(not o.delay_wgrad_compute or o.overlap_moe_expert_parallel_comm,
             "delay_wgrad_compute", True, "requires --overlap-moe-expert-parallel-comm")


def _validate_kernels_data_log(cfg: RunConfig, cuda_available: bool) -> None:
    backend = cfg.kernels.kernel_backend
    _require(backend in KERNEL_BACKENDS, "kernel_backend", backend,
             f"allowed: {', '.join(KERNEL_BACKENDS)}")
    device = cfg.resolved_device(cuda_available)
    if cfg.resolved_kernel_backend(device) == "triton":
        from epoverlap_kernels import triton_unavailable_reason
        reason = triton_unavailable_reason()
        _require(reason is None, "kernel_backend", backend, reason or "")
    data = cfg.data.data
    if data not in ("stdlib", "synthetic"):
        _require(Path(data).exists(), "data", data,
                 "no such file or folder (or use 'stdlib' / 'synthetic')")
    _require(cfg.log.log_interval >= 1, "log_interval", cfg.log.log_interval, "must be >= 1")
    _validate_profile(cfg.log, device)
    if cfg.log.log_json is not None:
        _require_writable("log_json", cfg.log.log_json, directory=False)


def _validate_profile(log: LogConfig, device: str) -> None:
    if log.profile_steps is None:
        _require(log.profile_dir is None, "profile_dir", log.profile_dir,
                 "needs --profile-steps START:END")
        _require(not log.profile_torch, "profile_torch", True,
                 "needs --profile-steps START:END (the steps to trace)")
        return
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
    _require(not log.profile_torch or device == "cuda", "profile_torch", True,
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


def _validate_cuda_graphs(cfg: RunConfig) -> None:
    pattern = cfg.moe_layer_pattern()
    try:
        import transformer_engine  # noqa: F401
        te_available = True
    except ImportError:
        te_available = False
    validate_cuda_graph_config(
        cfg.cuda_graph,
        overlap_moe_expert_parallel_comm=cfg.overlap.overlap_moe_expert_parallel_comm,
        has_moe_layers=any(pattern), has_dense_layers=not all(pattern),
        preprocess_syncs_host=False, transformer_engine_available=te_available,
        capture_implemented=False)


def validate_config(cfg: RunConfig, world_size: int, cuda_available: bool) -> None:
    """Check every rule; raise ConfigError naming the flag. Touches no process group."""
    _validate_model(cfg.model)
    timeout = cfg.parallel.distributed_timeout_minutes
    _require(timeout >= MIN_TIMEOUT_MINUTES, "distributed_timeout_minutes", timeout,
             f"must be >= {MIN_TIMEOUT_MINUTES} (3 s): the liveness checks need a few "
             "heartbeats within it")
    _validate_moe(cfg, world_size)
    _validate_train(cfg.train, cuda_available)
    _validate_overlap(cfg)
    _validate_kernels_data_log(cfg, cuda_available)
    _validate_cuda_graphs(cfg)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
