"""CUDA-graph configuration surface: flags, deprecated-form migration, conflicts, validation rules.

CPU only, fast. Tables first (deprecated forms, new forms, conflicts, bad values), then one
rejecting and one accepting case per validation rule, then the not-implemented refusal and the
frozen flag list.
"""

from __future__ import annotations

import argparse
import functools

import pytest

from epoverlap.config.cuda_graph_rules import validate_cuda_graph_config
from epoverlap.config.cuda_graphs import (CUDA_GRAPH_IMPLS, IMPLEMENTED_IMPLS, CudaGraphConfig,
                                          add_cuda_graph_args, cuda_graph_config_from_args)
from epoverlap.errors import ConfigError

Cfg = functools.partial(CudaGraphConfig, impl="none")  # the rules of an impl given
Parsed = CudaGraphConfig  # what parsing gives without an impl: auto (config.resolve sets it)


def parse(argv: list[str]) -> tuple[CudaGraphConfig, list[str]]:
    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    warnings: list[str] = []
    cfg = cuda_graph_config_from_args(parser.parse_args(argv), warnings.append)
    return cfg, warnings


def parse_error(argv: list[str]) -> tuple[ConfigError, list[str]]:
    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    warnings: list[str] = []
    with pytest.raises(ConfigError) as info:
        cuda_graph_config_from_args(parser.parse_args(argv), warnings.append)
    return info.value, warnings


# Model facts under which every rule passes for a plain config; each rule case overrides a few.
FACTS = dict(
    overlap_moe_expert_parallel_comm=False,
    has_moe_layers=True,
    has_dense_layers=True,
    preprocess_syncs_host=False,
    dispatch_sizing="budget",
    transformer_engine_available=True,
    cuda_available=True,
    implemented_impls=CUDA_GRAPH_IMPLS,  # every rule but that one stays testable for every impl
)


def validate(cfg: CudaGraphConfig, **overrides: bool) -> None:
    validate_cuda_graph_config(cfg, **{**FACTS, **overrides})


# ---------------------------------------------------------------------------------------------
# Deprecated forms: argv -> config and the warning lines
# ---------------------------------------------------------------------------------------------

FULL_ITERATION_WARNING = (
    "deprecated: --cuda-graph-scope full_iteration -> --cuda-graph-impl full_iteration")

