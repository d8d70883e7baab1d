"""The command line: every bad input is one line and exit status 2 before training starts
(before any process group exists), from `epoverlap-train` and from `epoverlap-launch` (which
checks before it starts a rank); one usage block per argparse error, printed by the first rank
of a node only; --help shows defaults and what each preset sets; no prefix matching; the CPU
path never imports triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from epoverlap.config import build_parser
from epoverlap.cli import launch
from epoverlap.cli.train import main as train_main
from job_control import REPO, job_env

TINY = ["--preset", "tiny", "--mock-data"]


def _bad_inputs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return [
        (["--seq-length", "100000000"], "--seq-length=100000000: needs about"),
        (["--num-layers", "512", "--hidden-size", "8192", "--num-attention-heads", "64"],
         "--hidden-size=8192: needs about"),
        (["--profile-steps", "1:1", "--profile-dir", str(a_file / "spans")],
         f"--profile-dir={a_file / 'spans'}: {a_file} is a file, not a folder"),
        (["--profile-steps", "1:1", "--profile-dir", "/proc/epoverlap-spans"],
         "--profile-dir=/proc/epoverlap-spans: cannot create a file in /proc"),
        (["--log-json", str(tmp_path)], f"--log-json={tmp_path}: is a folder"),
        (["--log-json", str(a_file / "log.jsonl")], "--log-json="),
        (["--use-pytorch-profiler", "--profile-steps", "1:1", "--profile-dir", str(tmp_path)],
         "--use-pytorch-profiler=True: needs a CUDA device"),
        (["--use-pytorch-profiler"], "--use-pytorch-profiler=True: needs --profile-steps"),
        (["--distributed-timeout-minutes", "0.01"], "--distributed-timeout-minutes=0.01: must be"),
        (["--enable-cuda-graph", "--cuda-graph-impl", "full_iteration"],
         "--enable-cuda-graph=True: deprecated alias of --cuda-graph-impl local, which conflicts "
         "with --cuda-graph-impl full_iteration; drop --enable-cuda-graph"),
        (["--overlap-grad-reduce", "--cuda-graph-impl", "full_iteration"],
         "--overlap-grad-reduce=True: not with --cuda-graph-impl full_iteration"),
        (["--make-vocab-size-divisible-by", "0"],
         "--make-vocab-size-divisible-by=0: must be >= 1 (1: the vocabulary unpadded)"),
    ]


def _one_error_line(captured, prog: str, expected: str) -> None:
    lines = captured.err.splitlines()  # the first names it; other rules broken follow
    assert all(line.startswith(f"{prog}: error: ") for line in lines), captured.err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_each_bad_input_is_one_line_and_status_2_from_the_training_command(tmp_path, capsys):
    for flags, expected in _bad_inputs(tmp_path):
        assert train_main(TINY + flags) == 2, flags
        _one_error_line(capsys.readouterr(), "epoverlap-train", expected)


def test_the_launcher_checks_every_bad_input_before_starting_ranks(tmp_path, capsys):
    for flags, expected in _bad_inputs(tmp_path) + [
            (["--nproc", "abc"], "--nproc=abc: a positive integer"),
            (["--nproc", "-1"], "--nproc=-1: must be >= 1"),
            (["--nproc", "0"], "--nproc=0: must be >= 1")]:
        assert launch.main(flags) == 2, flags  # returns before torchrun starts anything
        _one_error_line(capsys.readouterr(), "epoverlap-launch", expected)


def test_the_start_up_line_names_the_unaligned_gemm_dimensions(capfd):
    """After the banner, one line: each GEMM dimension that is not a multiple of 8 elements and
    the flags that set it (here the hidden size, head dim, key/value width and the unpadded
    vocabulary 100 + 1)."""
    assert train_main(TINY + ["--train-iters", "1", "--hidden-size", "60", "--num-attention-heads",
                              "6", "--seq-length", "32", "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", "100", "--make-vocab-size-divisible-by", "1"]) == 0
    lines = capfd.readouterr().out.splitlines()
    banner = next(i for i, line in enumerate(lines) if line.startswith("epoverlap: world"))
    assert lines[banner + 1] == (
        "unaligned GEMMs: hidden size 60 (--hidden-size); head dim 10 (--hidden-size / "
        "--num-attention-heads); key/value width 20 (--num-query-groups x head dim); "
        "vocabulary 101 (the data's tokenizer, padded to a multiple of "
        "--make-vocab-size-divisible-by 1): not multiples of 8 elements, so their tensor-core "
        "GEMMs run several times slower")
    assert sum(line.startswith("unaligned GEMMs") for line in lines) == 1


@pytest.mark.parametrize("entry, prog", [(train_main, "epoverlap-train"),
                                         (launch.main, "epoverlap-launch")])
def test_no_prefix_matching_and_one_short_usage_block(entry, prog, capsys):
    with pytest.raises(SystemExit) as info:
        entry(["--train", "1", "--num-exp", "4"])  # not --train-iters / --num-experts
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"usage: {prog} "), lines
    assert lines[1] == f"{prog}: error: unrecognized arguments: --train 1 --num-exp 4"


def test_other_ranks_of_a_node_exit_2_quietly(monkeypatch, capsys):
    from epoverlap.cli import train as main_module
    monkeypatch.setattr(main_module, "QUIET_RANK_PAUSE_S", 0.0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert train_main(TINY + ["--seq-length", "100000000"]) == 2
    with pytest.raises(SystemExit) as info:
        train_main(["--train", "1"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_help_shows_defaults_and_what_each_preset_sets():
    text = build_parser().format_help()
    assert "model width (default: 128)" in " ".join(text.split())
    assert "(default: off unless given)" in text
    presets = text[text.index("presets (--preset NAME sets these"):]
    tiny = presets[presets.index("  tiny"):]
    assert tiny.split()[1:5] == ["--num-layers", "2", "--hidden-size", "128"]
    assert "  dsv3-proxy" in presets and "--moe-router-enable-expert-bias" in presets
    assert "--distributed-timeout-minutes" in text and "deprecated: use " in text


NO_TRITON = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None  # any import of triton fails
    from epoverlap.config import parse_config, validate_config
    from epoverlap.errors import ConfigError
    from epoverlap.cli.train import main
    status = main(["--preset", "tiny", "--mock-data", "--train-iters", "2",
                   "--hidden-size", "64", "--seq-length", "64", "--num-microbatches", "2"])
    try:
        validate_config(parse_config(["--kernel-backend", "triton"]), 1, False)
    except ConfigError as error:
        print(error)
    sys.exit(status)
""")


