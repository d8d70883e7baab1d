"""The model takes its slices of the config, never the whole `RunConfig` (issue 63): its own
sections (`ModelConfig`, `MoEConfig`) and `ModelOptions`, what it reads of the others, made in
one place (`RunConfig.model_options`). Read from the sources with `ast` (nothing imported), as
tests/test_import_graph.py reads the layers; graphs/ and kernels/ are held to it too.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from epoverlap.config import ModelOptions, RunConfig, parse_config

PACKAGE = Path(__file__).resolve().parents[2] / "epoverlap"
SLICED = ("model", "graphs", "kernels")
# what a RunConfig has beyond the model's own sections: the other sections, what it derives
# from several (`microbatch_tokens`, `virtual_stages`, `cp_comm_types`, ...)
RUN_ONLY = ({field.name for field in dataclasses.fields(RunConfig)}
            | {name for name in vars(RunConfig) if not name.startswith("_")}) - {"model", "moe"}


def _mentions_run_config(node: ast.AST) -> bool:
    """An import, name, attribute or string annotation naming RunConfig."""
    if isinstance(node, ast.alias):
        return node.name.split(".")[-1] == "RunConfig"
    if isinstance(node, ast.Name):
        return node.id == "RunConfig"
    if isinstance(node, ast.Attribute):
        return node.attr == "RunConfig"
    return isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and node.value.strip("'\" ") == "RunConfig"


def _reads_other_section(node: ast.AST) -> bool:
    """`cfg.train`, `self.cfg.overlap`, `cfg.microbatch_tokens`, ...: a RunConfig read
    through a `cfg`."""
    if not (isinstance(node, ast.Attribute) and node.attr in RUN_ONLY):
        return False
    value = node.value
    return (isinstance(value, ast.Name) and value.id == "cfg") or \
        (isinstance(value, ast.Attribute) and value.attr == "cfg")


def offences(source: str, where: str) -> list[str]:
    """Each line of `source` that takes or reads a RunConfig, as `where:line: why`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if _mentions_run_config(node):
            found.append(f"{where}:{getattr(node, 'lineno', '?')}: names RunConfig")
        elif _reads_other_section(node):
            found.append(f"{where}:{node.lineno}: reads cfg.{node.attr}")
    return found


def test_model_graphs_and_kernels_never_take_the_run_config():
    found = [line for layer in SLICED for path in sorted((PACKAGE / layer).rglob("*.py"))
             for line in offences(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "the model takes its config slices, never RunConfig:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "from epoverlap.config import RunConfig\n",
    "from epoverlap.config.run import ModelOptions, RunConfig as Config\n",
    "def f(cfg: 'RunConfig'): pass\n",
    "def f(cfg: config.RunConfig): pass\n",
    "def f(cfg):\n    return cfg.train.seed\n",
    "class M:\n    def f(self):\n        return self.cfg.overlap.moe_a2a_waves\n",
    "def f(cfg):\n    return cfg.microbatch_tokens, cfg.moe_layer_pattern()\n"])
def test_the_check_catches_each_form(source):
    assert offences(source, "x.py")


def test_the_check_passes_the_model_sections():
    source = ("from epoverlap.config import ModelConfig, ModelOptions\n"
              "def f(m: ModelConfig, cfg):\n    return m.seq_length, cfg.moe, cfg.model\n")
    assert not offences(source, "x.py")


def test_model_options_take_the_other_sections_fields():
    """`RunConfig.model_options`, the one place the slice is made, copies what it names."""
    cfg = parse_config(["--seed", "7", "--num-microbatches", "3", "--micro-batch-size", "2",
                        "--seq-length", "64", "--num-layers", "2", "--eod-mask-loss"])
    options = cfg.model_options()
    assert isinstance(options, ModelOptions)
    assert (options.seed, options.num_microbatches, options.microbatch_tokens) == (7, 3, 128)
    assert options.cp_comm_types == tuple(cfg.cp_comm_types()) and len(options.cp_comm_types) == 2
    assert options.eod_mask_loss and options.virtual_stages == cfg.virtual_stages
