"""The command line of the training command, generated from the config sections' flags.

`build_parser` registers every flag `config.sections` declares (and the CUDA-graph flags with
their deprecated forms), `config_from_args` / `parse_config` build a `RunConfig` from defaults,
then the preset, then the flags given (old CUDA-graph spellings and our flags' former names,
`Flag.old_name`, migrated, one warning each once the whole command line is accepted).
`read_command_line` also returns the refusals of the flags themselves (arguments no flag takes,
refused Megatron-LM flags) instead of raising them, so the training command names them beside
the rules' refusals in one run. No validation here: `config.validate`.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from epoverlap.config.aliases import FlagAlias, apply_aliases
from epoverlap.config.compat import add_refused_flags, compat_notes, refused_flags
from epoverlap.config.cuda_graphs import add_cuda_graph_args, cuda_graph_config_from_args
from epoverlap.config.flags import (CliParser, FlagField, add_flags, dest_of, given_values,
                                    help_formatter, presets_help, section_flags)
from epoverlap.config.presets import PRESETS
from epoverlap.config.run import SECTIONS, RunConfig
from epoverlap.errors import ConfigError, UnknownArguments, raise_together

USAGE = "%(prog)s [--preset NAME] [FLAG VALUE ...]   (--help lists every flag)"
SECTION_TITLES = {
    "model": "model", "moe": "mixture of experts", "parallel": "parallelism",
    "train": "training", "overlap": "EP overlap", "kernels": "kernels", "data": "data",
    "log": "logging and profiling", "checkpoint": "checkpoints", "eval": "evaluation"}

# Every flag of the training command, in --help order.
FLAGS: list[FlagField] = [item for section, cls in SECTIONS.items()
                          for item in section_flags(section, cls)]
_PLAIN = [item for item in FLAGS if item.section != "cuda_graph"]  # the CUDA graphs' are migrated
_BY_FIELD = {item.field.name: item for item in FLAGS}
# Our flags' former names, each migrated to the flag that replaced it (`config.aliases`).
RENAMED = tuple(FlagAlias(item.flag.old_name, item.name) for item in _PLAIN if item.flag.old_name)
assert len(_BY_FIELD) == len(FLAGS), "two sections declare a flag field of the same name"
# The allowed values of every flag that takes a name, by flag (the config fuzz test draws here).
CHOICES: dict[str, tuple[str, ...]] = {item.name: item.flag.choices for item in FLAGS
                                       if item.flag.choices}


def flag_of(field_name: str) -> str:
    """The CLI flag of a config field (for messages)."""
    item = _BY_FIELD.get(field_name)
    return item.name if item else "--" + field_name.replace("_", "-")


def require(ok: bool, field_name: str, value: object, allowed: str) -> None:
    """Every rule's one check: ConfigError naming the field's flag, the value, what is allowed."""
    if not ok:
        raise ConfigError(flag_of(field_name), value, allowed)


def accepted_notes(cfg: RunConfig) -> list[str]:
    """'--flag (what is done instead)' for each Megatron-LM flag given that changes nothing here
    (config.compat), for the one line the training command prints about them: the flags that
    never change anything, then the values that change nothing beside the other flags given."""
    notes = []
    for item in FLAGS:
        if item.flag.note:
            value = item.value(cfg)
            if value not in (None, False):
                notes.append(f"{item.name} ({item.flag.note})")
    return notes + compat_notes(cfg)


def flags_text(cfg: RunConfig) -> str:
    """The flags that give `cfg` from the defaults, as one command line: the resolved
    configuration, compact (derived values included, e.g. microbatches from a global batch)."""
    parts = []
    for item in FLAGS:
        value = item.value(cfg)
        if value == item.field.default or value is None:
            continue
        if item.kind is bool:  # an auto switch resolved off reads as its --no- form
            parts.append(item.name if value else "--no-" + item.name[2:])
        elif item.kind is tuple:
            parts.append(" ".join([item.name, *map(str, value)]))
        else:
            parts.append(f"{item.name} {value}")
    return " ".join(parts)


def build_parser(prog: str = "epoverlap-train", printing: bool = True) -> CliParser:
    parser = CliParser(
        prog=prog, usage=USAGE, printing=printing, epilog=presets_help(PRESETS, flag_of),
        formatter_class=help_formatter,
        description="Train an MoE language model with expert parallelism (and EP overlap).\n"
                    "Defaults below are those without --preset.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, metavar="NAME",
                        help=f"one of {', '.join(sorted(PRESETS))}: named model/run sizes "
                             "(what each sets: the list at the end); explicit flags win")
    add_flags(parser, _PLAIN, SECTION_TITLES)
    add_cuda_graph_args(parser)
    add_refused_flags(parser)
    return parser


def config_from_args(args: argparse.Namespace,
                     warn: Callable[[str], None] = lambda msg: None,
                     refuse: bool = True) -> RunConfig:
    """Defaults <- preset <- explicit flags. No validation here (see config.validate). With
    `refuse`, refused Megatron-LM flags given raise (one line each); without, they are left to
    the caller (`read_command_line`)."""
    if refuse:
        raise_together(refused_flags(args))
    notes: list[str] = []
    args = argparse.Namespace(**apply_aliases(vars(args), RENAMED, dest_of, notes))
    given = given_values(args, _PLAIN)
    values = {(_BY_FIELD[name].section, name): value
              for name, value in (PRESETS[args.preset] if args.preset else {}).items()}
    for derived, source in (("num_microbatches", "global_batch_size"),
                            ("train_iters", "train_samples"),
                            ("lr_warmup_iters", "lr_warmup_fraction"),
                            ("lr_warmup_iters", "lr_warmup_samples"),
                            ("lr_decay_iters", "lr_decay_samples")):
        if ("train", source) in given:  # derived from it (RunConfig.for_world, TrainConfig)
            if ("train", derived) in given:
                raise ConfigError(flag_of(source), given[("train", source)],
                                  f"give it or {flag_of(derived)}, not both")
            values.pop(("train", derived), None)
    values.update(given)
    sections = {section: cls(**{name: value for (where, name), value in values.items()
                                if where == section})
                for section, cls in SECTIONS.items() if section != "cuda_graph"}
    config = RunConfig(**sections, cuda_graph=cuda_graph_config_from_args(args, notes.append))
    for note in notes:
        warn(note)
    return config


def read_command_line(argv: Optional[list[str]] = None,
                      warn: Callable[[str], None] = lambda msg: None, printing: bool = True
                      ) -> tuple[Optional[RunConfig], list[ConfigError]]:
    """-> (the config the flags give, or None where they give none; the refusals of the flags
    themselves): arguments no flag takes (one UnknownArguments, argparse's one line), refused
    Megatron-LM flags (one each), a pair of flags that exclude each other. The config is built
    without the refused flags, so its rules can be checked in the same run."""
    args, unknown = build_parser(printing=printing).parse_known_args(argv)
    refusals: list[ConfigError] = [UnknownArguments(unknown)] if unknown else []
    refusals += refused_flags(args)
    try:
        return config_from_args(args, warn, refuse=False), refusals
    except ConfigError as error:
        return None, refusals + [error]


def parse_config(argv: Optional[list[str]] = None,
                 warn: Callable[[str], None] = lambda msg: None,
                 printing: bool = True) -> RunConfig:
    """The config the flags give; ConfigError naming every refusal of the flags themselves
    (`read_command_line`), one line each."""
    cfg, refusals = read_command_line(argv, warn, printing)
    raise_refusals(refusals, printing)
    return cfg


def raise_refusals(refusals: list[ConfigError], printing: bool = True,
                   prog: str = "epoverlap-train") -> None:
    """Every refusal of a command line at once, one line each (none: return). Where an argument
    is no flag's, as argparse says it: its usage line, then `PROG: error: ...` lines, exit
    status 2 (SystemExit); otherwise one ConfigError (`errors.raise_together`)."""
    if not any(isinstance(refusal, UnknownArguments) for refusal in refusals):
        raise_together(refusals)
        return
    try:
        raise_together(refusals)
    except ConfigError as error:
        build_parser(prog, printing).error(str(error).replace("\n", f"\n{prog}: error: "))