DEPRECATED_FORMS = [
    pytest.param(["--enable-cuda-graph"], Cfg(impl="local", inference_scope="layer"),
                 ["deprecated: --enable-cuda-graph -> --cuda-graph-impl local"], id="enable"),
    pytest.param(["--external-cuda-graph"], Cfg(impl="transformer_engine"),
                 ["deprecated: --external-cuda-graph -> --cuda-graph-impl transformer_engine"],
                 id="external"),
    pytest.param(["--cuda-graph-scope", "full_iteration"], Cfg(impl="full_iteration"),
                 [FULL_ITERATION_WARNING],
                 id="scope-full_iteration"),
    pytest.param(["--cuda-graph-scope", "full_iteration_inference"],
                 Cfg(impl="local", inference_scope="block"),
                 ["deprecated: --cuda-graph-scope full_iteration_inference -> "
                  "--cuda-graph-impl local --inference-cuda-graph-scope block"],
                 id="scope-full_iteration_inference"),
    pytest.param(["--cuda-graph-scope", "attn", "mlp"], Parsed(modules=("attn", "mlp")),
                 ["deprecated: --cuda-graph-scope attn mlp -> --cuda-graph-modules attn mlp"],
                 id="scope-modules"),
    # Combinations that say the same thing twice, or old idioms, are accepted.
    pytest.param(["--cuda-graph-impl", "transformer_engine",
                  "--cuda-graph-scope", "attn", "moe_router", "moe_preprocess"],
                 Cfg(impl="transformer_engine", modules=("attn", "moe_router", "moe_preprocess")),
                 ["deprecated: --cuda-graph-scope attn moe_router moe_preprocess -> "
                  "--cuda-graph-modules attn moe_router moe_preprocess"], id="te+scope-modules"),
    pytest.param(["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
                 Cfg(impl="full_iteration"),
                 [FULL_ITERATION_WARNING],
                 id="old-idiom-local+full_iteration"),
    pytest.param(["--enable-cuda-graph", "--cuda-graph-impl", "local"],
                 Cfg(impl="local", inference_scope="layer"),
                 ["deprecated: --enable-cuda-graph -> --cuda-graph-impl local"],
                 id="enable+same-impl"),
    pytest.param(["--enable-cuda-graph", "--cuda-graph-scope", "attn"],
                 Cfg(impl="local", modules=("attn",), inference_scope="layer"),
                 ["deprecated: --enable-cuda-graph -> --cuda-graph-impl local",
                  "deprecated: --cuda-graph-scope attn -> --cuda-graph-modules attn"],
                 id="enable+scope-modules"),
    pytest.param(["--cuda-graph-scope", "full_iteration_inference", "attn"],
                 Cfg(impl="local", modules=("attn",), inference_scope="block"),
                 ["deprecated: --cuda-graph-scope full_iteration_inference -> "
                  "--cuda-graph-impl local --inference-cuda-graph-scope block",
                  "deprecated: --cuda-graph-scope attn -> --cuda-graph-modules attn"],
                 id="scope-full_iteration_inference+modules"),
    pytest.param(["--cuda-graph-scope", "full_iteration_inference",
                  "--inference-cuda-graph-scope", "block"],
                 Cfg(impl="local", inference_scope="block"),
                 ["deprecated: --cuda-graph-scope full_iteration_inference -> "
                  "--cuda-graph-impl local --inference-cuda-graph-scope block"],
                 id="scope-full_iteration_inference+same-inference-scope"),
    pytest.param(["--cuda-graph-scope", "attn,mlp", "attn"], Parsed(modules=("attn", "mlp")),
                 ["deprecated: --cuda-graph-scope attn mlp attn -> --cuda-graph-modules attn mlp"],
                 id="scope-commas-and-repeats"),
    pytest.param(["--cuda-graph-scope", "mlp", "attn", "--cuda-graph-modules", "attn", "mlp"],
                 Parsed(modules=("attn", "mlp")),
                 ["deprecated: --cuda-graph-scope mlp attn -> --cuda-graph-modules mlp attn"],
                 id="scope+same-modules-new-order-wins"),
]


@pytest.mark.parametrize("argv, expected, warnings", DEPRECATED_FORMS)
def test_deprecated_form_is_migrated_with_one_warning_each(argv, expected, warnings):
    cfg, got_warnings = parse(argv)
    assert cfg == expected
    assert got_warnings == warnings


NEW_FORMS = [
    pytest.param([], Parsed(), id="defaults"),
    pytest.param(["--cuda-graph-impl", "local"], Cfg(impl="local", inference_scope="layer"),
                 id="local-defaults-inference-layer"),
    pytest.param(["--cuda-graph-impl", "local", "--inference-cuda-graph-scope", "block"],
                 Cfg(impl="local", inference_scope="block"), id="local-explicit-block"),
    pytest.param(["--cuda-graph-impl", "transformer_engine"], Cfg(impl="transformer_engine"),
                 id="te-defaults-inference-none"),
    pytest.param(["--cuda-graph-impl", "local", "--cuda-graph-modules"],
                 Cfg(impl="local", inference_scope="layer"), id="empty-modules-whole-layer"),
    pytest.param(["--cuda-graph-impl", "local", "--cuda-graph-modules",
                  "moe_router", "attn", "moe_router", "attn,moe_preprocess"],
                 Cfg(impl="local", modules=("moe_router", "attn", "moe_preprocess"),
                     inference_scope="layer"), id="modules-dedupe-keep-order"),
    pytest.param(["--cuda-graph-warmup-steps", "0"], Parsed(warmup_steps=0), id="warmup-0"),
]


@pytest.mark.parametrize("argv, expected", NEW_FORMS)
def test_new_forms_parse_without_warnings(argv, expected):
    cfg, warnings = parse(argv)
    assert cfg == expected
    assert warnings == []


# ---------------------------------------------------------------------------------------------
# Conflicting old + new inputs: argv -> the flag named in the error
# ---------------------------------------------------------------------------------------------

CONFLICTS = [
    pytest.param(["--enable-cuda-graph", "--cuda-graph-impl", "transformer_engine"],
                 "--enable-cuda-graph", id="enable+te"),
    pytest.param(["--enable-cuda-graph", "--cuda-graph-impl", "none"],
                 "--enable-cuda-graph", id="enable+none"),
    pytest.param(["--external-cuda-graph", "--cuda-graph-impl", "local"],
                 "--external-cuda-graph", id="external+local"),
    pytest.param(["--enable-cuda-graph", "--external-cuda-graph"],
                 "--external-cuda-graph", id="enable+external"),
    pytest.param(["--cuda-graph-scope", "attn", "--cuda-graph-modules", "mlp"],
                 "--cuda-graph-scope", id="scope-attn+modules-mlp"),
    pytest.param(["--cuda-graph-scope", "attn", "--cuda-graph-modules"],
                 "--cuda-graph-scope", id="scope-attn+modules-empty"),
    pytest.param(["--cuda-graph-scope", "full_iteration", "attn"],
                 "--cuda-graph-scope", id="full_iteration-mixed-with-modules"),
    pytest.param(["--cuda-graph-scope", "full_iteration", "full_iteration_inference"],
                 "--cuda-graph-scope", id="two-deprecated-scope-values"),
    pytest.param(["--cuda-graph-scope", "full_iteration",
                  "--cuda-graph-impl", "transformer_engine"],
                 "--cuda-graph-scope", id="full_iteration+te"),
    pytest.param(["--cuda-graph-scope", "full_iteration", "--cuda-graph-impl", "none"],
                 "--cuda-graph-scope", id="full_iteration+explicit-none"),
    pytest.param(["--cuda-graph-scope", "full_iteration", "--external-cuda-graph"],
                 "--cuda-graph-scope", id="full_iteration+external"),
    pytest.param(["--cuda-graph-scope", "full_iteration_inference",
                  "--cuda-graph-impl", "full_iteration"],
                 "--cuda-graph-scope", id="full_iteration_inference+full_iteration"),
    pytest.param(["--cuda-graph-scope", "full_iteration_inference",
                  "--inference-cuda-graph-scope", "layer"],
                 "--cuda-graph-scope", id="full_iteration_inference+inference-layer"),
]


@pytest.mark.parametrize("argv, flag", CONFLICTS)
def test_conflicting_old_and_new_inputs_are_rejected(argv, flag):
    error, warnings = parse_error(argv)
    assert error.flag == flag
    assert str(error).startswith(flag + "=")
    assert "\n" not in str(error)
    assert warnings == []  # nothing printed for a rejected command line but the error


BAD_VALUES = [
    pytest.param(["--cuda-graph-impl", "cudnn"], "--cuda-graph-impl",
                 "none local transformer_engine full_iteration", id="impl"),
    pytest.param(["--cuda-graph-modules", "attn", "router"], "--cuda-graph-modules",
                 "attn mlp moe moe_router moe_preprocess mamba", id="module"),
    pytest.param(["--cuda-graph-scope", "full"], "--cuda-graph-scope",
                 "full_iteration full_iteration_inference attn", id="scope"),
    pytest.param(["--inference-cuda-graph-scope", "full"], "--inference-cuda-graph-scope",
                 "none layer block", id="inference-scope"),
    pytest.param(["--cuda-graph-warmup-steps", "-1"], "--cuda-graph-warmup-steps", ">= 0",
                 id="warmup-negative"),
]


@pytest.mark.parametrize("argv, flag, allowed", BAD_VALUES)
def test_bad_value_names_the_flag_and_lists_what_is_allowed(argv, flag, allowed):
    error, _ = parse_error(argv)
    assert error.flag == flag
    assert allowed in str(error)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(impl="cudnn"), "--cuda-graph-impl"),
    (dict(modules=("attn", "attn")), "--cuda-graph-modules"),
    (dict(modules=("router",)), "--cuda-graph-modules"),
    (dict(modules="attn"), "--cuda-graph-modules"),
    (dict(inference_scope="full"), "--inference-cuda-graph-scope"),
    (dict(warmup_steps=-1), "--cuda-graph-warmup-steps"),
    (dict(warmup_steps=True), "--cuda-graph-warmup-steps"),
])
def test_config_checks_each_field_on_construction(kwargs, flag):
    with pytest.raises(ConfigError) as info:
        CudaGraphConfig(**kwargs)
    assert info.value.flag == flag


