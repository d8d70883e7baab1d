"""Every rule on how the MoE dispatch combines with the rest of a run, in one table (`RULES`).

The dispatch is two choices: how its all-to-alls' rows are sized (`SIZINGS`) and how they are
routed (`ROUTINGS`). A rule names a combination of those with the CUDA graphs' scope
(`GRAPHS`), the waves of --moe-a2a-waves (`WAVES`), the path tuner (`TUNING`) and
what carries the all-to-alls (`TRANSPORTS`) that does not run, the flag it refuses and why, in
one line. Validation (`config.validate`, `config.cuda_graph_rules`, `config.dispatch`'s
blockers), the tuner (`config.tuning`) and docs/dispatch-modes.md (`render_rules`, which a test
keeps equal to the page) all read it. A rule of one flag's own values (a budget > 0, a
capacity to pad to) stays beside the flag; so do the sizes a combination needs (EP > 1, whole
hosts, enough local experts), which no choice here names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

SIZINGS = {  # how many rows each all-to-all carries
    "host_splits": "split sizes read on the host: dropless (the default), capacity "
                   "(`--moe-expert-capacity-factor F`)",
    "padded": "every expert's capacity: `--moe-expert-capacity-factor F "
              "--moe-pad-expert-input-to-capacity`",
    "budget": "fixed blocks per rank: `--moe-dispatch-budget FACTOR`",
}
ROUTINGS = {  # what one row stands for
    "per_expert": "one row per (token, expert) (the default)",
    "per_rank": "one row per (token, rank): `--moe-dispatch-once-per-rank`",
    "per_host": "one row per (token, host), then per rank: `--moe-dispatch-hierarchy node`",
}
GRAPHS = {  # what the CUDA graphs hold (`graphs_scope`)
    "none": "`--cuda-graph-impl none`",
    "local_partial": "`--cuda-graph-impl local --cuda-graph-modules` without `moe`",
    "local_whole_layer": "`--cuda-graph-impl local`, no module list or one with `moe`",
    "te_partial": "`--cuda-graph-impl transformer_engine --cuda-graph-modules` without `moe`",
    "te_whole_layer": "`--cuda-graph-impl transformer_engine`, no list or one with `moe`",
    "full_iteration": "`--cuda-graph-impl full_iteration`",
    "auto": "`--cuda-graph-impl auto` before it is resolved",
}
WAVES = {
    "one": "`--moe-a2a-waves 1` (the default)",
    "several": "`--moe-a2a-waves K`, K > 1",
}
TUNING = {
    "flags": "the path the flags say",
    "paths": "the tuner switches between paths (`--tune on`, or auto where it tunes)",
    "once": "the tuner's own once-per-rank path (`--tune-allow-rounding`): a rule leaves "
            "the path out, it refuses nothing",
}
TRANSPORTS = {
    "process_group": "`--moe-a2a-transport process_group` (the default)",
    "host_memory": "`--moe-a2a-transport host_memory`",
    "peer_memory": "`--moe-a2a-transport peer_memory`",
}
ANY = None  # a rule's dimension that any value matches
DIMENSIONS = (("sizing", SIZINGS), ("routing", ROUTINGS), ("graphs", GRAPHS),
              ("waves", WAVES), ("tuning", TUNING), ("transport", TRANSPORTS))


@dataclass(frozen=True)
class DispatchChoice:
    """One run's (or one tuner path's) value on every dimension of the table."""

    sizing: str = "host_splits"
    routing: str = "per_expert"
    graphs: str = "none"
    waves: str = "one"
    tuning: str = "flags"
    transport: str = "process_group"

    def with_(self, **changes) -> "DispatchChoice":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Rule:
    """A combination that does not run: each dimension's values it covers (ANY: all), the
    flag it refuses as users type it, and why, naming what is allowed."""

    flag: str
    why: str
    sizing: Optional[tuple[str, ...]] = ANY
    routing: Optional[tuple[str, ...]] = ANY
    graphs: Optional[tuple[str, ...]] = ANY
    waves: Optional[tuple[str, ...]] = ANY
    tuning: Optional[tuple[str, ...]] = ANY
    transport: Optional[tuple[str, ...]] = ANY

    def covers(self, choice: DispatchChoice) -> bool:
        return all(getattr(self, name) is ANY or getattr(choice, name) in getattr(self, name)
                   for name, _ in DIMENSIONS)


_NO_MERGED_NODES = ("needs nodes no graph merges: --cuda-graph-impl none, local with "
                    "--cuda-graph-modules among attn, moe_router, moe_preprocess, or "
                    "full_iteration with --moe-dispatch-budget")
_TUNE_GRAPHS = ("switches paths that each replay their own graphs; --cuda-graph-impl {} is not "
                "built: use --cuda-graph-impl none, local or full_iteration")
_SYNC_FREE = ("use a sync-free dispatch: --moe-dispatch-budget FACTOR, or "
              "--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity")
WHOLE_LAYER = ("local_whole_layer", "te_whole_layer")

RULES = (  # within one flag, the first rule a choice breaks is the one its refusal names
    Rule("--moe-pad-expert-input-to-capacity",
         "cannot be combined with --moe-dispatch-once-per-rank (a padded capacity fixes the "
         "rows per expert, once per rank sends a row per rank)",
         sizing=("padded",), routing=("per_rank",)),
    Rule("--moe-dispatch-hierarchy",
         "needs the dropless, capacity or budget dispatch (not capacity_padded)",
         sizing=("padded",), routing=("per_host",)),
    Rule("--moe-a2a-waves",
         "needs --moe-dispatch-hierarchy flat (one all-to-all to cut into waves)",
         routing=("per_host",), waves=("several",)),
    Rule("--moe-a2a-waves",
         "needs the dropless, capacity or budget dispatch, one row per expert (not "
         "capacity_padded)", sizing=("padded",), waves=("several",)),
    Rule("--moe-a2a-waves",
         "needs one row per expert: not once per rank (--moe-dispatch-once-per-rank)",
         routing=("per_rank",), waves=("several",)),
    Rule("--moe-a2a-waves", _NO_MERGED_NODES, waves=("several",),
         graphs=WHOLE_LAYER + ("te_partial", "auto")),
    Rule("--moe-a2a-waves", _NO_MERGED_NODES, waves=("several",), graphs=("full_iteration",),
         sizing=("host_splits", "padded")),
    Rule("--moe-a2a-transport",
         "carries the flat dispatch's all-to-alls: not with --moe-dispatch-hierarchy node",
         routing=("per_host",), transport=("host_memory", "peer_memory")),
    Rule("--cuda-graph-impl",
         "one graph over the iteration would hold the all-to-alls, whose split sizes this "
         "dispatch reads on the host; " + _SYNC_FREE,
         sizing=("host_splits",), graphs=("full_iteration",)),
    Rule("--cuda-graph-modules",
         "a graph of the whole MoE layer would hold the all-to-all, whose split sizes this "
         "dispatch reads on the host; list the pre-dispatch regions (attn moe_router "
         "moe_preprocess) or use a sync-free dispatch: --moe-dispatch-budget, or "
         "--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity",
         sizing=("host_splits",), graphs=WHOLE_LAYER),
    Rule("--tune", _TUNE_GRAPHS.format("transformer_engine"), tuning=("paths",),
         graphs=("te_partial", "te_whole_layer")),
    Rule("--tune", _TUNE_GRAPHS.format("auto"), tuning=("paths",), graphs=("auto",)),
    Rule("--tune-allow-rounding",
         "no once-per-rank path over the budget: its buffers are sized for the flags' "
         "dispatch", sizing=("budget",), routing=("per_rank",), tuning=("once",)),
)


def graphs_scope(impl: str, modules: Sequence[str]) -> str:
    """The `GRAPHS` value of --cuda-graph-impl `impl` with --cuda-graph-modules `modules`."""
    if impl in ("none", "full_iteration", "auto"):
        return impl
    if impl not in ("local", "transformer_engine"):
        raise ValueError(f"--cuda-graph-impl {impl} has no graph scope")
    whole = not modules or "moe" in modules
    return ("local_" if impl == "local" else "te_") + ("whole_layer" if whole else "partial")


def refusal(choice: DispatchChoice, flag: str, rules: Sequence[Rule] = RULES) -> str:
    """Why `flag` is refused with `choice` (the first of its rules that covers it), '' when
    none does."""
    return next((rule.why for rule in rules if rule.flag == flag and rule.covers(choice)), "")


def why_refused(choice: DispatchChoice, rules: Sequence[Rule] = RULES) -> str:
    """Why `choice` does not run: the first rule that covers it, of any flag ('' when none)."""
    return next((rule.why for rule in rules if rule.covers(choice)), "")


def newly_refused(before: DispatchChoice, after: DispatchChoice,
                  rules: Sequence[Rule] = RULES) -> str:
    """Why `after` does not run where `before` ran as far as the table knows: the first rule
    that covers `after` and not `before` ('' when none). The tuner's paths change one choice
    of the flags' run; a rule the flags already break is validation's to name."""
    return next((rule.why for rule in rules if rule.covers(after) and not rule.covers(before)),
                "")


def render_rules(rules: Sequence[Rule] = RULES) -> str:
    """The table as docs/dispatch-modes.md shows it (markdown): each dimension's values, then
    one line per rule."""
    lines = []
    for name, values in DIMENSIONS:
        lines += [f"- {name}: " + "; ".join(f"`{value}` {text}" for value, text in values.items())]
    header = ["refused flag"] + [name for name, _ in DIMENSIONS] + ["why"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for rule in rules:
        cells = [f"`{rule.flag}`"] + [_cell(getattr(rule, name)) for name, _ in DIMENSIONS]
        lines.append("| " + " | ".join(cells + [rule.why]) + " |")
    return "\n".join(lines) + "\n"


def _cell(values: Optional[tuple[str, ...]]) -> str:
    return "any" if values is ANY else ", ".join(f"`{value}`" for value in values)
