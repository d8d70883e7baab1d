"""CI's script (`.ci/run`) runs the README's test command exactly, then the slow tier; the
default tier (pyproject's addopts) leaves the slow marker out, and `-m slow` selects it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    commands = [line for block in blocks for line in block.splitlines()
                if "python -m pytest" in line]
    assert len(commands) == 1, commands
    return commands[0]


def test_ci_runs_the_readme_test_command_then_the_slow_tier():
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    readme = _readme_test_command()
    assert readme in lines, (readme, lines)
    assert "python -m pytest -q -m slow" in lines[lines.index(readme) + 1:], lines


def test_the_default_tier_leaves_out_the_slow_marker():
    text = (REPO / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; we take 3.10)
    section = text[text.index("[tool.pytest.ini_options]"):]
    addopts = re.search(r'^addopts = "(.*)"$', section, re.M)
    assert addopts and "-m 'not slow'" in addopts.group(1), addopts
    assert '    "slow: ' in section


def test_a_command_line_marker_replaces_the_default_one():
    """`-m slow` on the command line wins over addopts' `-m 'not slow'` (the last -m counts):
    collected here against this file's slow-marked sample."""
    sample = REPO / "tests" / "support" / "marker_sample.py"
    runs = {}
    for argv in ([], ["-m", "slow"]):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only",
                               "-p", "no:cacheprovider", "--noconftest", *argv, str(sample)],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        runs[tuple(argv)] = [line for line in done.stdout.splitlines() if "::" in line]
    assert runs[()] == ["tests/support/marker_sample.py::test_fast"], runs
    assert runs[("-m", "slow")] == ["tests/support/marker_sample.py::test_slow"], runs
