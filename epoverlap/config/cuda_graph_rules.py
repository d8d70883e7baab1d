"""The CUDA-graph configuration's cross-field rules: one function per rule, each named as the
sentence it checks, run in the order of VALIDATION_RULES by `validate_cuda_graph_config` with
the facts the model and the runtime state about themselves (`_ModelFacts`: which layers the
model has, how its dispatch sizes rows, whether CUDA and Transformer Engine are here).
Every rejection is a `ConfigError` naming the flag, the value and what is allowed; the rules on
the dispatch are rows of `config.dispatch_rules.RULES`, which the rules here look up.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Sequence

from epoverlap.config.cuda_graphs import (AUTO, EP_OVERLAP_MODULES, IMPLEMENTED_IMPLS,
                                          INFERENCE_SCOPES_BY_IMPL, MODULE_LAYER_KINDS,
                                          MODULES_WITH_MOE_PREPROCESS, PER_LAYER_IMPLS,
                                          CudaGraphConfig)
from epoverlap.config.dispatch_rules import DispatchChoice, graphs_scope, refusal
from epoverlap.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class _ModelFacts:
    """What the rules need to know about the model and the runtime."""

    overlap_moe_expert_parallel_comm: bool
    has_moe_layers: bool
    has_dense_layers: bool
    preprocess_syncs_host: bool
    dispatch_sizing: str  # dispatch_rules.SIZINGS: host_splits reads split sizes on the host
    transformer_engine_available: bool
    cuda_available: bool
    implemented_impls: tuple[str, ...]
    experts_gemm_reads_host: bool = False

    def layer_kinds(self) -> tuple[str, ...]:
        return ("dense",) * self.has_dense_layers + ("moe",) * self.has_moe_layers


def validate_cuda_graph_config(cfg: CudaGraphConfig, *, overlap_moe_expert_parallel_comm: bool,
                               has_moe_layers: bool, has_dense_layers: bool,
                               preprocess_syncs_host: bool, dispatch_sizing: str,
                               transformer_engine_available: bool, cuda_available: bool,
                               implemented_impls: Sequence[str] = IMPLEMENTED_IMPLS,
                               experts_gemm_reads_host: bool = False) -> None:
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
        dispatch_sizing=dispatch_sizing,
        transformer_engine_available=transformer_engine_available,
        cuda_available=cuda_available,
        implemented_impls=tuple(implemented_impls),
        experts_gemm_reads_host=experts_gemm_reads_host,
    )
    if cfg.impl == AUTO:  # not resolved (config.resolve): held to the rules of no graphs
        cfg = dataclasses.replace(cfg, impl="none")
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
    _dispatch_rule(cfg, facts, "--cuda-graph-impl", cfg.impl)


def _dispatch_rule(cfg: CudaGraphConfig, facts: _ModelFacts, flag: str, value: object) -> None:
    """The table's rule of `flag` (`config.dispatch_rules`) on the graphs and the dispatch."""
    if not facts.has_moe_layers:
        return
    choice = DispatchChoice(sizing=facts.dispatch_sizing,
                            graphs=graphs_scope(cfg.impl, cfg.modules))
    why = refusal(choice, flag)
    if why:
        raise ConfigError(flag, value, why)


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
    _dispatch_rule(cfg, facts, "--cuda-graph-modules", cfg.modules)


def _graphed_experts_need_a_sync_free_grouped_gemm(cfg: CudaGraphConfig,
                                                    facts: _ModelFacts) -> None:
    holds_experts = cfg.impl == "full_iteration" or (
        cfg.impl in PER_LAYER_IMPLS and (not cfg.modules or "moe" in cfg.modules))
    if holds_experts and facts.has_moe_layers and facts.experts_gemm_reads_host:
        raise ConfigError("--cuda-graph-impl", cfg.impl, "a graph holding the experts' grouped "
                          "GEMMs needs --bf16: torch's fp32 grouped GEMM reads its expert "
                          "offsets on the host, which a graph cannot capture")


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
    _graphed_experts_need_a_sync_free_grouped_gemm,
    _impl_is_implemented,
    _graphs_need_cuda,  # keep last: every rule above stays testable on a CPU machine
)
