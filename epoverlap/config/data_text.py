"""The data flags' text read into values: --split's proportions (`parse_split`) and
--data-path's blend of prefixes and weights (`parse_blend`), as Megatron-core reads them."""

from __future__ import annotations

import re
from typing import Optional, Sequence


def parse_split(text: str) -> tuple[float, float, float]:
    """"969,30,1" -> normalized (train, valid, test) proportions. Raises ValueError."""
    parts = [p.strip() for p in re.split(r"[,/]", text) if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError("expected up to three comma-separated proportions, e.g. 969,30,1") \
            from None
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or not values[0] > 0:
        raise ValueError("up to three proportions >= 0 with the train one > 0, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(v / total for v in values)  # type: ignore[return-value]


def parse_blend(items: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """`--data-path` items -> (prefixes, weights or None). Raises ValueError.

    Either prefixes only (A B ...), or weight-prefix pairs (0.3 A 0.7 B), as Megatron-core
    reads them.
    """
    items = list(items)
    if not items:
        raise ValueError("give at least one PREFIX (of PREFIX.bin / PREFIX.idx)")
    if len(items) % 2 == 0 and all(_is_number(w) for w in items[0::2]):
        weights = [float(w) for w in items[0::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError("weights must be >= 0 and not all 0")
        return items[1::2], weights
    numbers = [item for item in items if _is_number(item)]
    if numbers:
        raise ValueError(f"{numbers[0]} looks like a weight: give WEIGHT PREFIX pairs for every "
                         "dataset, or prefixes only")
    return items, None


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
