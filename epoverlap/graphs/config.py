"""CUDA-graph configuration: the command-line flags, migration of deprecated forms, validation.

This module owns the user-facing CUDA-graph surface and nothing else: `CudaGraphConfig`, the
flags that fill it (`add_cuda_graph_args`), the migration of the deprecated flags users of
Megatron-LM still type (`cuda_graph_config_from_args`), and every cross-field rule
(`validate_cuda_graph_config`). Capture lives beside it (`epoverlap.graphs.capture`): the
`local` impl of the per-layer modules; `transformer_engine` and `full_iteration` are refused
with a line saying so.

Fields (the split of the old overloaded `cuda_graph_scope`, Megatron-LM PR #4292):
- impl: none | local | transformer_engine | full_iteration.
- modules: per-layer capture regions, attn mlp moe moe_router moe_preprocess mamba;
  empty = whole layer. Dense layers check attn/mlp, MoE layers check attn/moe*.
- inference_scope: none | layer | block; kept for compatibility (we train). Default: layer with the
  local impl, none otherwise.
- warmup_steps: eager iterations before capture (default 3; at least 1 with a capturing impl:
  the last one records what each graph reads and writes).
- check_inputs: every replay checks its inputs' shapes, dtypes and devices (debug).

Deprecated forms, still accepted, each migrated with one warning line `deprecated: old -> new`
(the formats and the boolean flags' migration are `epoverlap.flag_aliases`, shared with every
other renamed flag):

  | old                                         | new                                              |
  | ------------------------------------------- | ------------------------------------------------ |
  | --enable-cuda-graph                         | --cuda-graph-impl local                          |
  | --external-cuda-graph                       | --cuda-graph-impl transformer_engine             |
  | --cuda-graph-scope full_iteration           | --cuda-graph-impl full_iteration                 |
  | --cuda-graph-scope full_iteration_inference | --cuda-graph-impl local                          |
  |                                             |   --inference-cuda-graph-scope block             |
  | --cuda-graph-scope attn mlp                 | --cuda-graph-modules attn mlp                    |

An old form given together with a new flag is accepted when both say the same thing (for example
`--enable-cuda-graph --cuda-graph-impl local`, or the old idiom `--cuda-graph-impl local
--cuda-graph-scope full_iteration`) and rejected when they disagree; the error names the
deprecated flag, the one to drop. Every rejection is a `ConfigError` naming the flag as typed,
the value and what is allowed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

from epoverlap.errors import ConfigError
from epoverlap.flag_aliases import FlagAlias, alias_conflict, apply_aliases, deprecation_note

CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
INFERENCE_SCOPES = ("none", "layer", "block")

# Impls epoverlap can capture with (`epoverlap.graphs`); the others are refused.
IMPLEMENTED_IMPLS = ("none", "local", "full_iteration")
# Impls that capture per-layer regions (the ones that read `modules`).
PER_LAYER_IMPLS = ("local", "transformer_engine")
# The regions that stay clear of the all-to-all when the EP overlap splits the MoE layer.
EP_OVERLAP_MODULES = ("attn", "moe_router", "moe_preprocess")
# Regions that contain the dispatcher's preprocess (which may copy device-to-host).
MODULES_WITH_MOE_PREPROCESS = ("moe", "moe_preprocess")
# (module, the layer kind that has it): a module no layer of the model has is rejected.
MODULE_LAYER_KINDS = (
    ("attn", ("dense", "moe")),
    ("mlp", ("dense",)),
    ("moe", ("moe",)),
    ("moe_router", ("moe",)),
    ("moe_preprocess", ("moe",)),
    ("mamba", ("mamba",)),
)
# (impl, inference scopes it accepts), as in the reference's ALLOWED_INFERENCE_SCOPES.
INFERENCE_SCOPES_BY_IMPL = (
    ("none", ("none",)),
    ("local", ("layer", "block")),
    ("transformer_engine", ("none",)),
    ("full_iteration", ("none",)),
)
# Deprecated boolean flags and the impl each stands for (migrated by `flag_aliases`).
DEPRECATED_IMPL_FLAGS = (
    FlagAlias("--enable-cuda-graph", "--cuda-graph-impl", "local"),
    FlagAlias("--external-cuda-graph", "--cuda-graph-impl", "transformer_engine"),
)


class DeprecatedScopeValue(NamedTuple):
    """A `--cuda-graph-scope` value that is not a module name."""

    value: str
    impl: str  # the impl it migrates to
    compatible_impls: tuple[str, ...]  # explicit impls it may be combined with (old idioms)
    inference_scope: Optional[str]  # the inference scope it migrates to, None: leaves it alone

    def new_flags(self) -> str:
        if self.inference_scope is None:
            return f"--cuda-graph-impl {self.impl}"
        return f"--cuda-graph-impl {self.impl} --inference-cuda-graph-scope {self.inference_scope}"


DEPRECATED_SCOPE_VALUES = (
    DeprecatedScopeValue("full_iteration", "full_iteration", ("local", "full_iteration"), None),
    DeprecatedScopeValue("full_iteration_inference", "local", ("local",), "block"),
)


@dataclass(kw_only=True, frozen=True)
class CudaGraphConfig:
    """What to capture. Each field is checked on its own here; cross-field rules live in
    `validate_cuda_graph_config`. Note: the inference-scope default rule (local -> layer) is applied
    by `cuda_graph_config_from_args`; a config built directly with impl="local" must set it."""

    impl: str = "none"
    modules: tuple[str, ...] = ()  # empty = whole layer
    warmup_steps: int = 3
    inference_scope: str = "none"
    check_inputs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.modules, str):
            raise ConfigError("--cuda-graph-modules", self.modules, "a sequence of module names")
        object.__setattr__(self, "modules", tuple(self.modules))
        _check_choice("--cuda-graph-impl", self.impl, CUDA_GRAPH_IMPLS)
        _check_choice("--inference-cuda-graph-scope", self.inference_scope, INFERENCE_SCOPES)
        _check_names("--cuda-graph-modules", self.modules, CUDA_GRAPH_MODULES)
        if len(set(self.modules)) != len(self.modules):
            raise ConfigError("--cuda-graph-modules", self.modules, "each module at most once")
        _check_warmup_steps(self.warmup_steps)


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def add_cuda_graph_args(parser: argparse.ArgumentParser) -> None:
    """Register the CUDA-graph flags. Every default is None/False so that "not given" is visible;
    values are checked by `cuda_graph_config_from_args` (ConfigError), not by argparse choices."""
    group = parser.add_argument_group("CUDA graphs", "Per-layer graphs of the pre-dispatch "
                                      "segments (--cuda-graph-impl local), GPU only.")
    group.add_argument("--cuda-graph-impl", default=None, metavar="IMPL",
                       help=f"one of: {' '.join(CUDA_GRAPH_IMPLS)} (default: none)")
    group.add_argument("--cuda-graph-modules", nargs="*", default=None, metavar="MODULE",
                       help=f"per-layer capture regions, any of: {' '.join(CUDA_GRAPH_MODULES)}; "
                            "none listed = whole layer")
    group.add_argument("--cuda-graph-warmup-steps", type=int, default=None, metavar="N",
                       help="eager iterations before capture (default: 3)")
    group.add_argument("--cuda-graph-check-inputs", action="store_true",
                       help="debug: each replay checks its inputs' shapes, dtypes and devices "
                            "and names the layer, microbatch and phase that differ")
    group.add_argument("--inference-cuda-graph-scope", default=None, metavar="SCOPE",
                       help=f"one of: {' '.join(INFERENCE_SCOPES)} "
                            "(default: layer with --cuda-graph-impl local, else none)")
    group.add_argument("--enable-cuda-graph", action="store_true",
                       help="deprecated: use --cuda-graph-impl local")
    group.add_argument("--external-cuda-graph", action="store_true",
                       help="deprecated: use --cuda-graph-impl transformer_engine")
    group.add_argument("--cuda-graph-scope", nargs="+", default=None, metavar="SCOPE",
                       help="deprecated: use --cuda-graph-impl full_iteration, "
                            "--inference-cuda-graph-scope block, or --cuda-graph-modules")


# ---------------------------------------------------------------------------------------------
# Parsing and migration
# ---------------------------------------------------------------------------------------------


class _ImplSource(NamedTuple):
    impl: str
    flags: str  # how the user asked for it, e.g. "--enable-cuda-graph" or "--cuda-graph-impl local"


class _OldScope(NamedTuple):
    """`--cuda-graph-scope` split into its non-module value and its module names."""

    value: Optional[DeprecatedScopeValue]
    typed_modules: tuple[str, ...]  # module names as typed (commas split), for the warning
    modules: Optional[tuple[str, ...]]  # deduplicated; None when it named no module


def cuda_graph_config_from_args(args: argparse.Namespace, warn: Callable[[str], None]
                                ) -> CudaGraphConfig:
    """Build the config from flags registered by `add_cuda_graph_args`, migrating deprecated forms.

    Warnings are collected and emitted (one `warn` call per deprecated form) only once the whole
    input is accepted, so a rejected command line prints just its error.
    """
    notes: list[str] = []
    old_scope = _split_old_scope(args.cuda_graph_scope)
    impl = _resolve_impl(args, old_scope.value, notes)
    modules = _resolve_modules(args.cuda_graph_modules, old_scope, notes)
    inference_scope = _resolve_inference_scope(args.inference_cuda_graph_scope, old_scope.value,
                                               impl)
    warmup = args.cuda_graph_warmup_steps
    given = {} if warmup is None else {"warmup_steps": warmup}
    config = CudaGraphConfig(impl=impl, modules=modules, inference_scope=inference_scope,
                             check_inputs=bool(args.cuda_graph_check_inputs), **given)
    for note in notes:
        warn(note)
    return config


def _split_old_scope(raw: Optional[Sequence[str]]) -> _OldScope:
    if raw is None:
        return _OldScope(None, (), None)
    tokens = _split_names(raw)
    old_values = tuple(row.value for row in DEPRECATED_SCOPE_VALUES)
    _check_names("--cuda-graph-scope", tokens, old_values + CUDA_GRAPH_MODULES)
    values = _dedupe(t for t in tokens if t in old_values)
    typed_modules = tuple(t for t in tokens if t not in old_values)
    if len(values) > 1:
        raise ConfigError("--cuda-graph-scope", tokens, f"at most one of {' '.join(old_values)}")
    value = _lookup_scope_value(values[0]) if values else None
    if value is not None and value.impl not in PER_LAYER_IMPLS and typed_modules:
        raise ConfigError("--cuda-graph-scope", tokens,
                          f"{value.value} takes no module names: use {value.new_flags()} alone, "
                          "or --cuda-graph-modules with a per-layer impl")
    return _OldScope(value, typed_modules, _dedupe(typed_modules) if typed_modules else None)


def _resolve_impl(args: argparse.Namespace, old_value: Optional[DeprecatedScopeValue],
                  notes: list[str]) -> str:
    base = _impl_from_impl_flags(args, notes)
    if old_value is None:
        return base.impl if base else "none"
    if base is not None and base.impl not in old_value.compatible_impls:
        raise alias_conflict("--cuda-graph-scope", old_value.value, old_value.new_flags(),
                             base.flags)
    notes.append(deprecation_note(f"--cuda-graph-scope {old_value.value}", old_value.new_flags()))
    return old_value.impl


def _impl_from_impl_flags(args: argparse.Namespace, notes: list[str]) -> Optional[_ImplSource]:
    """The impl asked for by --cuda-graph-impl or a deprecated boolean flag; None if neither."""
    explicit = args.cuda_graph_impl
    if explicit is not None:
        _check_choice("--cuda-graph-impl", explicit, CUDA_GRAPH_IMPLS)
    old = [alias.old for alias in DEPRECATED_IMPL_FLAGS if getattr(args, _dest(alias.old))]
    if len(old) > 1:
        raise ConfigError(old[1], True, f"cannot be combined with {old[0]}; "
                          "pass one --cuda-graph-impl value instead")
    impl = apply_aliases(vars(args), DEPRECATED_IMPL_FLAGS, _dest, notes)["cuda_graph_impl"]
    if impl is None:
        return None
    return _ImplSource(impl, old[0] if old else f"--cuda-graph-impl {impl}")


def _resolve_modules(raw_new: Optional[Sequence[str]], old_scope: _OldScope,
                     notes: list[str]) -> tuple[str, ...]:
    new = None if raw_new is None else _normalize_modules(raw_new)
    if old_scope.modules is None:
        return new if new is not None else ()
    old = old_scope.modules
    if new is not None and set(new) != set(old):
        raise alias_conflict("--cuda-graph-scope", old_scope.typed_modules,
                             f"--cuda-graph-modules {' '.join(old)}",
                             f"--cuda-graph-modules {' '.join(new) or '(empty)'}")
    notes.append(deprecation_note(f"--cuda-graph-scope {' '.join(old_scope.typed_modules)}",
                                  f"--cuda-graph-modules {' '.join(old)}"))
    return new if new is not None else old


def _normalize_modules(raw: Sequence[str]) -> tuple[str, ...]:
    """Split commas, reject unknown names, drop repeats keeping the first occurrence."""
    names = _split_names(raw)
    _check_names("--cuda-graph-modules", names, CUDA_GRAPH_MODULES)
    return _dedupe(names)


def _resolve_inference_scope(explicit: Optional[str], old_value: Optional[DeprecatedScopeValue],
                             impl: str) -> str:
    if explicit is not None:
        _check_choice("--inference-cuda-graph-scope", explicit, INFERENCE_SCOPES)
    implied = old_value.inference_scope if old_value else None
    if implied is not None:
        if explicit not in (None, implied):
            raise alias_conflict("--cuda-graph-scope", old_value.value, old_value.new_flags(),
                                 f"--inference-cuda-graph-scope {explicit}")
        return implied
    if explicit is not None:
        return explicit
    return "layer" if impl == "local" else "none"


# ---------------------------------------------------------------------------------------------
# Cross-field validation: one function per rule, checked in the order of VALIDATION_RULES.
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class _ModelFacts:
    """What the rules need to know about the model and the runtime."""

    overlap_moe_expert_parallel_comm: bool
    has_moe_layers: bool
    has_dense_layers: bool
    preprocess_syncs_host: bool
    dispatch_syncs_host: bool
    transformer_engine_available: bool
    cuda_available: bool
    implemented_impls: tuple[str, ...]

    def layer_kinds(self) -> tuple[str, ...]:
        return ("dense",) * self.has_dense_layers + ("moe",) * self.has_moe_layers


def validate_cuda_graph_config(cfg: CudaGraphConfig, *, overlap_moe_expert_parallel_comm: bool,
                               has_moe_layers: bool, has_dense_layers: bool,
                               preprocess_syncs_host: bool, dispatch_syncs_host: bool,
                               transformer_engine_available: bool, cuda_available: bool,
                               implemented_impls: Sequence[str] = IMPLEMENTED_IMPLS) -> None:
    """Check every cross-field rule; raise ConfigError for the first one broken.

    Not checked here (this signature carries no facts for them; the runtime's config module owns
    them once capture exists): graph-safe RNG, no NaN-check sync in the loss path with
    full_iteration, full activation recompute only with full_iteration.
    """
    facts = _ModelFacts(
        overlap_moe_expert_parallel_comm=overlap_moe_expert_parallel_comm,
        has_moe_layers=has_moe_layers,
        has_dense_layers=has_dense_layers,
        preprocess_syncs_host=preprocess_syncs_host,
        dispatch_syncs_host=dispatch_syncs_host,
        transformer_engine_available=transformer_engine_available,
        cuda_available=cuda_available,
        implemented_impls=tuple(implemented_impls),
    )
    for rule in VALIDATION_RULES:
        rule(cfg, facts)


def _modules_need_a_per_layer_impl(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if cfg.impl == "none" and cfg.modules:
        raise ConfigError("--cuda-graph-modules", cfg.modules, "needs --cuda-graph-impl local or "
                          "transformer_engine; with --cuda-graph-impl none nothing is captured")


def _full_iteration_takes_no_modules(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if cfg.impl == "full_iteration" and cfg.modules:
        raise ConfigError("--cuda-graph-modules", cfg.modules, "must be empty with "
                          "--cuda-graph-impl full_iteration (one graph covers the whole iteration)")


def _inference_scope_fits_impl(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    allowed = dict(INFERENCE_SCOPES_BY_IMPL)[cfg.impl]
    if cfg.inference_scope not in allowed:
        raise ConfigError("--inference-cuda-graph-scope", cfg.inference_scope,
                          f"with --cuda-graph-impl {cfg.impl} one of: {' '.join(allowed)}")


def _transformer_engine_is_importable(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if cfg.impl == "transformer_engine" and not facts.transformer_engine_available:
        raise ConfigError("--cuda-graph-impl", cfg.impl, "Transformer Engine is not importable; "
                          "install transformer_engine[pytorch] or use --cuda-graph-impl local")


def _no_mamba(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if "mamba" in cfg.modules:
        raise ConfigError("--cuda-graph-modules", cfg.modules, "mamba is not applicable: epoverlap "
                          "models have no Mamba layers; use attn mlp moe moe_router moe_preprocess")


def _modules_exist_in_model(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    present = facts.layer_kinds()
    for module, kinds in MODULE_LAYER_KINDS:
        if module in cfg.modules and not set(kinds) & set(present):
            raise ConfigError("--cuda-graph-modules", cfg.modules, f"{module} needs "
                              f"{' or '.join(kinds)} layers, which this model does not have")


def _moe_preprocess_needs_moe_router(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if "moe_preprocess" in cfg.modules and "moe_router" not in cfg.modules:
        raise ConfigError("--cuda-graph-modules", cfg.modules,
                          "moe_preprocess extends the moe_router graph: list moe_router too")


def _moe_excludes_moe_router(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if "moe" in cfg.modules and "moe_router" in cfg.modules:
        raise ConfigError("--cuda-graph-modules", cfg.modules, "moe (the whole MoE layer) and "
                          "moe_router (its first part) are mutually exclusive: list one")


def _full_iteration_needs_sync_free_dispatch(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if cfg.impl == "full_iteration" and facts.has_moe_layers and facts.dispatch_syncs_host:
        raise ConfigError("--cuda-graph-impl", cfg.impl, "one graph over the iteration would "
                          "hold the all-to-alls, whose split sizes this dispatch reads on the "
                          "host; use a sync-free dispatch: --moe-dispatch-budget FACTOR, or "
                          "--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity")


def _ep_overlap_needs_partial_graphs(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if facts.overlap_moe_expert_parallel_comm and cfg.impl in PER_LAYER_IMPLS and not cfg.modules:
        raise ConfigError("--cuda-graph-modules", cfg.modules, "a whole-layer graph would capture "
                          "the all-to-all of the EP overlap (overlap_moe_expert_parallel_comm); "
                          f"list some of: {' '.join(EP_OVERLAP_MODULES)}")


def _ep_overlap_allows_pre_dispatch_modules(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    outside = [m for m in cfg.modules if m not in EP_OVERLAP_MODULES]
    if facts.overlap_moe_expert_parallel_comm and cfg.impl in PER_LAYER_IMPLS and outside:
        raise ConfigError("--cuda-graph-modules", cfg.modules, f"{' '.join(outside)} cannot be "
                          "graphed with the EP overlap (overlap_moe_expert_parallel_comm); "
                          f"allowed: {' '.join(EP_OVERLAP_MODULES)}")


def _host_syncing_preprocess_stays_eager(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if cfg.impl == "none" or not facts.has_moe_layers or not facts.preprocess_syncs_host:
        return
    why = ("the torch reference permute copies device-to-host in preprocess (and the unpermute "
           "in combine), which cannot be captured; use --kernel-backend triton, or graph up to "
           "moe_router (e.g. attn moe_router)")
    if cfg.impl == "full_iteration":
        raise ConfigError("--cuda-graph-impl", cfg.impl, why)
    if not cfg.modules or set(cfg.modules) & set(MODULES_WITH_MOE_PREPROCESS):
        raise ConfigError("--cuda-graph-modules", cfg.modules, why)


def _whole_moe_layer_needs_sync_free_dispatch(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if cfg.impl not in PER_LAYER_IMPLS or not facts.has_moe_layers or not facts.dispatch_syncs_host:
        return
    if not cfg.modules or "moe" in cfg.modules:
        raise ConfigError("--cuda-graph-modules", cfg.modules, "a graph of the whole MoE layer "
                          "would hold the all-to-all, whose split sizes this dispatch reads on "
                          "the host; list the pre-dispatch regions (attn moe_router "
                          "moe_preprocess) or use a sync-free dispatch: --moe-dispatch-budget, or "
                          "--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity")


def _graphs_need_cuda(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if cfg.impl != "none" and not facts.cuda_available:
        raise ConfigError("--cuda-graph-impl", cfg.impl, "CUDA graphs need a CUDA device; this "
                          "run is on the CPU: use --cuda-graph-impl none")


def _impl_is_implemented(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if cfg.impl not in facts.implemented_impls:
        raise ConfigError("--cuda-graph-impl", cfg.impl, "not implemented in epoverlap: use "
                          "--cuda-graph-impl local (our own capture of the same modules)")


def _capture_needs_a_recorded_warmup_step(cfg: CudaGraphConfig, facts: _ModelFacts) -> None:
    if cfg.impl != "none" and cfg.warmup_steps < 1:
        raise ConfigError("--cuda-graph-warmup-steps", cfg.warmup_steps, "at least 1 with "
                          f"--cuda-graph-impl {cfg.impl}: the last eager step records what each "
                          "graph reads and writes")


VALIDATION_RULES = (
    _modules_need_a_per_layer_impl,
    _full_iteration_takes_no_modules,
    _inference_scope_fits_impl,
    _transformer_engine_is_importable,
    _no_mamba,
    _modules_exist_in_model,
    _moe_preprocess_needs_moe_router,
    _moe_excludes_moe_router,
    _full_iteration_needs_sync_free_dispatch,
    _ep_overlap_needs_partial_graphs,
    _ep_overlap_allows_pre_dispatch_modules,
    _host_syncing_preprocess_stays_eager,
    _whole_moe_layer_needs_sync_free_dispatch,
    _capture_needs_a_recorded_warmup_step,
    _impl_is_implemented,
    _graphs_need_cuda,  # keep last: every rule above stays testable on a CPU machine
)


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _check_choice(flag: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(flag, value, f"one of: {' '.join(allowed)}")


def _check_names(flag: str, names: Sequence[str], allowed: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ConfigError(flag, names, f"unknown {' '.join(unknown)}; allowed: {' '.join(allowed)}")


def _check_warmup_steps(steps: object) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ConfigError("--cuda-graph-warmup-steps", steps, "an integer >= 0")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _split_names(raw: Sequence[str]) -> tuple[str, ...]:
    """`["attn,mlp", "moe"]` -> `("attn", "mlp", "moe")` (the comma form some launchers use)."""
    return tuple(name for item in raw for name in item.split(",") if name)


def _dedupe(names) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _lookup_scope_value(value: str) -> DeprecatedScopeValue:
    return next(row for row in DEPRECATED_SCOPE_VALUES if row.value == value)