@pytest.mark.slow
def test_cpu_training_never_imports_triton():
    result = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True,
                            env=job_env(), cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 2 steps" in result.stdout
    assert ("--kernel-backend=triton: triton is not installed: pip install -e '.[triton]'"
            in result.stdout)


@pytest.mark.slow
def test_under_torchrun_a_bad_flag_prints_one_usage_block():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "epoverlap.train", "--preset", "tiny", "--train", "1"],
        capture_output=True, text=True, env=job_env(), cwd=REPO, timeout=300)
    assert result.returncode == 1  # torchrun's own status for any failed rank
    assert result.stderr.count("usage: epoverlap-train") == 1, result.stderr
    assert result.stderr.count("epoverlap-train: error: unrecognized arguments") == 1


def test_the_launcher_names_a_ranks_exit_before_the_kill_it_caused_in_the_same_second():
    """torch elastic stamps failures in whole seconds: a rank that exited with status 3 and
    the stopped rank the launcher then killed share one; the line and the status put the exit
    first, whatever order torch lists them in."""
    from types import SimpleNamespace

    from epoverlap.cli.launch import _failure_order, _failures_line
    failures = {1: SimpleNamespace(timestamp=100, exitcode=-9),
                0: SimpleNamespace(timestamp=100, exitcode=3)}
    assert _failures_line(failures) == \
        "rank 0 exited with status 3; rank 1 was killed by SIGKILL"
    assert min(failures.items(), key=_failure_order)[0] == 0
    failures[1].timestamp = 99  # a kill a second earlier is the first failure
    assert _failures_line(failures).startswith("rank 1 was killed by SIGKILL")
