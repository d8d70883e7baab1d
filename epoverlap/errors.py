"""Error types shared by the config layer and the runtime.

ConfigError is raised for any bad flag value or combination; its message is one line that names
the flag (as the user typed it on the command line), the value given, and what is allowed.
The training entry point prints that line and exits with status 2 before touching any process
group. Every refusal of one command line comes in one ConfigErrors, one line each, in one run:
arguments no flag takes (argparse's `unrecognized arguments: ...`, all of them on one line,
UnknownArguments), refused Megatron-LM flags, values refused, rules broken. (A value of the wrong
type is argparse's usage line plus one error line, status 2, at once.) CheckpointError is a --load that cannot be used (missing, corrupt, or
written for another model): one line naming the file and the mismatch, also exit status 2.
NonFiniteError is a NaN/Inf loss or gradient caught by --check-for-nan-in-loss-and-grad.

Deprecated flag spellings are migrated in one way everywhere: `epoverlap.config.aliases`.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value: `--flag=value: what is allowed`."""

    def __init__(self, flag: str, value: object, allowed: str):
        self.flag = flag if flag.startswith("--") else "--" + flag.replace("_", "-")
        self.value = value
        self.allowed = allowed
        super().__init__(f"{self.flag}={_show(value)}: {allowed}")


class UnknownArguments(ConfigError):
    """Arguments no flag takes, as argparse says it: `unrecognized arguments: --x 1 --y`."""

    def __init__(self, arguments: list[str]):
        super().__init__(arguments[0], " ".join(arguments), "not a flag of this command")
        self.arguments = arguments

    def __str__(self) -> str:
        return "unrecognized arguments: " + " ".join(self.arguments)


class ConfigErrors(ConfigError):
    """Several refusals of one command line: one line each (the first's flag, value and allowed
    are this error's)."""

    def __init__(self, errors: list[ConfigError]):
        first = errors[0]
        super().__init__(first.flag, first.value, first.allowed)
        self.errors = errors

    def __str__(self) -> str:
        return "\n".join(str(error) for error in self.errors)


def raise_together(errors: list[ConfigError]) -> None:
    """Raise every refusal in `errors` at once (none: return): one line per flag, the first
    line said of a flag wins (several of its rules broken are one line)."""
    lines: dict[str, ConfigError] = {}
    for error in errors:
        for one in getattr(error, "errors", [error]):
            lines.setdefault(one.flag if not isinstance(one, UnknownArguments) else "", one)
    if len(lines) == 1:
        raise next(iter(lines.values()))
    if lines:
        raise ConfigErrors(list(lines.values()))


class CheckpointError(ConfigError):
    """`--load=DIR: FILE: what is wrong`, raised identically on every rank."""

    def __init__(self, load: str, path: object, problem: str):
        super().__init__("--load", load, f"{path}: {problem}")


class NonFiniteError(FloatingPointError):
    """A NaN/Inf loss or gradient found before the optimizer step (message: step, rank, where)."""


def _show(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) if value else "(empty)"
    return str(value)
