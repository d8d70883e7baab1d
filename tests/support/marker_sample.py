"""Collected only by tests/test_ci.py (not a test_*.py file): one fast, one slow-marked test."""

import pytest


def test_fast():
    pass


@pytest.mark.slow
def test_slow():
    pass
