"""--moe-dispatch-budget-memory: the level a training step starts at (DispatchBudget), and its
flag's rules. The training runs that use it are in test_dispatch_modes (slow tier)."""

from __future__ import annotations

import pytest
import torch

from epoverlap.config import parse_config, validate_config
from epoverlap.errors import ConfigError
from epoverlap.model.budget import DispatchBudget


def budget(memory_steps: int) -> DispatchBudget:
    return DispatchBudget(0.25, 2, 64, torch.device("cpu"), memory_steps=memory_steps)


def test_without_memory_every_step_starts_at_the_base_level():
    plain = budget(0)
    plain.remember(2)
    assert plain.start_level() == 0


def test_a_step_starts_at_the_largest_level_of_the_remembered_steps():
    remembered = budget(3)
    assert remembered.start_level() == 0
    for level in (2, 1, 0):
        remembered.remember(level)
    assert remembered.start_level() == 2
    remembered.remember(0)  # the step that needed level 2 is now 4 steps back
    assert remembered.start_level() == 1


@pytest.mark.parametrize("argv, fragment", [
    (["--moe-dispatch-budget-memory", "5"], "needs --moe-dispatch-budget"),
    (["--moe-dispatch-budget", "1.0", "--moe-dispatch-budget-memory", "-1"], "must be >= 0"),
])
def test_the_flag_is_refused_in_one_line(argv, fragment):
    with pytest.raises(ConfigError) as info:
        validate_config(parse_config(argv), 2, False)
    assert str(info.value).startswith("--moe-dispatch-budget-memory=") and fragment in \
        str(info.value)