def test_config_stores_modules_as_tuple():
    assert CudaGraphConfig(impl="local", modules=["attn"]).modules == ("attn",)


# ---------------------------------------------------------------------------------------------
# Validation rules: one rejecting and one accepting case each
# ---------------------------------------------------------------------------------------------

LOCAL = dict(impl="local", inference_scope="layer")
TE = dict(impl="transformer_engine")

# id: (rejected config, facts overrides), (accepted config, facts overrides), flag, message fragment
RULES = {
    "modules-need-an-impl": (
        (Cfg(modules=("attn",)), {}),
        (Cfg(**LOCAL, modules=("attn",)), {}),
        "--cuda-graph-modules", "nothing is captured"),
    "full_iteration-takes-no-modules": (
        (Cfg(impl="full_iteration", modules=("attn",)), {}),
        (Cfg(impl="full_iteration"), {}),
        "--cuda-graph-modules", "must be empty"),
    "inference-scope-fits-impl-te": (
        (Cfg(**TE, inference_scope="layer"), {}),
        (Cfg(**TE), {}),
        "--inference-cuda-graph-scope", "one of: none"),
    "inference-scope-fits-impl-local": (
        (Cfg(impl="local", inference_scope="none"), {}),
        (Cfg(impl="local", inference_scope="block"), {}),
        "--inference-cuda-graph-scope", "one of: layer block"),
    "te-needs-transformer-engine": (
        (Cfg(**TE), dict(transformer_engine_available=False)),
        (Cfg(**LOCAL), dict(transformer_engine_available=False)),
        "--cuda-graph-impl", "not importable"),
    "mamba-rejected": (
        (Cfg(**LOCAL, modules=("attn", "mamba")), {}),
        (Cfg(**LOCAL, modules=("attn",)), {}),
        "--cuda-graph-modules", "no Mamba layers"),
    "moe-modules-need-moe-layers": (
        (Cfg(**LOCAL, modules=("attn", "moe_router")), dict(has_moe_layers=False)),
        (Cfg(**LOCAL, modules=("attn", "mlp")), dict(has_moe_layers=False)),
        "--cuda-graph-modules", "moe_router needs moe layers"),
    "mlp-needs-dense-layers": (
        (Cfg(**LOCAL, modules=("attn", "mlp")), dict(has_dense_layers=False)),
        (Cfg(**LOCAL, modules=("attn", "moe")), dict(has_dense_layers=False)),
        "--cuda-graph-modules", "mlp needs dense layers"),
    "moe_preprocess-needs-moe_router": (
        (Cfg(**LOCAL, modules=("attn", "moe_preprocess")), {}),
        (Cfg(**LOCAL, modules=("attn", "moe_router", "moe_preprocess")), {}),
        "--cuda-graph-modules", "list moe_router too"),
    "moe-excludes-moe_router": (
        (Cfg(**LOCAL, modules=("moe", "moe_router")), {}),
        (Cfg(**LOCAL, modules=("attn", "moe")), {}),
        "--cuda-graph-modules", "mutually exclusive"),
    "full_iteration-needs-sync-free-dispatch": (
        (Cfg(impl="full_iteration"), dict(dispatch_sizing="host_splits")),
        (Cfg(impl="full_iteration"), dict(dispatch_sizing="host_splits", has_moe_layers=False)),
        "--cuda-graph-impl", "--moe-dispatch-budget"),
    "ep-overlap-rejects-whole-layer": (
        (Cfg(**LOCAL), dict(overlap_moe_expert_parallel_comm=True)),
        (Cfg(), dict(overlap_moe_expert_parallel_comm=True)),
        "--cuda-graph-modules", "whole-layer graph would capture the all-to-all"),
    "ep-overlap-allows-pre-dispatch-modules": (
        (Cfg(**TE, modules=("attn", "moe")), dict(overlap_moe_expert_parallel_comm=True)),
        (Cfg(**TE, modules=("attn", "moe_router", "moe_preprocess")),
         dict(overlap_moe_expert_parallel_comm=True)),
        "--cuda-graph-modules", "moe cannot be graphed with the EP overlap"),
    "ep-overlap-rejects-mlp": (
        (Cfg(**TE, modules=("attn", "mlp")), dict(overlap_moe_expert_parallel_comm=True)),
        (Cfg(**TE, modules=("attn",)), dict(overlap_moe_expert_parallel_comm=True)),
        "--cuda-graph-modules", "mlp cannot be graphed with the EP overlap"),
    "host-sync-preprocess-not-graphed": (
        (Cfg(**TE, modules=("attn", "moe_router", "moe_preprocess")),
         dict(preprocess_syncs_host=True)),
        (Cfg(**TE, modules=("attn", "moe_router")), dict(preprocess_syncs_host=True)),
        "--cuda-graph-modules", "device-to-host in preprocess"),
    "host-sync-whole-moe-layer-not-graphed": (
        (Cfg(**TE, modules=("attn", "moe")), dict(preprocess_syncs_host=True)),
        (Cfg(**TE, modules=("attn", "moe")), {}),
        "--cuda-graph-modules", "device-to-host in preprocess"),
    "host-sync-empty-modules-covers-moe-layer": (
        (Cfg(**LOCAL), dict(preprocess_syncs_host=True)),
        (Cfg(**LOCAL), dict(preprocess_syncs_host=True, has_moe_layers=False)),
        "--cuda-graph-modules", "device-to-host in preprocess"),
    "host-sync-full_iteration": (
        (Cfg(impl="full_iteration"), dict(preprocess_syncs_host=True)),
        (Cfg(impl="full_iteration"), {}),
        "--cuda-graph-impl", "--kernel-backend triton"),
    "whole-moe-layer-needs-sync-free-dispatch": (
        (Cfg(**LOCAL, modules=("attn", "moe")), dict(dispatch_sizing="host_splits")),
        (Cfg(**LOCAL, modules=("attn", "moe")), {}),
        "--cuda-graph-modules", "--moe-pad-expert-input-to-capacity"),
}


