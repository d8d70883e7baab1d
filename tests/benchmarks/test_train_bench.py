"""benchmarks/harness/train_bench.py: the benchmark-only flags (--comm-mode local_copy,
--local-copy-hold-us) are the harness's, not the training command's; they reach the config's
fields and keep their one-line rules. Their run (spans, holds): tests/schedule/
test_local_copy_hold.py, through `train_bench.main`."""

from __future__ import annotations

import pytest

from epoverlap.config import build_parser, parse_config, validate_config
from epoverlap.errors import ConfigError

from benchmarks.harness import train_bench

TINY = ["--preset", "tiny", "--mock-data", "--train-iters", "2"]


def test_the_training_command_has_no_benchmark_only_flag():
    help_text = build_parser().format_help()
    assert "--comm-mode" not in help_text and "--local-copy-hold-us" not in help_text
    with pytest.raises(SystemExit) as stop:
        parse_config(TINY + ["--comm-mode", "local_copy"])
    assert stop.value.code == 2


def test_the_harness_sets_the_fields_and_passes_every_other_flag_on():
    cfg = train_bench.parse_config(TINY + ["--comm-mode", "local_copy", "--hidden-size", "96",
                                           "--local-copy-hold-us", "250"])
    assert (cfg.overlap.comm_mode, cfg.overlap.local_copy_hold_us) == ("local_copy", 250)
    assert cfg.model.hidden_size == 96
    plain = train_bench.parse_config(TINY)
    assert (plain.overlap.comm_mode, plain.overlap.local_copy_hold_us) == ("real", 0)
    assert plain == parse_config(TINY)


@pytest.mark.parametrize("argv, fragment", [
    (["--comm-mode", "local_copy", "--local-copy-hold-us", "-1"], "must be >= 0"),
    (["--local-copy-hold-us", "4000"], "needs --comm-mode local_copy"),
])
def test_a_bad_hold_is_refused_in_one_line_naming_the_flag(argv, fragment):
    with pytest.raises(ConfigError) as info:
        validate_config(train_bench.parse_config(TINY + argv), 2, False)
    message = str(info.value).splitlines()[0]
    assert message.startswith("--local-copy-hold-us=") and fragment in message, message


def test_an_unknown_comm_mode_is_refused_with_the_allowed_ones(capsys):
    with pytest.raises(SystemExit) as stop:
        train_bench.parse_config(TINY + ["--comm-mode", "fake"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--comm-mode" in err and "local_copy" in err
