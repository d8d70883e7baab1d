"""CUDA-graph configuration: the flags and the migration of their deprecated forms.

This module owns the user-facing CUDA-graph surface: `CudaGraphConfig` (its fields are its
flags), the deprecated flags users of Megatron-LM still type and their migration
(`cuda_graph_config_from_args`). Every cross-field rule is `config.cuda_graph_rules`; capture
is `epoverlap.graphs`: the `local` impl of the per-layer modules and `full_iteration`;
`transformer_engine` is refused with a line saying so.

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
(the formats and the boolean flags' migration are `config.aliases`):

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

from epoverlap.config.aliases import FlagAlias, alias_conflict, apply_aliases, deprecation_note
from epoverlap.config.flags import add_flags, flag, section_flags
from epoverlap.errors import ConfigError

GROUP = "CUDA graphs (GPU only)"
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
AUTO = "auto"  # the default: resolved from the device (config.resolve), never captured as is
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
# Deprecated boolean flags and the impl each stands for (migrated by `config.aliases`).
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
    `config.cuda_graph_rules`. Note: the inference-scope default rule (local -> layer) is applied
    by `cuda_graph_config_from_args`; a config built directly with impl="local" must set it."""

    impl: str = flag(AUTO, "what captures the graphs", name="--cuda-graph-impl",
                     choices=(AUTO,) + CUDA_GRAPH_IMPLS, group=GROUP,
                     default_text="auto: local with attn moe_router moe_preprocess on CUDA "
                     "devices, none on CPU")
    modules: tuple[str, ...] = flag(
        (), "per-layer capture regions; none listed = the whole layer",
        name="--cuda-graph-modules", nargs="*", choices=CUDA_GRAPH_MODULES, group=GROUP,
        metavar="MODULE")
    warmup_steps: int = flag(3, "eager iterations before capture",
                             name="--cuda-graph-warmup-steps", group=GROUP)
    inference_scope: str = flag(
        "none", "kept for Megatron-LM compatibility (epoverlap trains)",
        name="--inference-cuda-graph-scope", choices=INFERENCE_SCOPES, group=GROUP,
        default_text="layer with --cuda-graph-impl local, else none")
    check_inputs: bool = flag(
        False, "debug: each replay checks its inputs' shapes, dtypes and devices and names the "
        "layer, microbatch and phase that differ", name="--cuda-graph-check-inputs", group=GROUP)

    def __post_init__(self) -> None:
        if isinstance(self.modules, str):
            raise ConfigError("--cuda-graph-modules", self.modules, "a sequence of module names")
        object.__setattr__(self, "modules", tuple(self.modules))
        _check_choice("--cuda-graph-impl", self.impl, (AUTO,) + CUDA_GRAPH_IMPLS)
        _check_choice("--inference-cuda-graph-scope", self.inference_scope, INFERENCE_SCOPES)
        _check_names("--cuda-graph-modules", self.modules, CUDA_GRAPH_MODULES)
        if len(set(self.modules)) != len(self.modules):
            raise ConfigError("--cuda-graph-modules", self.modules, "each module at most once")
        _check_warmup_steps(self.warmup_steps)


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


# The deprecated flags: not fields, only read by the migration below.
DEPRECATED_FLAGS = (
    ("--enable-cuda-graph", dict(action="store_true", default=None,
                                 help="deprecated: use --cuda-graph-impl local")),
    ("--external-cuda-graph", dict(action="store_true", default=None,
                                   help="deprecated: use --cuda-graph-impl transformer_engine")),
    ("--cuda-graph-scope", dict(nargs="+", default=None, metavar="SCOPE",
                                help="deprecated: use --cuda-graph-impl full_iteration, "
                                     "--inference-cuda-graph-scope block, or "
                                     "--cuda-graph-modules")),
)


def add_cuda_graph_args(parser: argparse.ArgumentParser) -> None:
    """Register the CUDA-graph flags: the config's fields, then the deprecated forms. Every
    default is None so that "not given" is visible; values are checked by
    `cuda_graph_config_from_args` (ConfigError), not by argparse choices."""
    add_flags(parser, list(section_flags("cuda_graph", CudaGraphConfig)))
    group = next(g for g in parser._action_groups if g.title == GROUP)
    for name, kwargs in DEPRECATED_FLAGS:
        group.add_argument(name, **kwargs)


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
        return base.impl if base else AUTO
    if base is not None and base.impl not in old_value.compatible_impls:
        raise alias_conflict("--cuda-graph-scope", old_value.value, old_value.new_flags(),
                             base.flags)
    notes.append(deprecation_note(f"--cuda-graph-scope {old_value.value}", old_value.new_flags()))
    return old_value.impl


def _impl_from_impl_flags(args: argparse.Namespace, notes: list[str]) -> Optional[_ImplSource]:
    """The impl asked for by --cuda-graph-impl or a deprecated boolean flag; None if neither."""
    explicit = args.cuda_graph_impl
    if explicit is not None:
        _check_choice("--cuda-graph-impl", explicit, (AUTO,) + CUDA_GRAPH_IMPLS)
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