@pytest.mark.parametrize("rejected, flag, fragment",
                         [(r, f, m) for r, _, f, m in RULES.values()], ids=list(RULES))
def test_rule_rejects(rejected, flag, fragment):
    cfg, overrides = rejected
    with pytest.raises(ConfigError) as info:
        validate(cfg, **overrides)
    assert info.value.flag == flag
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("accepted", [a for _, a, _, _ in RULES.values()], ids=list(RULES))
def test_rule_accepts(accepted):
    cfg, overrides = accepted
    validate(cfg, **overrides)


# ---------------------------------------------------------------------------------------------
# What capture exists, and where it can run
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [Cfg(**LOCAL, modules=("attn",)), Cfg(**TE),
                                 Cfg(impl="full_iteration")], ids=["local", "te", "full_iteration"])
def test_any_capturing_impl_is_refused_on_cpu_naming_cuda(cfg):
    with pytest.raises(ConfigError) as info:
        validate(cfg, cuda_available=False)
    assert info.value.flag == "--cuda-graph-impl"
    assert "need a CUDA device" in str(info.value) and "--cuda-graph-impl none" in str(info.value)


@pytest.mark.parametrize("cfg", [Cfg(**TE)], ids=["te"])
def test_impls_without_capture_are_refused_with_the_one_that_exists(cfg):
    with pytest.raises(ConfigError) as info:
        validate(cfg, implemented_impls=IMPLEMENTED_IMPLS)
    assert "not implemented" in str(info.value) and "--cuda-graph-impl local" in str(info.value)


