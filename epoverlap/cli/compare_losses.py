"""Loss-log comparison: `epoverlap-compare-losses A B`, and `compare_loss_logs` for tests.

This module owns reading the training entry point's `--log-json` files (one JSON object per line
per step, with "step" and "loss" and/or "loss_hex" = float.hex(loss)) and deciding whether two
runs produced bit-identical losses. Losses are compared as bits (their float.hex strings, so
-0.0 != 0.0 and NaN == NaN), from loss_hex when present, else from loss.

Each record of a run started with `--deterministic` says so (`"deterministic": true`); when
either log does not, a warning line (stderr) names it: two correct runs that were not
deterministic can differ, so a difference there does not show a bug.

Exit status: 0 identical (prints `identical (N steps)`), 1 different (names the first differing
step with both values in hex and decimal, or the step present in only one file), 2 unreadable or
malformed input (one line naming the file and line).

Run as `epoverlap-compare-losses` or `python -m epoverlap.cli.compare_losses`; standard library
only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


class LossLogError(ValueError):
    """An unreadable or malformed loss log; the message names the file (and line)."""


@dataclass(frozen=True)
class LossComparison:
    """Result of comparing two loss logs.

    first_difference is (step, loss_a, loss_b) for the earliest step whose losses differ or that
    is present in only one file (the missing side is None); None when identical.
    steps_compared counts the steps present in both files (all of them are compared).
    """

    identical: bool
    steps_compared: int
    first_difference: tuple[int, float | None, float | None] | None
    message: str
    warnings: tuple[str, ...] = field(default=(), compare=False)


def read_loss_log(path: str | os.PathLike) -> dict[int, float]:
    """{step: loss} from a --log-json file. Raises LossLogError naming the file and line."""
    return _read_log(path)[0]


def _read_log(path: str | os.PathLike) -> tuple[dict[int, float], bool]:
    """({step: loss}, whether every record says the run was deterministic)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise LossLogError(f"{path}: cannot read loss log: {error}") from None
    losses: dict[int, float] = {}
    deterministic = True
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        step, loss, record_deterministic = _parse_line(line, f"{path} line {number}")
        if step in losses:
            raise LossLogError(f"{path} line {number}: step {step} appears more than once")
        losses[step] = loss
        deterministic = deterministic and record_deterministic
    if not losses:
        raise LossLogError(f"{path}: no step records (empty loss log)")
    return losses, deterministic


def _parse_line(line: str, where: str) -> tuple[int, float, bool]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise LossLogError(f"{where}: not valid JSON (truncated?): {error.msg}") from None
    if not isinstance(record, dict):
        raise LossLogError(f"{where}: expected a JSON object, got {type(record).__name__}")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise LossLogError(f"{where}: 'step' must be an int >= 0, got {step!r}")
    return step, _loss_of(record, where), record.get("deterministic") is True


def _loss_of(record: dict[str, Any], where: str) -> float:
    loss, loss_hex = record.get("loss"), record.get("loss_hex")
    if loss is not None and (not isinstance(loss, (int, float)) or isinstance(loss, bool)):
        raise LossLogError(f"{where}: 'loss' must be a number, got {loss!r}")
    if loss_hex is None:
        if loss is None:
            raise LossLogError(f"{where}: record has neither 'loss' nor 'loss_hex'")
        return float(loss)
    try:
        value = float.fromhex(loss_hex) if isinstance(loss_hex, str) else None
    except ValueError:
        value = None
    if value is None:
        raise LossLogError(f"{where}: 'loss_hex' is not a float.hex() string: {loss_hex!r}")
    if loss is not None and not same_bits(float(loss), value):
        raise LossLogError(
            f"{where}: 'loss' {loss!r} and 'loss_hex' {loss_hex} disagree ({value!r})"
        )
    return value


def same_bits(a: float, b: float) -> bool:
    """Bitwise equality of two floats as hex strings: -0.0 != 0.0, NaN == NaN."""
    return a.hex() == b.hex()


def _show(value: float | None) -> str:
    return "missing" if value is None else f"{value.hex()} ({value!r})"


def _span(steps: Sequence[int]) -> str:
    return f"{len(steps)} steps, {min(steps)}..{max(steps)}" if steps else "0 steps"


def compare_loss_logs(path_a: str | os.PathLike, path_b: str | os.PathLike) -> LossComparison:
    """Compare two loss logs step by step. Raises LossLogError if either is malformed."""
    (losses_a, det_a), (losses_b, det_b) = _read_log(path_a), _read_log(path_b)
    warnings = tuple(f"warning: {path} was not run with --deterministic-mode: runs that are not "
                     f"can differ without a bug" for path, det in ((path_a, det_a),
                                                                   (path_b, det_b)) if not det)
    common = sorted(losses_a.keys() & losses_b.keys())
    differing = [step for step in common if not same_bits(losses_a[step], losses_b[step])]
    only_a = sorted(losses_a.keys() - losses_b.keys())
    only_b = sorted(losses_b.keys() - losses_a.keys())
    if not (differing or only_a or only_b):
        return LossComparison(True, len(common), None, f"identical ({len(common)} steps)",
                              warnings)
    first = min(differing[:1] + only_a[:1] + only_b[:1])
    a_value, b_value = losses_a.get(first), losses_b.get(first)
    if first in differing:
        lead = f"losses differ at step {first}"
    else:
        lead = f"step {first} is only in {path_a if a_value is not None else path_b}"
    parts = [f"{lead}: {path_a}: {_show(a_value)} vs {path_b}: {_show(b_value)}"]
    if differing:
        parts.append(f"{len(differing)} of {len(common)} common steps differ")
    if only_a or only_b:
        parts.append(f"step sets differ: {path_a} has {_span(sorted(losses_a))}, {path_b} has "
                     f"{_span(sorted(losses_b))}")
    return LossComparison(False, len(common), (first, a_value, b_value), "; ".join(parts),
                          warnings)


def main(argv: Sequence[str] | None = None) -> int:
    """0 identical, 1 different, 2 unreadable or malformed input."""
    parser = argparse.ArgumentParser(
        prog="epoverlap-compare-losses",
        description="Compare the per-step losses of two --log-json files bit for bit.")
    parser.add_argument("a", help="first --log-json file")
    parser.add_argument("b", help="second --log-json file")
    args = parser.parse_args(argv)
    try:
        result = compare_loss_logs(args.a, args.b)
    except LossLogError as error:
        print(f"epoverlap-compare-losses: error: {error}", file=sys.stderr)
        return 2
    for warning in result.warnings:
        print(f"epoverlap-compare-losses: {warning}", file=sys.stderr)
    print(result.message)
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
