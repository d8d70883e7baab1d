"""Megatron-LM pretrain command lines (pure CPU): every flag of two real Megatron-LM MoE
pretrain scripts (tests/fixtures/megatron_scripts) is implemented, accepted for what
epoverlap already is, or refused with one line naming why; never "unrecognized". Accepted
flags that change nothing are named in one note; refused ones one line each."""

from __future__ import annotations

import pytest

from epoverlap.config import build_parser, parse_config, validate_config
from epoverlap.config.compat import NOT_IMPLEMENTED, RefusedFlags
from epoverlap.config.parse import accepted_notes
from epoverlap.errors import ConfigError
from megatron_scripts import NAMES, flag_values, script_args

REFUSED = {name for name, _, _ in NOT_IMPLEMENTED}


KNOWN = {option for action in build_parser()._actions for option in action.option_strings}
SCRIPT_FLAGS = sorted({group[0] for name in NAMES for group in flag_values(script_args(name))})


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


@pytest.mark.parametrize("group", [g for name in NAMES for g in flag_values(script_args(name))],
                         ids=lambda group: " ".join(group))
def test_each_flag_alone_is_taken_or_refused_in_one_line_with_its_reason(group, tmp_path,
                                                                         monkeypatch):
    """Each flag with the script's value, beside a small model: accepted, or one ConfigError
    line (never argparse's 'unrecognized arguments')."""
    monkeypatch.chdir(tmp_path)  # the scripts' output paths land here
    try:
        cfg = parse_config(SMALL + group)
        validate_config(cfg, 2, False)
    except ConfigError as error:  # this flag's, or a rule it takes part in (--lr vs --min-lr)
        text = str(error)
        assert text.startswith("--") and ": " in text and len(text.splitlines()) == 1, text
        if group[0] in REFUSED:
            assert isinstance(error, RefusedFlags) and text.startswith(group[0]), text


def test_refused_flags_are_named_one_line_each():
    with pytest.raises(RefusedFlags) as info:
        parse_config(SMALL + ["--fp16", "--recompute-granularity", "full", "--eod-mask-loss"])
    lines = str(info.value).splitlines()
    assert lines == [
        "--fp16=True: fp16 training is not implemented; use --bf16",
        "--recompute-granularity=full: activation recomputation is not implemented",
        "--eod-mask-loss=True: masking the loss at end-of-document tokens is not implemented"]


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
    (["--kv-channels", "32"], "--kv-channels=32: must be --hidden-size / "
     "--num-attention-heads = 16"),
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


def test_the_mixtral_script_with_data_and_tokenizer_adapted_validates():
    """The Mixtral example as pasted, but for its tokenizer (a Llama-2 sentencepiece model,
    refused) and W&B (an optional extra): it validates on 2 CPU ranks."""
    args = [g for g in flag_values(script_args("mixtral_8x7b_distributed.args"))
            if g[0] not in ("--tokenizer-type", "--tokenizer-model", "--wandb-project",
                            "--wandb-exp-name")]
    cfg = parse_config([token for group in args for token in group])
    validate_config(cfg, 2, False)
    cfg = cfg.for_world(2)
    assert (cfg.train.num_microbatches, cfg.parallel.expert_model_parallel_size) == (2, 2)
    assert cfg.model.rotary_base == 1e6 and cfg.moe.moe_aux_loss_coeff == 1e-2
