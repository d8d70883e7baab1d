"""What two compared runs resolved to, for tests that claim their sides differ: where a test
compares the overlap with the sequential schedule, graphs with eager, reducing grads beside the
backward with after it, ..., it checks that the two runs' resolved `path:` lines (or, for what
the path line does not name, their `config:` lines) differ in that part, so an `auto` default
cannot quietly make both sides the same run.

A run's record is the two lines the training command prints (`epoverlap.cli.train`): `config:`
(`config.parse.flags_text`, the resolved flags) and `path:` (`config.resolve.path_text`). A
path line's parts, by name: `dispatch`, `graphs`, `schedule`, `delayed wgrad`, `levers`,
`precision` (bf16 or fp32), `auto` (the flags an auto default set); a tuned run has `schedule
and delayed wgrad` instead of the two.
"""

from __future__ import annotations

from pathlib import Path

from epoverlap.config.parse import flags_text
from epoverlap.config.resolve import path_text

PREFIX = "path: "
CONFIG = "config: "
NAMED = ("schedule and delayed wgrad: ", "set by auto defaults: ", "delayed wgrad ",
         "dispatch ", "graphs ", "schedule ", "levers ")
SHORT = {"set by auto defaults: ": "auto"}
SCHEDULE_PARTS = ("schedule", "delayed wgrad", "schedule and delayed wgrad")


def run_record(trainer) -> list[str]:
    """A built `Trainer`'s `config:` and `path:` lines (its resolved config, on its device)."""
    cfg = trainer.cfg
    return [CONFIG + flags_text(cfg), path_text(cfg, trainer.groups.device.type)]


def write_run_record(trainer, out_dir, name: str) -> None:
    """`run_record` to OUT_DIR/NAME.path (rank 0; every rank resolves the same)."""
    if trainer.groups.rank == 0:
        (Path(out_dir) / f"{name}.path").write_text("\n".join(run_record(trainer)) + "\n")


def read_run_record(out_dir, name: str) -> list[str]:
    return (Path(out_dir) / f"{name}.path").read_text().splitlines()


def record_of_output(text: str) -> list[str]:
    """The `config:` and `path:` lines of a training command's output."""
    return [line for line in text.splitlines() if line.startswith((CONFIG, PREFIX))]


def _line(lines: list[str], prefix: str) -> str:
    found = [line for line in lines if line.startswith(prefix)]
    assert len(found) == 1, (prefix, lines)
    return found[0]


def path_parts(lines: list[str]) -> dict[str, str]:
    """The path line's parts by name (module docstring)."""
    parts = {}
    for segment in _line(lines, PREFIX)[len(PREFIX):].split(" | "):
        name = next((n for n in NAMED if segment.startswith(n)), None)
        if name is None:
            parts["precision"] = segment
            continue
        parts[SHORT.get(name, name.rstrip(": "))] = segment[len(name):]
    return parts


def assert_paths_differ(a: list[str], b: list[str], *names: str) -> None:
    """Each named part of the two runs' path lines differs."""
    parts_a, parts_b = path_parts(a), path_parts(b)
    for name in names:
        assert name in parts_a and name in parts_b, (name, a, b)
        assert parts_a[name] != parts_b[name], \
            f"both runs have {name} {parts_a[name]!r}: {_line(a, PREFIX)}"


def assert_schedules_differ(a: list[str], b: list[str]) -> None:
    """The two runs differ in schedule or delayed weight grads (or one is tuned)."""
    parts_a, parts_b = path_parts(a), path_parts(b)
    schedule = [tuple(parts.get(name) for name in SCHEDULE_PARTS) for parts in (parts_a, parts_b)]
    assert schedule[0] != schedule[1], f"both runs have the same schedule: {_line(a, PREFIX)}"


def assert_flag_differs(a: list[str], b: list[str], flag: str) -> None:
    """One run's resolved config sets `flag` (a switch) and the other's does not."""
    on = [flag in _line(lines, CONFIG)[len(CONFIG):].split() for lines in (a, b)]
    assert on[0] != on[1], f"both runs have {flag} {'on' if on[0] else 'off'}: {_line(a, CONFIG)}"
