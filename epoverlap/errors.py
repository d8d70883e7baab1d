"""Error types shared by the config layer and the runtime.

ConfigError is raised for any bad flag value or combination; its message is one line that names
the flag (as the user typed it on the command line), the value given, and what is allowed.
The training entry point prints that line and exits with status 2 before touching any process
group.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value: `--flag=value: what is allowed`."""

    def __init__(self, flag: str, value: object, allowed: str):
        self.flag = flag if flag.startswith("--") else "--" + flag.replace("_", "-")
        self.value = value
        self.allowed = allowed
        super().__init__(f"{self.flag}={_show(value)}: {allowed}")


def _show(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) if value else "(empty)"
    return str(value)
