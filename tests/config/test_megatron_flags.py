"""Megatron-LM pretrain command lines (pure CPU): every flag of Megatron-LM's own MoE scripts
(tests/fixtures/megatron_scripts, verbatim from its main branch) is implemented, accepted for
what epoverlap already is, or refused with one line naming why; never "unrecognized". Each
script, shrunk by the one rule (`megatron_scripts.shrunk`), validates on 2 CPU ranks or is
refused in one run with every reason; accepted flags that change nothing are named in one
note."""

from __future__ import annotations

import importlib.util

import pytest

from epoverlap.config import build_parser, parse_config, validate_config
from epoverlap.cli.train import checked_config
from epoverlap.config.compat import GROUP, NOT_IMPLEMENTED, REFUSED_GROUP, RefusedFlag
from epoverlap.config.parse import accepted_notes
from epoverlap.errors import ConfigError, ConfigErrors
from megatron_scripts import (DEEPSEEK_V2_LITE, DEEPSEEK_V3, EP_OVERLAP, MIXTRAL, NAMES,
                              QWEN3, dispositions, flag_values, pasted, refusal_lines,
                              script_args)

REFUSED = {name for name, _, _ in NOT_IMPLEMENTED}


KNOWN = {option for action in build_parser()._actions for option in action.option_strings}
SCRIPT_GROUPS = {name: flag_values(pasted(name)) for name in NAMES}
SCRIPT_FLAGS = sorted({group[0] for groups in SCRIPT_GROUPS.values() for group in groups})


def test_the_fixtures_are_megatron_lm_s_files_below_a_header_naming_their_commit():
    from megatron_scripts import SCRIPTS, script_text
    for name in NAMES:
        head = (SCRIPTS / name).read_text().split("\n")[:8]
        assert any(line.startswith("# source: NVIDIA/Megatron-LM ") or "NVIDIA/Megatron-LM"
                   in line for line in head), name
        assert any(len(word.strip(",;.")) == 40 and all(c in "0123456789abcdef"
                                                       for c in word.strip(",;."))
                   for line in head for word in line.split()), name
        if name.endswith(".sh"):
            assert script_text(name).startswith("#!/bin/bash\n"), name


def test_every_flag_of_the_scripts_is_implemented_accepted_or_refused():
    unknown = [name for name in SCRIPT_FLAGS if name not in KNOWN]
    assert not unknown, f"neither implemented nor refused with a reason: {unknown}"


SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--ffn-hidden-size", "128", "--num-experts", "4", "--moe-router-topk", "2",
         "--seq-length", "32", "--train-iters", "4", "--mock-data"]


def test_vocabulary_padding_is_implemented():
    """--make-vocab-size-divisible-by pads the model's vocabulary as Megatron-LM's does (TP 1:
    --tensor-model-parallel-size, which multiplies it there, is 1 here)."""
    assert "--make-vocab-size-divisible-by" in KNOWN - REFUSED
    cfg = parse_config(SMALL + ["--make-vocab-size-divisible-by", "64",
                                "--tensor-model-parallel-size", "1"])
    validate_config(cfg, 2, False)
    assert cfg.with_vocab_size(50257).model.padded_vocab_size == 50304


@pytest.mark.parametrize("group", sorted({tuple(g) for groups in SCRIPT_GROUPS.values()
                                           for g in groups}), ids=lambda group: " ".join(group))
def test_each_flag_alone_is_taken_or_refused_in_one_line_with_its_reason(group, tmp_path,
                                                                         monkeypatch):
    """Each flag with the script's value, beside a small model: accepted, or one ConfigError
    line (never argparse's 'unrecognized arguments')."""
    monkeypatch.chdir(tmp_path)  # the scripts' output paths land here
    try:
        cfg = parse_config(SMALL + list(group))
        validate_config(cfg, 2, False)
    except ConfigError as error:  # this flag's, or a rule it takes part in (--lr vs --min-lr)
        text = str(error)
        assert text.startswith("--") and ": " in text and len(text.splitlines()) == 1, text
        if group[0] in REFUSED:
            assert isinstance(error, RefusedFlag) and text.startswith(group[0]), text


def test_refused_flags_are_named_one_line_each():
    with pytest.raises(ConfigErrors) as info:
        parse_config(SMALL + ["--fp16", "--recompute-granularity", "full",
                              "--hybrid-context-parallel"])
    lines = str(info.value).splitlines()
    assert lines == [
        "--fp16=True: fp16 training is not implemented; use --bf16",
        "--recompute-granularity=full: activation recomputation is not implemented",
        "--hybrid-context-parallel=True: hybrid context parallelism (sub-samples regrouped "
        "over the DP x CP ranks) is not implemented: give --dynamic-context-parallel (a CP "
        "size per microbatch)"]


