"""Error types shared by the config layer and the runtime.

ConfigError is raised for any bad flag value or combination; its message is one line that names
the flag (as the user typed it on the command line), the value given, and what is allowed.
The training entry point prints that line and exits with status 2 before touching any process
group.

Deprecated flag spellings are migrated in one way everywhere (the CUDA-graph forms in
`graphs/config.py`, the renamed flags in `config.py`): an old form alone is accepted with one
warning line `deprecation_note(old, new)`, emitted only once the whole command line is accepted;
an old form that disagrees with the new flag given beside it is `alias_conflict`, naming the
deprecated flag as the one to drop.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value: `--flag=value: what is allowed`."""

    def __init__(self, flag: str, value: object, allowed: str):
        self.flag = flag if flag.startswith("--") else "--" + flag.replace("_", "-")
        self.value = value
        self.allowed = allowed
        super().__init__(f"{self.flag}={_show(value)}: {allowed}")


def deprecation_note(old: str, new: str) -> str:
    """The one warning line of an accepted deprecated form, e.g. `deprecated: --a 1 -> --b 1`."""
    return f"deprecated: {old} -> {new}"


def alias_conflict(old_flag: str, old_value: object, new: str, given: str) -> ConfigError:
    """A deprecated form (`old_flag`, meaning `new`) given beside a new flag saying `given`."""
    return ConfigError(old_flag, old_value, f"deprecated alias of {new}, which conflicts with "
                       f"{given}; drop {old_flag}")


def _show(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) if value else "(empty)"
    return str(value)
