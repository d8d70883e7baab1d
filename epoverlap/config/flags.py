"""How a config field becomes a command-line flag, and the command line a config.

A field is a flag when it is declared with `flag(default, help, ...)` beside its dataclass
field: the flag's name (`--field-name` unless given), its help, its allowed values, its
Megatron-LM spelling where that differs from ours, its own former name (still accepted and
migrated with a `deprecated:` warning, `config.parse`), and the help group it is listed under. Its
type is the field's annotation: int, float, str, bool (a switch), Optional[bool] (a switch
whose default None is resolved from the job, `config.resolve`; it has a --no- form),
Optional[int] / Optional[float] (where `none` reads as None) or tuple[str, ...] (several
values). Nothing else defines a flag:
`build_parser` generates the argparse surface from the dataclasses of `RunConfig`, and
`given_values` reads a parsed namespace back into {(section, field): value} for the fields given.

The parser (`CliParser`) has no prefix matching (`--train 1` is an error, as in Megatron-LM),
a one-line usage, each flag's default in its help, and, at its end, what each preset sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Optional

HELP_WIDTH = 100  # --help is laid out for this many columns, whatever the terminal


@dataclass(frozen=True)
class Flag:
    """What the command line knows of one config field."""

    help: str
    name: Optional[str] = None  # default: "--" + the field name with dashes
    choices: tuple[str, ...] = ()
    megatron: Optional[str] = None  # Megatron-LM's spelling where it differs (accepted too)
    old_name: Optional[str] = None  # our former name: accepted, warned (not for switches yet)
    nargs: Optional[str] = None  # for tuple fields: "+" (default) or "*"
    group: Optional[str] = None  # the --help section it is listed in (None: the main one)
    default_text: Optional[str] = None  # how --help shows the default, where str() would not do
    metavar: Optional[str] = None  # the value's name in --help (default: by type)
    why: Optional[str] = None  # why only `choices` are allowed (said when another is given)
    note: Optional[str] = None  # a Megatron-LM flag accepted with no effect here: what is done
    negatable: bool = False  # a switch that also has a --no- form (auto switches always do)


def flag(default: Any, help: str, **facts: Any) -> Any:
    """A dataclass field that is also a command-line flag (see `Flag` for `facts`)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **facts)})


@dataclass(frozen=True)
class FlagField:
    """One flag as the parser sees it: its config section, field, type and facts."""

    section: str
    field: dataclasses.Field
    flag: Flag
    kind: Any  # int, float, str, bool, tuple (several strings), or an optional parser below

    @property
    def name(self) -> str:
        return self.flag.name or "--" + self.field.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return dest_of(self.name)

    @property
    def option_strings(self) -> list[str]:
        return [self.name] + ([self.flag.megatron] if self.flag.megatron else [])

    def value(self, cfg) -> Any:
        """This flag's value in `cfg` (a RunConfig)."""
        return getattr(getattr(cfg, self.section), self.field.name)

    def metavar(self) -> str:
        if self.flag.metavar:
            return self.flag.metavar
        if self.flag.choices:
            return "NAME"
        return {int: "N", _opt_int: "N", float: "X", _opt_float: "X"}.get(self.kind, "TEXT")

    def default_text(self) -> str:
        if self.flag.default_text is not None:
            return self.flag.default_text
        default = self.field.default
        if self.kind is bool:
            return "on" if default else "off unless given"
        if default is None or default == ():
            return "none"
        return " ".join(default) if isinstance(default, tuple) else str(default)

    def help_text(self) -> str:
        if self.flag.note:
            return f"{self.flag.help} (accepted; no effect: {self.flag.note})"
        allowed = f"one of: {', '.join(self.flag.choices)}; " if self.flag.choices else ""
        old = f"; {self.flag.old_name}: its deprecated name" if self.flag.old_name else ""
        return f"{self.flag.help} ({allowed}default: {self.default_text()}{old})"

    def allowed_text(self) -> str:
        """What a value outside `choices` is told."""
        text = f"allowed: {', '.join(self.flag.choices)}"
        return f"{text} ({self.flag.why})" if self.flag.why else text


def _opt_int(text: str) -> Optional[int]:
    return None if text.lower() in ("none", "") else int(text)


def _opt_float(text: str) -> Optional[float]:
    return None if text.lower() in ("none", "") else float(text)