def test_qwen3s_attention_flags_are_taken():
    """Qwen3-30B-A3B's script: query/key norms, and every head dimension rotated."""
    cfg = parse_config(SMALL + ["--qk-layernorm", "--rotary-percent", "1.0"])
    validate_config(cfg, 2, False)
    assert cfg.model.qk_layernorm and cfg.compat.rotary_percent == 1.0
    assert not parse_config(SMALL).model.qk_layernorm


@pytest.mark.parametrize("argv, message", [
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size=2: must be 1: tensor "
     "parallelism is not implemented; use expert/data/pipeline parallelism"),
    (["--normalization", "LayerNorm"], "--normalization=LayerNorm: allowed: RMSNorm (the norms "
     "are RMSNorm)"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type=flex: allowed: "
     "alltoall"),
    (["--kv-channels", "7"], "--kv-channels=7: must be even and >= 2"),
    (["--max-position-embeddings", "16"], "--max-position-embeddings=16: must be >= "
     "--seq-length=32"),
    (["--group-query-attention"], "--group-query-attention=True: needs --num-query-groups"),
    (["--ckpt-format", "torch"], "--ckpt-format=torch: allowed: torch_dist"),
    (["--rotary-percent", "0.5"], "--rotary-percent=0.5: must be 1.0: partial rotary "
     "embeddings are not implemented; every head dimension is rotated"),
])
def test_values_epoverlap_does_not_build_are_refused_naming_what_is(argv, message):
    with pytest.raises(ConfigError) as info:
        validate_config(parse_config(SMALL + argv), 2, False)
    assert str(info.value).startswith(message), str(info.value)


def test_accepted_flags_that_change_nothing_are_named_with_what_is_done():
    cfg = parse_config(SMALL + ["--swiglu", "--use-distributed-optimizer", "--num-workers", "8",
                                "--normalization", "RMSNorm"])
    validate_config(cfg, 2, False)
    notes = accepted_notes(cfg)
    assert notes[0] == "--use-distributed-optimizer (every rank keeps the optimizer state of " \
        "its own parameters whole; the updates are the same)" or "--swiglu" in notes[0]
    assert len(notes) == 3 and any(n.startswith("--num-workers (") for n in notes)


# Megatron-LM's EP-overlap functional test (deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap), as
# pasted: what each of its 106 flags is here. Refused: the math or the input would differ.
EP_OVERLAP_GROUPS = flag_values(script_args(EP_OVERLAP))
EP_OVERLAP_REFUSED = [  # in the order of the one run's lines: multi-latent attention only
    "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
    "--qk-pos-emb-head-dim", "--v-head-dim",
]
EP_OVERLAP_ACCEPTED = [  # each named in the accepted-flags line, with what is done instead
    "--use-mcore-models", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--moe-grouped-gemm", "--moe-permute-fusion",
    "--sequence-parallel", "--use-distributed-optimizer", "--overlap-param-gather",
    "--log-throughput", "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
    "--log-memory-to-tensorboard", "--log-params-norm", "--log-num-zeros-in-grad",
    "--no-rope-fusion", "--use-megatron-fsdp", "--attention-backend", "--logging-level",
    "--num-distributed-optimizer-instances", "--data-parallel-sharding-strategy",
    "--outer-dp-sharding-strategy", "--megatron-fsdp-main-params-dtype",
    "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-grad-comm-dtype", "--mscale",
    "--mscale-all-dim", "--data-cache-path",
    # values that change nothing beside the other flags given (config.compat.compat_notes)
    "--transformer-impl", "--ckpt-format", "--save-interval", "--moe-router-pre-softmax",
]


def _group_of(flag: str) -> str:
    """The --help group a flag is listed in."""
    parser = build_parser()
    for group in parser._action_groups:
        if any(flag in action.option_strings for action in group._group_actions):
            return group.title
    raise KeyError(flag)


def disposition(flag: str) -> str:
    """implemented (a section's own flag), accepted (the Megatron-LM compat group) or refused."""
    group = _group_of(flag)
    return {GROUP: "accepted", REFUSED_GROUP: "refused"}.get(group, "implemented")


