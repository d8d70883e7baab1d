"""The one table of dispatch rules (`config.dispatch_rules`): its rows name only values its
dimensions have, docs/dispatch-modes.md shows exactly its rendering, and validation and the
tuner refuse what it refuses, with its words."""

from __future__ import annotations

from pathlib import Path

import pytest

from epoverlap.config import parse_config
from epoverlap.config.dispatch import dispatch_choice
from epoverlap.config.dispatch_rules import (DIMENSIONS, RULES, DispatchChoice, graphs_scope,
                                             newly_refused, refusal, render_rules)
from epoverlap.config.tuning import candidate_paths, once_per_rank_blocker, tune_blocker

DOC = Path(__file__).resolve().parents[2] / "docs" / "dispatch-modes.md"
BEGIN = "<!-- generated: render_rules() of epoverlap/config/dispatch_rules.py -->\n"
END = "<!-- end of the generated rules -->"
TINY = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "64",
        "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
        "--device", "cpu", "--overlap-moe-expert-parallel-comm"]


def test_the_doc_shows_the_table_as_rendered():
    text = DOC.read_text()
    shown = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    assert shown == render_rules(), ("docs/dispatch-modes.md's table of dispatch rules is not "
                                     "RULES: paste render_rules() between its markers")


def test_every_rule_names_values_its_dimensions_have():
    for rule in RULES:
        assert rule.flag.startswith("--") and rule.why
        for name, values in DIMENSIONS:
            assert getattr(rule, name) is None or set(getattr(rule, name)) <= set(values), rule
    for name, values in DIMENSIONS:
        assert getattr(DispatchChoice(), name) in values


def test_graphs_scope_names_what_the_graphs_hold():
    assert graphs_scope("none", ()) == "none"
    assert graphs_scope("local", ("attn", "moe_router")) == "local_partial"
    assert graphs_scope("local", ()) == "local_whole_layer"
    assert graphs_scope("local", ("attn", "moe")) == "local_whole_layer"
    assert graphs_scope("transformer_engine", ("attn",)) == "te_partial"
    assert graphs_scope("full_iteration", ()) == "full_iteration"
    with pytest.raises(ValueError):
        graphs_scope("mystery", ())


def test_refusal_takes_the_first_rule_of_the_flag_that_covers_the_choice():
    padded_host = DispatchChoice(sizing="padded", routing="per_host", waves="several")
    assert "--moe-dispatch-hierarchy flat" in refusal(padded_host, "--moe-a2a-waves")
    assert "not capacity_padded" in refusal(padded_host, "--moe-dispatch-hierarchy")
    assert refusal(DispatchChoice(routing="per_host"), "--moe-a2a-waves") == ""
    budget_graph = DispatchChoice(sizing="budget", graphs="full_iteration", waves="several")
    assert refusal(budget_graph, "--moe-a2a-waves") == ""
    assert refusal(budget_graph.with_(sizing="host_splits"), "--moe-a2a-waves")


def test_newly_refused_leaves_out_what_the_flags_already_break():
    broken = DispatchChoice(graphs="full_iteration")  # host splits in one graph: refused
    assert refusal(broken, "--cuda-graph-impl")
    assert newly_refused(broken, broken.with_(tuning="once", routing="per_rank")) == ""
    budget = DispatchChoice(sizing="budget")
    assert "budget" in newly_refused(budget, budget.with_(tuning="once", routing="per_rank"))


@pytest.mark.parametrize("flags, once_path", [
    ([], True),
    (["--moe-dispatch-budget", "1.5"], False),
    (["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"], False),
    (["--moe-a2a-waves", "2"], False),
    (["--moe-dispatch-once-per-rank"], False),
])
def test_the_tuners_once_path_follows_the_table(flags, once_path):
    cfg = parse_config(TINY + ["--tune-allow-rounding"] + flags).for_world(2)
    assert (once_per_rank_blocker(cfg) == "") == once_path
    assert any(path.once_per_rank for path in candidate_paths(cfg)) == once_path


def test_tune_blocker_reads_the_tables_graph_rule():
    cfg = parse_config(TINY + ["--cuda-graph-impl", "transformer_engine"]).for_world(2)
    assert dispatch_choice(cfg).graphs == "te_whole_layer"
    assert "transformer_engine is not built" in tune_blocker(cfg)
    assert tune_blocker(parse_config(TINY + ["--cuda-graph-impl", "local", "--cuda-graph-modules",
                                             "attn"]).for_world(2)) == ""


def test_the_factory_builds_every_pair_of_choices_the_table_lets_run():
    from epoverlap.config.dispatch_rules import ROUTINGS, SIZINGS, why_refused
    from epoverlap.model.dispatch.factory import _DISPATCHERS
    for sizing in SIZINGS:
        for routing in ROUTINGS:
            runs = not why_refused(DispatchChoice(sizing=sizing, routing=routing))
            assert ((sizing, routing) in _DISPATCHERS) == runs, (sizing, routing)
    assert not why_refused(DispatchChoice()) and len(_DISPATCHERS) == 7