def _kind(annotation: Any) -> Any:
    """The flag type of a field annotation (resolved by typing.get_type_hints)."""
    if annotation in (int, float, str, bool):
        return annotation
    args = typing.get_args(annotation)
    if set(args) == {bool, type(None)}:  # an auto switch: None until resolved
        return bool
    if typing.get_origin(annotation) is tuple:
        return tuple
    if type(None) in args:  # Optional[X]
        inner = next(a for a in args if a is not type(None))
        return {int: _opt_int, float: _opt_float, str: str}[inner]
    raise TypeError(f"no flag type for annotation {annotation!r}")


def section_flags(section: str, cls: type) -> Iterator[FlagField]:
    """The flags of one config dataclass, in field order."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        meta = field.metadata.get("flag")
        if meta is not None:
            yield FlagField(section, field, meta, _kind(hints[field.name]))


class CliParser(argparse.ArgumentParser):
    """argparse without prefix matching; with `printing` False (every rank but the first of a
    node) usage, help and errors stay silent while the exit status is the same, so a torchrun
    job prints one usage block, not one per rank."""

    def __init__(self, *args, printing: bool = True, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.printing = printing

    def print_usage(self, file=None) -> None:
        if self.printing:
            super().print_usage(file)

    def print_help(self, file=None) -> None:
        if self.printing:
            super().print_help(file)

    def exit(self, status=0, message=None):
        super().exit(status, message if self.printing else None)


def help_formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, width=HELP_WIDTH, max_help_position=36)


def add_flags(parser: argparse.ArgumentParser, flags: list[FlagField],
              titles: Optional[dict[str, str]] = None) -> None:
    """Register `flags`, each with default None (so "not given" is visible), listed in --help
    under their group, else their section's title in `titles`."""
    groups: dict[Optional[str], Any] = {None: parser}
    for item in flags:
        title = item.flag.group or (titles or {}).get(item.section)
        target = groups.get(title)
        if target is None:
            target = groups[title] = parser.add_argument_group(title)
        _add_flag(target, item)


def _add_flag(target, item: FlagField) -> None:
    kwargs: dict[str, Any] = dict(dest=item.dest, default=None, help=item.help_text())
    if item.kind is bool:  # a switch: --x sets True; a negatable one's --no-x sets False
        target.add_argument(*item.option_strings, action="store_const", const=True, **kwargs)
        if item.flag.negatable or item.field.default is None:
            target.add_argument("--no-" + item.name[2:], dest=item.dest, default=None,
                                action="store_const", const=False,
                                help=f"turns {item.name} off")
        return
    kwargs["metavar"] = item.metavar()
    if item.kind is tuple:
        kwargs["nargs"] = item.flag.nargs or "+"
    else:
        kwargs["type"] = item.kind
    target.add_argument(*item.option_strings, **kwargs)
    if item.flag.old_name:  # its own dest, so that parse can tell it was given and migrate it
        target.add_argument(item.flag.old_name, **{**kwargs, "dest": dest_of(item.flag.old_name),
                                                   "help": argparse.SUPPRESS})


def dest_of(name: str) -> str:
    """The namespace attribute of a flag's name: `--moe-a2a-waves` -> `moe_a2a_waves`."""
    return name.lstrip("-").replace("-", "_")


def given_values(args: argparse.Namespace, flags: list[FlagField]
                 ) -> dict[tuple[str, str], Any]:
    """{(section, field): value} for every flag given on the command line (tuples for lists)."""
    values = {}
    for item in flags:
        value = getattr(args, item.dest)
        if value is not None:
            values[(item.section, item.field.name)] = tuple(value) if item.kind is tuple \
                else value
    return values


def presets_help(presets: dict[str, dict], flag_of) -> str:
    """What each preset sets, as flags (the --help epilog)."""
    lines = ["presets (--preset NAME sets these; flags given explicitly win):"]
    for name in sorted(presets):
        flags = " ".join(flag_of(key) if value is True else f"{flag_of(key)} {value}"
                         for key, value in presets[name].items())
        lines += textwrap.wrap(flags, width=HELP_WIDTH - 4, initial_indent=f"  {name:<20}",
                               subsequent_indent=" " * 22, break_on_hyphens=False,
                               break_long_words=False)
    return "\n".join(lines)