@pytest.mark.parametrize("modules", [("attn",), ("attn", "moe_router"), ("moe_router",),
                                     ("attn", "moe_router", "moe_preprocess"),
                                     ("moe_router", "moe_preprocess"), ("attn", "mlp")])
def test_local_capture_of_per_layer_regions_passes(modules):
    validate(Cfg(**LOCAL, modules=modules), dispatch_sizing="host_splits")


@pytest.mark.parametrize("modules", [(), ("moe",), ("attn", "moe")])
def test_whole_moe_layer_needs_a_sync_free_dispatcher(modules):
    with pytest.raises(ConfigError) as info:
        validate(Cfg(**LOCAL, modules=modules), dispatch_sizing="host_splits")
    assert info.value.flag == "--cuda-graph-modules" and "all-to-all" in str(info.value)


@pytest.mark.parametrize("cfg", [Cfg(**LOCAL), Cfg(**LOCAL, modules=("moe",)),
                                 Cfg(**LOCAL, modules=("attn", "moe")), Cfg(impl="full_iteration")],
                         ids=["whole-layer", "moe", "attn-moe", "full_iteration"])
def test_sync_free_dispatch_makes_graphs_over_the_dispatch_valid(cfg):
    validate(cfg, dispatch_sizing="budget", implemented_impls=IMPLEMENTED_IMPLS)