def test_every_flag_of_the_ep_overlap_config_has_a_named_disposition():
    counts = {"implemented": 0, "accepted": 0, "refused": 0}
    for group in EP_OVERLAP_GROUPS:
        counts[disposition(group[0])] += 1
    assert len(EP_OVERLAP_GROUPS) == 106
    # by --help group: 63 flags of epoverlap's own sections (--qk-layernorm, --kv-channels,
    # --vocab-file, seq_aux_loss's --moe-router-load-balancing-type, --eod-mask-loss among
    # them), 37 of the Megatron-LM group, 6 of the refused group. On the command line (the tests below): 6
    # refused, 32 accepted with no effect, each noted, and 68 implemented (with the Megatron-LM
    # flags whose value states what epoverlap is: --normalization RMSNorm,
    # --rotary-scaling-factor 1.0, ...)
    assert counts == {"implemented": 63, "accepted": 37, "refused": 6}, counts
    assert len(EP_OVERLAP_REFUSED) == 6 and len(EP_OVERLAP_ACCEPTED) == 32


def _ep_overlap_refusals(argv: list[str], capsys) -> list[str]:
    with pytest.raises((ConfigError, SystemExit)) as info:
        checked_config(argv, 2, cuda_available=False)
    if isinstance(info.value, SystemExit):
        assert info.value.code == 2
        return capsys.readouterr().err.splitlines()
    return str(info.value).splitlines()


