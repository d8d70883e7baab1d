"""Config: presets, layer patterns, and every validation rule naming its flag (pure CPU)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from epoverlap.config import (PRESETS, build_parser, moe_layer_pattern, parse_config,
                              validate_config)
from epoverlap.errors import ConfigError
from epoverlap.kernels import triton_installed

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-experts", "8", "--moe-router-topk", "2", "--train-iters", "5"]


def check(argv, world_size=2, cuda=False):
    validate_config(parse_config(BASE + argv), world_size, cuda)


def rejected(argv, world_size=2, cuda=False) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check(argv, world_size, cuda)
    return info.value


def test_defaults_and_presets_validate():
    check([])
    for name in PRESETS:
        validate_config(parse_config(["--preset", name, "--mock-data"]), 4, False)


@pytest.mark.parametrize("value", ["0", "-128"])
def test_vocabulary_padding_multiple_is_at_least_one(value):
    assert str(rejected(["--make-vocab-size-divisible-by", value])) == \
        f"--make-vocab-size-divisible-by={value}: must be >= 1 (1: the vocabulary unpadded)"


@pytest.mark.parametrize("vocab, multiple, padded", [(151937, 128, 152064), (50257, 128, 50304),
                                                     (256, 128, 256), (151937, 1, 151937),
                                                     (63, 64, 64)])
def test_padded_vocabulary_is_the_next_multiple(vocab, multiple, padded):
    cfg = parse_config(["--make-vocab-size-divisible-by", str(multiple)]).with_vocab_size(vocab)
    assert (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (vocab, padded)
    check(["--make-vocab-size-divisible-by", str(multiple)])


def test_preset_then_explicit_flag_wins():
    cfg = parse_config(["--preset", "tiny", "--hidden-size", "96"])
    assert cfg.model.hidden_size == 96
    assert cfg.model.num_layers == PRESETS["tiny"]["num_layers"]


@pytest.mark.parametrize("argv, world, flag, fragment", [
    (["--expert-model-parallel-size", "3"], 4, "--expert-model-parallel-size", "world size 4"),
    (["--expert-model-parallel-size", "4", "--num-experts", "6"], 4, "--num-experts",
     "divisible by --expert-model-parallel-size=4"),
    (["--moe-router-topk", "9"], 2, "--moe-router-topk", "[1, --num-experts=8]"),
    (["--num-attention-heads", "5"], 2, "--num-attention-heads", "divide --hidden-size=64"),
    (["--num-query-groups", "3"], 2, "--num-query-groups", "divide --num-attention-heads=4"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 2,
     "--moe-router-num-groups", "divide --num-experts=8"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "5"], 2,
     "--moe-router-group-topk", "[1, --moe-router-num-groups=4]"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "3"], 2, "--moe-router-topk",
     "divisible by --moe-router-group-topk=3"),
    (["--moe-router-num-groups", "4"], 2, "--moe-router-group-topk", "both or neither"),
    (["--moe-router-score-function", "relu"], 2, "--moe-router-score-function", "softmax"),
    (["--moe-router-enable-expert-bias"], 2, "--moe-router-enable-expert-bias", "sigmoid"),
    (["--moe-router-dtype", "fp16"], 2, "--moe-router-dtype", "fp32"),
    (["--moe-layer-freq", "1,0,1"], 2, "--moe-layer-freq", "--num-layers=2"),
    (["--moe-layer-freq", "x"], 2, "--moe-layer-freq", "0/1 list"),
    (["--moe-first-k-dense-replace", "3"], 2, "--moe-first-k-dense-replace", "[0, --num-layers"),
    (["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "1"], 2,
     "--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size > 1"),
    (["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2",
      "--moe-first-k-dense-replace", "2"], 2, "--overlap-moe-expert-parallel-comm",
     "at least one MoE layer"),
    (["--delay-wgrad-compute", "--no-overlap-moe-expert-parallel-comm"], 2,
     "--delay-wgrad-compute",
     "requires --overlap-moe-expert-parallel-comm"),
    (["--overlap-plan", "zigzag"], 2, "--overlap-plan", "combined_1f1b"),
    (["--overlap-moe-expert-parallel-comm", "--overlap-plan", "combined_1f1b_paired_ends",
      "--pipeline-model-parallel-size", "2"], 2, "--overlap-plan",
     "--pipeline-model-parallel-size 1"),
    (["--no-overlap-moe-expert-parallel-comm", "--overlap-probe-steps", "3"], 2,
     "--overlap-probe-steps", "needs --overlap-moe-expert-parallel-comm"),
    (["--overlap-probe-steps", "3"], 2, "--overlap-probe-steps",  # auto left the overlap off
     "--train-iters >= 7 (the first step, then 3 of each of 2 paths"),  # for this rule
    (["--deterministic-fill-uninitialized-memory"], 2,
     "--deterministic-fill-uninitialized-memory", "needs --deterministic-mode"),
    (["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2",
      "--overlap-probe-steps", "-1"], 2, "--overlap-probe-steps", ">= 0"),
    (["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2",
      "--overlap-probe-steps", "3", "--cuda-graph-impl", "transformer_engine"], 2,
     "--overlap-probe-steps", "use --cuda-graph-impl none, local or full_iteration"),
    (["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2",
      "--overlap-probe-steps", "3", "--cuda-graph-impl", "local", "--cuda-graph-modules",
      "attn", "--train-iters", "9"], 2, "--overlap-probe-steps",
     "--train-iters >= 10 (4 untimed: the graphs' warm-up and one capture step per other "
     "path, then 3 of each of 2 paths: combined_1f1b, sequential)"),
    (["--overlap-probe-steps", "3", "--tune", "off"], 2, "--overlap-probe-steps",
     "deprecated alias of --tune on --tune-steps 3, which conflicts with --tune off"),
    (["--tune", "maybe"], 2, "--tune", "allowed: auto, on, off"),
    (["--tune-steps", "0"], 2, "--tune-steps", "must be >= 1"),
    (["--tune", "on", "--no-overlap-moe-expert-parallel-comm"], 2, "--tune",
     "needs --overlap-moe-expert-parallel-comm"),
    (["--tune", "on", "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size",
      "2"], 4, "--tune", "--pipeline-model-parallel-size 1"),
    (["--tune", "on", "--expert-model-parallel-size", "2", "--train-iters", "18"], 2,
     "--tune", "--train-iters >= 19 (the first step, then 3 of each of 6 paths: combined_1f1b, "
     "combined_1f1b+wgrad, combined_1f1b_paired_ends, combined_1f1b_paired_ends+wgrad, "
     "combined_1f1b+wgrad+w4, sequential)"),
    (["--tune", "off", "--tune-cache", "tuned"], 2, "--tune-cache", "not --tune off"),
    (["--overlap-moe-expert-parallel-comm", "--overlap-probe-steps", "3",
      "--pipeline-model-parallel-size", "2"], 2, "--overlap-probe-steps",
     "--pipeline-model-parallel-size 1"),
    (["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2",
      "--overlap-probe-steps", "3"], 2, "--overlap-probe-steps", "--train-iters >= 7"),
    (["--kernel-backend", "cuda"], 2, "--kernel-backend", "triton"),
    (["--device", "tpu"], 2, "--device", "cpu"),
    (["--device", "cuda"], 2, "--device", "no CUDA device"),
    (["--micro-batch-size", "0"], 2, "--micro-batch-size", ">= 1"),
    (["--seq-length", "1"], 2, "--seq-length", ">= 2"),
    (["--lr", "0"], 2, "--lr", "> 0"),
    (["--min-lr", "1"], 2, "--min-lr", "--lr="),
    (["--clip-grad", "-1"], 2, "--clip-grad", ">= 0"),
    (["--data", "/no/such/file"], 2, "--data", "no such file"),
    (["--data", "stdlib", "--mock-data"], 2, "--mock-data", "--data is given too"),
    (["--data-path", "a", "--mock-data"], 2, "--mock-data", "--data-path is given too"),
    (["--data-path", "a"], 2, "--data-path", "needs --tokenizer-type"),
    (["--data-path", "0.3", "a", "b", "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"],
     2, "--data-path", "looks like a weight"),
    (["--data-path", "0", "a", "0", "b", "--tokenizer-type", "NullTokenizer", "--vocab-size",
      "9"], 2, "--data-path", "not all 0"),
    (["--split", "90,10"], 2, "--split", "--data-path datasets and --mock-data"),
    (["--data-path", "a", "--split", "x", "--tokenizer-type", "NullTokenizer", "--vocab-size",
      "9"], 2, "--split", "proportions"),
    (["--data-path", "a", "--split", "0,1,0", "--tokenizer-type", "NullTokenizer",
      "--vocab-size", "9"], 2, "--split", "train one > 0"),
    (["--mock-data", "--tokenizer-type", "BertWordPieceCase"], 2, "--tokenizer-type",
     "NullTokenizer"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "9"], 2, "--tokenizer-type",
     "raw bytes"),
    (["--mock-data", "--tokenizer-type", "NullTokenizer"], 2, "--vocab-size", ">= 1"),
    (["--mock-data", "--vocab-size", "9"], 2, "--vocab-size", "NullTokenizer"),
    (["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer"], 2, "--tokenizer-model",
     "tokenizer.json"),
    (["--mock-data", "--tokenizer-model", "t.json"], 2, "--tokenizer-model",
     "HuggingFaceTokenizer"),
    (["--tensorboard-dir", "/etc/passwd/tb"], 2, "--tensorboard-dir", "writable"),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2, "--global-batch-size",
     "multiple of --micro-batch-size x ranks = 2 x 2"),
    (["--global-batch-size", "8", "--num-microbatches", "2"], 2, "--global-batch-size",
     "not both"),
    (["--profile-steps", "3"], 2, "--profile-steps", "START:END"),
    (["--profile-steps", "4:2", "--profile-dir", "x"], 2, "--profile-steps", "START <= END"),
    (["--profile-steps", "2:3"], 2, "--profile-steps", "--profile-dir"),
    (["--profile-dir", "x"], 2, "--profile-dir", "--profile-steps"),
    (["--num-experts", "0", "--expert-model-parallel-size", "2"], 2,
     "--expert-model-parallel-size", "without --num-experts"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn"], 2, "--cuda-graph-impl",
     "need a CUDA device"),
    (["--cuda-graph-impl", "full_iteration", "--num-experts", "0"], 2, "--cuda-graph-impl",
     "need a CUDA device"),
    (["--cuda-graph-impl", "full_iteration"], 2, "--cuda-graph-impl", "--moe-dispatch-budget"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe",
      "--moe-dispatch-budget", "2"], 2, "--cuda-graph-modules",
     "--kernel-backend triton"),
    (["--cuda-graph-impl", "full_iteration", "--moe-expert-capacity-factor", "1",
      "--moe-pad-expert-input-to-capacity", "--kernel-backend", "triton"], 2, "--cuda-graph-impl",
     "need a CUDA device"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "mamba"], 2,
     "--cuda-graph-modules", "Mamba"),
    (["--moe-expert-capacity-factor", "0"], 2, "--moe-expert-capacity-factor", "> 0"),
    (["--moe-pad-expert-input-to-capacity"], 2, "--moe-pad-expert-input-to-capacity",
     "needs --moe-expert-capacity-factor"),
    (["--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor", "-1"], 2,
     "--moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor"),
    (["--moe-token-drop-policy", "random"], 2, "--moe-token-drop-policy", "probs, position"),
    (["--moe-expert-capacity-factor", "5", "--moe-pad-expert-input-to-capacity"], 2,
     "--moe-expert-capacity-factor", "num_experts / topk = 4"),
    (["--moe-dispatch-budget", "0"], 2, "--moe-dispatch-budget", "> 0"),
    (["--moe-dispatch-budget", "1.5", "--moe-expert-capacity-factor", "1"], 2,
     "--moe-dispatch-budget", "give one of them"),
    (["--num-experts", "0", "--moe-dispatch-budget", "1"], 2, "--moe-dispatch-budget",
     "needs MoE layers"),
    (["--moe-dispatch-once-per-rank", "--moe-expert-capacity-factor", "1",
      "--moe-pad-expert-input-to-capacity"], 2, "--moe-pad-expert-input-to-capacity",
     "--moe-dispatch-once-per-rank"),
    (["--lr", "inf"], 2, "--lr", "finite"),
    (["--moe-z-loss-coeff", "nan"], 2, "--moe-z-loss-coeff", "finite"),
    (["--adam-beta1", "1"], 2, "--adam-beta1", "[0, 1)"),
    (["--adam-eps", "-1"], 2, "--adam-eps", ">= 0"),
    (["--weight-decay", "-0.1"], 2, "--weight-decay", ">= 0"),
    (["--seed", str(2**63)], 2, "--seed", "2**63"),
    (["--rotary-base", "0"], 2, "--rotary-base", "> 0"),
    (["--moe-router-topk-scaling-factor", "0"], 2, "--moe-router-topk-scaling-factor", "> 0"),
    (["--distributed-timeout-minutes", "0"], 2, "--distributed-timeout-minutes", ">= 0.05"),
    (["--profile-steps", ""], 2, "--profile-steps", "START:END"),
    (["--save", "x", "--save-interval", "0"], 2, "--save-interval", ">= 1"),
    (["--save", ""], 2, "--save", "must name a folder"),
    (["--pipeline-model-parallel-size", "3"], 4, "--pipeline-model-parallel-size",
     "divide the world size 4"),
    (["--pipeline-model-parallel-size", "4"], 4, "--pipeline-model-parallel-size",
     "divide --num-layers=2"),
    (["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "4"], 4,
     "--expert-model-parallel-size", "EP x PP = 4 x 2 must divide the world size 4"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 2,
     "--num-layers-per-virtual-pipeline-stage", "needs --pipeline-model-parallel-size > 1"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     "--num-layers-per-virtual-pipeline-stage", "divide the 2 layers of each stage"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--num-virtual-stages-per-pipeline-rank", "3"], 2,
     "--num-virtual-stages-per-pipeline-rank", "divide the 2 layers of each stage"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage",
      "1"], 2, "--num-virtual-stages-per-pipeline-rank", "not both"),
    (["--pipeline-model-parallel-size", "2", "--num-microbatches", "1"], 2,
     "--num-microbatches", ">= --pipeline-model-parallel-size=2"),
    (["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
      "--micro-batch-size", "2"], 4, "--global-batch-size",
     "gives 1 microbatches per step (/ --micro-batch-size x data-parallel ranks = 2 x 2)"),
    (["--pipeline-model-parallel-size", "2", "--global-batch-size", "6",
      "--micro-batch-size", "2"], 4, "--global-batch-size",
     "multiple of --micro-batch-size x ranks = 2 x 2"),
    (["--pipeline-model-parallel-size", "2", "--cuda-graph-impl", "local",
      "--cuda-graph-modules", "attn"], 2, "--cuda-graph-impl", "not built with"),
])
def test_each_bad_value_names_its_flag(argv, world, flag, fragment):
    error = rejected(argv, world)
    message = str(error).splitlines()[0]  # other rules it breaks: a line each after it
    assert message.startswith(flag + "="), str(error)
    assert fragment.lower() in message.lower(), str(error)


def test_pipeline_flags_resolve_virtual_stages_and_data_parallel_size():
    pp = ["--num-layers", "8", "--pipeline-model-parallel-size", "2"]
    assert parse_config(BASE + pp).virtual_stages == 1
    older = parse_config(BASE + pp + ["--num-layers-per-virtual-pipeline-stage", "2"])
    newer = parse_config(BASE + pp + ["--num-virtual-stages-per-pipeline-rank", "2"])
    assert older.virtual_stages == newer.virtual_stages == 2
    cfg = parse_config(BASE + pp + ["--global-batch-size", "16", "--micro-batch-size", "2"])
    assert cfg.data_parallel_size(8) == 4
    assert cfg.for_world(8).train.num_microbatches == 2  # 16 / (2 x 4 data-parallel ranks)
    check(pp + ["--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm",
                "--delay-wgrad-compute"], world_size=4)


def test_with_pipeline_stages_the_overlap_needs_no_expert_parallelism():
    """The P2P transfers are comm to hide too: PP > 1 alone allows the overlap."""
    check(["--pipeline-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"])
    check(["--pipeline-model-parallel-size", "2", "--num-experts", "0",
           "--overlap-moe-expert-parallel-comm"])


def test_paths_that_are_files_or_folders_where_the_other_is_needed(tmp_path):
    file = tmp_path / "f.txt"
    file.write_text("ab")
    assert "must name a folder" in str(rejected(["--load", str(file)]))
    assert "is a folder" in str(rejected(["--log-json", str(tmp_path)]))
    from epoverlap.training.setup.data import open_data_source
    with pytest.raises(ConfigError) as info:  # the data files are checked with the data source
        open_data_source(parse_config(["--data", str(file)]), 1)
    assert str(info.value).startswith("--data") and "2 bytes" in str(info.value)


def test_argparse_complaints_are_a_usage_line_and_one_error_line_naming_the_flag(capsys):
    for argv, fragment in ((["--num-layers", "x"], "argument --num-layers: invalid int"),
                           (["--no-such-flag"], "unrecognized arguments: --no-such-flag")):
        with pytest.raises(SystemExit) as info:
            parse_config(argv)
        assert info.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 2 and lines[0].startswith("usage: ") and fragment in lines[1], lines


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed (the [test] extra)")
def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    error = rejected(["--kernel-backend", "triton"])
    assert "TRITON_INTERPRET" in str(error)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check(["--kernel-backend", "triton"])


def test_deprecated_cuda_graph_flag_is_migrated_with_a_warning():
    warnings = []
    cfg = parse_config(BASE + ["--enable-cuda-graph"], warn=warnings.append)
    assert cfg.cuda_graph.impl == "local"
    assert any("--cuda-graph-impl local" in w for w in warnings)


def test_the_all_to_alls_former_chunks_flag_is_migrated_to_waves_with_one_warning():
    warnings = []
    cfg = parse_config(BASE + ["--moe-a2a-chunks", "2"], warn=warnings.append)
    assert cfg.overlap.moe_a2a_waves == 2
    assert warnings == ["deprecated: --moe-a2a-chunks -> --moe-a2a-waves 2"]
    warnings.clear()
    assert parse_config(BASE + ["--moe-a2a-waves", "3"], warn=warnings.append
                        ).overlap.moe_a2a_waves == 3 and warnings == []
    with pytest.raises(ConfigError, match="--moe-a2a-chunks=2: deprecated alias of "
                       "--moe-a2a-waves 2, which conflicts with --moe-a2a-waves 3"):
        parse_config(BASE + ["--moe-a2a-chunks", "2", "--moe-a2a-waves", "3"])


def test_negative_capacity_factor_means_dropless_as_in_megatron_core():
    cfg = parse_config(["--moe-expert-capacity-factor", "-1"])
    validate_config(cfg, 2, False)
    assert cfg.moe.capacity_factor is None
    assert parse_config(["--moe-expert-capacity-factor", "1.25"]).moe.capacity_factor == 1.25


def test_moe_layer_pattern():
    cfg = parse_config(BASE + ["--num-layers", "4", "--moe-layer-freq", "2"])
    assert cfg.moe_layer_pattern() == [True, False, True, False]
    cfg = parse_config(BASE + ["--num-layers", "4", "--moe-first-k-dense-replace", "1"])
    assert cfg.moe_layer_pattern() == [False, True, True, True]
    cfg = parse_config(BASE + ["--num-layers", "3", "--moe-layer-freq", "0,1,1"])
    assert moe_layer_pattern(3, cfg.moe) == [False, True, True]


def test_resolved_device_and_backend():
    cfg = parse_config(BASE)
    assert cfg.resolved_device(False) == "cpu"
    assert cfg.resolved_kernel_backend("cpu") == "torch"
    assert cfg.resolved_kernel_backend("cuda") == "triton"


HELP_GOLDEN = Path(__file__).with_name("cli_help.txt")


def test_cli_surface_is_frozen():
    """The CLI surface (every flag, its help and default, the presets) must not drift silently:
    a change shows here as a diff. When it is meant, rewrite the golden file with
    `EPOVERLAP_UPDATE_CLI_HELP=1 python -m pytest tests/config/test_config.py -k frozen`."""
    text = build_parser().format_help()
    if os.environ.get("EPOVERLAP_UPDATE_CLI_HELP"):
        HELP_GOLDEN.write_text(text)
    golden = HELP_GOLDEN.read_text()
    diff = "".join(difflib.unified_diff(golden.splitlines(True), text.splitlines(True),
                                        "cli_help.txt", "--help now"))
    assert text == golden, f"the CLI surface changed:\n{diff}"


@pytest.mark.parametrize("old", [["--deterministic"], ["--profile-torch"],
                                 ["--data", "synthetic"], ["--dist-timeout-minutes", "1"]])
def test_spellings_only_this_project_used_are_gone(old, capsys):
    """Old names no other framework uses were dropped (Megatron-LM's own spellings stay)."""
    if old[0] == "--data":  # --data is a flag of its own: synthetic is now just a missing path
        cfg = parse_config(BASE + old)
        with pytest.raises(ConfigError, match="--data=synthetic: no such file"):
            validate_config(cfg, 1, False)
        return
    with pytest.raises(SystemExit):
        parse_config(BASE + old)
    assert f"unrecognized arguments: {' '.join(old)}" in capsys.readouterr().err


def test_data_flags_parse_as_megatron_core_reads_them():
    cfg = parse_config(BASE + ["--data-path", "0.3", "a", "0.7", "b", "--split", "90,5,5",
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"])
    assert cfg.data.blend == (["a", "b"], [0.3, 0.7])
    assert cfg.data.split_fractions == pytest.approx((0.9, 0.05, 0.05))
    assert cfg.data.text_source is None
    assert parse_config(BASE + ["--data-path", "a", "b"]).data.blend == (["a", "b"], None)
    assert parse_config(BASE).data.text_source == "stdlib"
    assert parse_config(BASE + ["--data-path", "a"]).data.split_fractions == pytest.approx(
        (0.969, 0.03, 0.001))


def test_global_batch_size_sets_the_microbatch_count():
    cfg = parse_config(["--preset", "tiny", "--global-batch-size", "32", "--micro-batch-size",
                        "2"])
    validate_config(cfg, 4, False)
    assert cfg.for_world(4).train.num_microbatches == 4
    assert cfg.for_world(4).for_world(4) == cfg.for_world(4)
    assert parse_config(["--preset", "tiny"]).for_world(4).train.num_microbatches == \
        PRESETS["tiny"]["num_microbatches"]


COPY_ENGINE = ["host_memory", "peer_memory"]  # --moe-a2a-transport's copy-engine transports


@pytest.mark.parametrize("kind", COPY_ENGINE)
@pytest.mark.parametrize("argv, world, fragment", [
    (["--expert-model-parallel-size", "1"], 2, "needs MoE layers and "
     "--expert-model-parallel-size > 1"),
    (["--moe-dispatch-hierarchy", "node", "--emulate-hosts", "2"], 4,
     "not with --moe-dispatch-hierarchy node"),
])
def test_the_copy_engine_transports_refuse_what_they_cannot_carry(kind, argv, world, fragment):
    error = str(rejected(["--moe-a2a-transport", kind] + argv, world))
    line = next(line for line in error.splitlines() if line.startswith("--moe-a2a-transport"))
    assert line.startswith(f"--moe-a2a-transport={kind}: ") and fragment in line, error


@pytest.mark.parametrize("kind", COPY_ENGINE)
def test_the_copy_engine_transports_and_their_slots(kind):
    HOST_MEMORY = ["--moe-a2a-transport", kind]
    check(HOST_MEMORY)
    check(HOST_MEMORY + ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
                         "moe_router", "moe_preprocess"], cuda=True)
    budget = ["--moe-dispatch-budget", "1.25", "--bf16", "--kernel-backend", "triton"]
    check(HOST_MEMORY + budget + ["--cuda-graph-impl", "full_iteration"], cuda=True)
    check(HOST_MEMORY + budget + ["--no-overlap-moe-expert-parallel-comm", "--cuda-graph-impl",
                                  "local", "--cuda-graph-modules", "moe"], cuda=True)


@pytest.mark.parametrize("kind", COPY_ENGINE)
def test_graphs_over_copy_engines_need_split_sizes_fixed_at_capture(kind):
    """A graph that holds the all-to-all replays the sizes it captured: the dispatches that
    read theirs on the host are refused there, in one line naming the flag to add."""
    HOST_MEMORY = ["--moe-a2a-transport", kind]
    for flag, graphs in (("--cuda-graph-impl=full_iteration",
                          ["--cuda-graph-impl", "full_iteration"]),
                         ("--cuda-graph-modules=moe",
                          ["--no-overlap-moe-expert-parallel-comm", "--cuda-graph-impl",
                           "local", "--cuda-graph-modules", "moe"])):
        error = str(rejected(HOST_MEMORY + ["--bf16", "--kernel-backend", "triton"] + graphs,
                             cuda=True))
        assert len(error.splitlines()) == 1 and error.startswith(flag + ": ") \
            and "--moe-dispatch-budget" in error, error
    assert str(rejected(HOST_MEMORY + ["--moe-a2a-host-slot-kib", "2"])) == \
        "--moe-a2a-host-slot-kib=2: must be in [4, 1048576] KiB"
    assert "--moe-a2a-transport=nvlink" in str(rejected(["--moe-a2a-transport", "nvlink"]))