@pytest.mark.parametrize("cfg, flag, fragment", [
    (Cfg(**LOCAL, modules=("attn", "moe")), "--cuda-graph-modules", "moe cannot be graphed"),
    (Cfg(**LOCAL), "--cuda-graph-modules", "whole-layer graph would capture the all-to-all"),
], ids=["moe", "whole-layer"])
def test_graphs_over_the_dispatch_still_exclude_the_ep_overlap(cfg, flag, fragment):
    """Sync-free or not: a graph holding the all-to-all would swallow what the overlap hides."""
    with pytest.raises(ConfigError) as info:
        validate(cfg, dispatch_sizing="budget", overlap_moe_expert_parallel_comm=True)
    assert info.value.flag == flag and fragment in str(info.value)


def test_full_iteration_with_the_ep_overlap_is_valid_with_a_sync_free_dispatch():
    validate(Cfg(impl="full_iteration"), overlap_moe_expert_parallel_comm=True,
             dispatch_sizing="budget", implemented_impls=IMPLEMENTED_IMPLS)


def test_dense_only_model_may_graph_whole_layers():
    validate(Cfg(**LOCAL), has_moe_layers=False, dispatch_sizing="host_splits")


def test_capture_needs_one_recorded_warmup_step():
    with pytest.raises(ConfigError) as info:
        validate(Cfg(**LOCAL, modules=("attn",), warmup_steps=0))
    assert info.value.flag == "--cuda-graph-warmup-steps"


def test_defaults_pass_on_cpu():
    cfg, warnings = parse([])
    validate(cfg, cuda_available=False)
    assert warnings == []


def test_cpu_refusal_comes_after_every_other_rule():
    with pytest.raises(ConfigError) as info:
        validate(Cfg(**TE), transformer_engine_available=False, cuda_available=False,
                 implemented_impls=IMPLEMENTED_IMPLS)
    assert "not importable" in str(info.value)


def test_check_inputs_flag_reaches_the_config():
    cfg, _ = parse(["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
                    "--cuda-graph-check-inputs"])
    assert cfg.check_inputs and not parse([])[0].check_inputs


# ---------------------------------------------------------------------------------------------
# The CLI surface must not drift silently
# ---------------------------------------------------------------------------------------------

FROZEN_FLAGS = [
    # (flag, dest, nargs, default)
    ("--cuda-graph-impl", "cuda_graph_impl", None, None),
    ("--cuda-graph-modules", "cuda_graph_modules", "*", None),
    ("--cuda-graph-warmup-steps", "cuda_graph_warmup_steps", None, None),
    ("--inference-cuda-graph-scope", "inference_cuda_graph_scope", None, None),
    ("--cuda-graph-check-inputs", "cuda_graph_check_inputs", 0, None),
    ("--enable-cuda-graph", "enable_cuda_graph", 0, None),
    ("--external-cuda-graph", "external_cuda_graph", 0, None),
    ("--cuda-graph-scope", "cuda_graph_scope", "+", None),
]


def test_registered_flags_are_frozen():
    parser = argparse.ArgumentParser(add_help=False)
    add_cuda_graph_args(parser)
    registered = [(flag, a.dest, a.nargs, a.default)
                  for a in parser._actions for flag in a.option_strings]
    assert registered == FROZEN_FLAGS


def test_help_marks_deprecated_flags():
    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    by_flag = {flag: a.help for a in parser._actions for flag in a.option_strings}
    for flag in ("--enable-cuda-graph", "--external-cuda-graph", "--cuda-graph-scope"):
        assert by_flag[flag].startswith("deprecated:")


@pytest.mark.parametrize("impl, modules", [("full_iteration", ()), ("local", ()),
                                           ("local", ("attn", "moe"))])
def test_graphs_holding_the_experts_need_the_bf16_grouped_gemm(impl, modules):
    """fp32 on CUDA: torch's grouped GEMM reads its offsets on the host (seen failing in
    capture on a GPU); the pre-dispatch regions stay allowed."""
    cfg = Cfg(impl=impl, modules=modules,
              inference_scope="layer" if impl == "local" else "none")
    with pytest.raises(ConfigError) as info:
        validate(cfg, experts_gemm_reads_host=True)
    assert info.value.flag == "--cuda-graph-impl" and "needs --bf16" in str(info.value)
    validate(cfg)  # bf16: the same config is accepted
    validate(Cfg(impl="local", modules=("attn", "moe_router"), inference_scope="layer"),
             experts_gemm_reads_host=True)

