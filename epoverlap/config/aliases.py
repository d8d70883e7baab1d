"""Deprecated flag spellings: the one way an old form is migrated to the flag that replaced it.

Owns `FlagAlias` (old form -> new flag and value), `apply_aliases` (migrates the given values,
rejects an old form that contradicts the new flag given beside it) and the two message formats
every migration uses (the CUDA-graph flags' deprecated forms, `config.cuda_graphs`):

  warning  `deprecated: OLD -> NEW`, emitted once the whole command line is accepted
  error    ConfigError on OLD: `deprecated alias of NEW, which conflicts with OTHER; drop OLD`

Imports only `errors`.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional

from epoverlap.errors import ConfigError

_ANY = object()


class FlagAlias(NamedTuple):
    """`old` (optionally only its value `old_value`) means `new` set to `value`.

    value None: the value given to `old` carries over (a plain rename).
    """

    old: str
    new: str
    value: object = None
    old_value: object = _ANY

    def applies_to(self, given: object) -> bool:
        return given is not None and given is not False and (
            self.old_value is _ANY or given == self.old_value)

    def old_text(self) -> str:
        return self.old if self.old_value is _ANY else f"{self.old} {self.old_value}"

    def meaning(self, given: object) -> object:
        return given if self.value is None else self.value


def flag_with_value(flag: str, value: object) -> str:
    """How a flag and its value are typed: switches (True) alone, lists space-separated."""
    if value is True:
        return flag
    if isinstance(value, (list, tuple)):
        return " ".join([flag, *map(str, value)])
    return f"{flag} {value}"


def deprecation_note(old: str, new: str) -> str:
    return f"deprecated: {old} -> {new}"


def alias_conflict(old_flag: str, old_value: object, meaning: str, other: str) -> ConfigError:
    return ConfigError(old_flag, old_value, f"deprecated alias of {meaning}, which conflicts "
                       f"with {other}; drop {old_flag}")


def apply_aliases(given: Mapping[str, object], aliases: tuple[FlagAlias, ...],
                  dest_of: Callable[[str], str], notes: list[str]) -> dict[str, object]:
    """Given values by dest (None: not given) -> the same with every old form migrated.

    Appends one `deprecated:` note per migrated form to `notes`; raises ConfigError naming the
    old flag when it contradicts the new flag's given value (agreeing forms are accepted).
    """
    values = dict(given)
    for alias in aliases:
        old_dest, new_dest = dest_of(alias.old), dest_of(alias.new)
        old = values.get(old_dest)
        if not alias.applies_to(old):
            continue
        meaning = alias.meaning(old)
        current: Optional[object] = values.get(new_dest)
        if current is not None and current != meaning:
            raise alias_conflict(alias.old, old, flag_with_value(alias.new, meaning),
                                 flag_with_value(alias.new, current))
        values[new_dest] = meaning
        values[old_dest] = None
        notes.append(deprecation_note(alias.old_text(), flag_with_value(alias.new, meaning)))
    return values
