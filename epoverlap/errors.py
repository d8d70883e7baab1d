"""Error types shared by the config layer and the runtime.

ConfigError is raised for any bad flag value or combination; its message is one line that names
the flag (as the user typed it on the command line), the value given, and what is allowed.
The training entry point prints that line and exits with status 2 before touching any process
group. (argparse's own complaints, an unknown flag or a value of the wrong type, are its usage
line plus one error line, status 2.) CheckpointError is a --load that cannot be used (missing, corrupt, or
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