def test_the_ep_overlap_config_as_pasted_names_every_refusal_in_one_run(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.chdir(tmp_path)  # its ${TENSORBOARD_PATH} lands here
    lines = _ep_overlap_refusals(script_args(EP_OVERLAP), capsys)
    assert [line.split("=", 1)[0] for line in lines] == EP_OVERLAP_REFUSED, lines
    assert len(lines) == 6 and not any("unrecognized" in line for line in lines)


def test_unknown_arguments_come_on_argparse_s_one_line_beside_every_refusal(tmp_path,
                                                                           monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    lines = _ep_overlap_refusals(script_args(EP_OVERLAP) + ["--no-such-flag", "1", "--nor"],
                                 capsys)
    assert lines[0].startswith("usage: epoverlap-train ")
    assert lines[1] == "epoverlap-train: error: unrecognized arguments: --no-such-flag 1 --nor"
    assert [line.split(": error: ")[1].split("=")[0] for line in lines[2:]] == \
        EP_OVERLAP_REFUSED


def test_the_ep_overlap_config_less_its_refusals_validates_and_notes_each_accepted_flag(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [token for group in EP_OVERLAP_GROUPS if group[0] not in EP_OVERLAP_REFUSED
            for token in group]
    cfg, _, warnings = checked_config(argv, 2, cuda_available=False)
    notes = accepted_notes(cfg)
    assert [note.split(" ")[0] for note in notes] == EP_OVERLAP_ACCEPTED, notes
    assert warnings == [] and cfg.moe_layer_pattern() == [False, True]
    assert "--attention-backend (epoverlap's local attention runs (torch's SDPA), whatever " \
        "the backend)" in notes
    assert cfg.train.check_for_nan_in_loss_and_grad is False


@pytest.mark.parametrize("argv, message", [
    (["--megatron-fsdp-main-params-dtype", "bf16"], "--megatron-fsdp-main-params-dtype=bf16: "
     "allowed: fp32 (the master weights are fp32; another dtype rounds every update)"),
    (["--megatron-fsdp-grad-comm-dtype", "bf16"], "--megatron-fsdp-grad-comm-dtype=bf16: "
     "allowed: fp32"),
    (["--ckpt-format", "fsdp_dtensor", "--save", "ckpt"], "--ckpt-format=fsdp_dtensor: "
     "Megatron-FSDP's DTensor layout is not written or read"),
    (["--attention-backend", "fast"], "--attention-backend=fast: allowed: flash, fused, "
     "unfused, local, auto"),
    (["--moe-router-load-balancing-type", "global_aux_loss"],
     "--moe-router-load-balancing-type=global_aux_loss: allowed: aux_loss, seq_aux_loss, none"),
    (["--lr-decay-samples", "8"], "--lr-decay-samples=8: needs --train-samples"),
    (["--rotary-scaling-factor", "40"], "--rotary-scaling-factor=40.0: must be 1.0: rotary "
     "scaling (long context) is not implemented"),
    (["--num-distributed-optimizer-instances", "0"], "--num-distributed-optimizer-instances=0: "
     "must be >= 1"),
])
def test_values_that_would_change_the_math_are_refused(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        validate_config(parse_config(SMALL + argv), 2, False)
    assert str(info.value).startswith(message), str(info.value)


def test_the_same_values_beside_other_flags_are_accepted_with_a_note(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, note in (
            (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor (no --save or "
             "--load: no checkpoint is written or read)"),
            (["--save-interval", "2"], "--save-interval (no --save: nothing is saved)"),
            (["--transformer-impl", "transformer_engine"], "--transformer-impl "
             "transformer_engine (epoverlap's own layers and kernels run; Transformer Engine "
             "is not used)"),
            (["--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid"],
             "--moe-router-pre-softmax (the scores are sigmoid's: Megatron-core applies it to "
             "softmax scores only, and so does epoverlap)")):
        cfg = parse_config(SMALL + argv)
        validate_config(cfg, 2, False)
        assert accepted_notes(cfg) == [note]
    cfg = parse_config(SMALL + ["--save-interval", "2", "--save", "ckpt",
                                "--moe-router-pre-softmax"])
    validate_config(cfg, 2, False)
    assert accepted_notes(cfg) == []  # saved; softmax scores: both implemented


def test_independent_rules_broken_are_named_together_one_line_each(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigErrors) as info:
        validate_config(parse_config(SMALL + ["--lr", "-1", "--normalization", "LayerNorm",
                                              "--rotary-percent", "0.5", "--attention-dropout", "2",
                                              "--moe-router-topk", "9"]), 2, False)
    flags = [line.split("=")[0] for line in str(info.value).splitlines()]
    assert flags == ["--normalization", "--rotary-percent", "--moe-router-topk", "--lr",
                     "--attention-dropout"], str(info.value)


@pytest.mark.parametrize("freq, pattern", [
    ("([0]*1+[1]*1)", [0, 1]), ("([1]*3+[0])*2", [1, 1, 1, 0, 1, 1, 1, 0]),
    ("[0]+[1]*3", [0, 1, 1, 1]), ("0,1,1,1", [0, 1, 1, 1]), ("[0, 1]", [0, 1]), ("2", None)])
def test_moe_layer_freq_takes_megatron_lm_s_list_expressions(freq, pattern):
    from epoverlap.config.layer_freq import layer_freq_list
    assert layer_freq_list(freq) == pattern


@pytest.mark.parametrize("freq", ["__import__('os')", "[1]*10**9", "[1]*100000", "[x]",
                                  "([0]+[1]", "[1.5]"])
def test_moe_layer_freq_refuses_any_other_expression_in_one_line(freq):
    with pytest.raises(ConfigError) as info:
        validate_config(parse_config(SMALL + ["--moe-layer-freq", freq]), 2, False)
    assert str(info.value).startswith(f"--moe-layer-freq={freq}: an integer N, a 0/1 list")


def test_no_check_for_nan_in_loss_and_grad_turns_the_check_off():
    on = parse_config(SMALL + ["--check-for-nan-in-loss-and-grad"])
    off = parse_config(SMALL + ["--check-for-nan-in-loss-and-grad",
                                "--no-check-for-nan-in-loss-and-grad"])
    assert on.train.check_for_nan_in_loss_and_grad and not off.train.check_for_nan_in_loss_and_grad


MLA = ["--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
       "--qk-pos-emb-head-dim", "--v-head-dim"]
WANDB = ["--wandb-project"] if importlib.util.find_spec("wandb") is None else []
# Each script by the rule, on 2 CPU ranks: the flags its one run refuses, in order, and
# (implemented, accepted with no effect, refused) over all its flags.
SCRIPT_OUTCOMES = {
    MIXTRAL: ([], (47, 10, 0)),  # PP 2 with --eval-interval: evaluation through the stages
    QWEN3: ([], (28, 9, 0)),
    DEEPSEEK_V2_LITE: (MLA[:1] + MLA[2:] + ["--rotary-scaling-factor"], (34, 12, 6)),
    DEEPSEEK_V3: (["--recompute-granularity", "--recompute-modules", *MLA,
                   "--moe-flex-dispatcher-backend", "--mtp-num-layers",
                   "--mtp-loss-scaling-factor",
                   "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-grad-comm-dtype",
                   "--moe-token-dispatcher-type", "--rotary-scaling-factor", "--ckpt-format",
                   *WANDB], None),
    EP_OVERLAP: (MLA, (68, 32, 6)),
}


@pytest.mark.parametrize("name", NAMES)
def test_each_script_by_the_rule_validates_or_names_every_refusal_in_one_run(
        name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the scripts' output paths land here
    refused, counts = SCRIPT_OUTCOMES[name]
    lines = refusal_lines(pasted(name))
    assert [line.split("=", 1)[0] for line in lines] == refused, lines
    if counts is not None:
        kinds = dispositions(pasted(name))
        assert not kinds["unrecognized"] and not kinds["refused later"], kinds
        assert (len(kinds["implemented"]), len(kinds["accepted"]), len(kinds["refused"])) \
            == counts, kinds
