"""Loss-log comparison: `epoverlap-compare-losses A B`, and `compare_loss_logs` for tests.

This module owns reading the training entry point's `--log-json` files (one JSON object per line
per step, with "step" and "loss" and/or "loss_hex" = float.hex(loss), and "grad_norm_hex" =
float.hex(grad norm) from the logs that record it) and deciding whether two runs produced
bit-identical losses. Losses are compared as bits (their float.hex strings, so -0.0 != 0.0 and
NaN == NaN), from loss_hex when present, else from loss.

Grad norms are compared too, as bits, at every common step whose records in both files carry
"grad_norm_hex" (a plain "grad_norm" alone is not compared). The grad norm sees the backward's
order of accumulation, which a step's loss cannot: a schedule that ran microbatch 2's backward
before microbatch 1's changes the norm's bits on step 1, the loss only from step 2 on, if at
all. A difference names the step and whether the loss or the grad norm differs there.

Each record of a run started with `--deterministic-mode` says so (`"deterministic": true`); when
either log does not, a warning line (stderr) names it: two correct runs that were not
deterministic can differ, so a difference there does not show a bug.

Exit status: 0 identical (prints `identical (N steps)`, followed by `: losses and grad norms`
when the grad norms of all N were compared too, or `: losses, and grad norms at M of them`),
1 different (names the first differing step, the loss or the grad norm, with both values in hex
and decimal, or the step present in only one file), 2 unreadable or malformed input (one line
naming the file and line).

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

    first_difference is (step, value_a, value_b) for the earliest step whose loss or grad norm
    differs or that is present in only one file (the missing side is None); None when
    identical. first_difference_kind says which: "loss", "grad_norm" (the losses of that step
    are equal) or "step" (present in only one file); None when identical.
    steps_compared counts the steps present in both files (all of them are compared);
    grad_norms_compared those of them whose records in both files carry grad_norm_hex.
    """

    identical: bool
    steps_compared: int
    first_difference: tuple[int, float | None, float | None] | None
    message: str
    warnings: tuple[str, ...] = field(default=(), compare=False)
    grad_norms_compared: int = 0
    first_difference_kind: str | None = None


@dataclass(frozen=True)
class _Log:
    losses: dict[int, float]
    grad_norms: dict[int, float]  # the steps whose record carries grad_norm_hex
    deterministic: bool


def read_loss_log(path: str | os.PathLike) -> dict[int, float]:
    """{step: loss} from a --log-json file. Raises LossLogError naming the file and line."""
    return _read_log(path).losses


def _read_log(path: str | os.PathLike) -> _Log:
    """{step: loss}, {step: grad norm} and whether every record says the run was
    deterministic."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise LossLogError(f"{path}: cannot read loss log: {error}") from None
    losses: dict[int, float] = {}
    grad_norms: dict[int, float] = {}
    deterministic = True
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        step, loss, grad_norm, record_deterministic = _parse_line(line,
                                                                  f"{path} line {number}")
        if step in losses:
            raise LossLogError(f"{path} line {number}: step {step} appears more than once")
        losses[step] = loss
        if grad_norm is not None:
            grad_norms[step] = grad_norm
        deterministic = deterministic and record_deterministic
    if not losses:
        raise LossLogError(f"{path}: no step records (empty loss log)")
    return _Log(losses, grad_norms, deterministic)


def _parse_line(line: str, where: str) -> tuple[int, float, float | None, bool]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise LossLogError(f"{where}: not valid JSON (truncated?): {error.msg}") from None
    if not isinstance(record, dict):
        raise LossLogError(f"{where}: expected a JSON object, got {type(record).__name__}")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise LossLogError(f"{where}: 'step' must be an int >= 0, got {step!r}")
    return (step, _loss_of(record, where), _grad_norm_of(record, where),
            record.get("deterministic") is True)


def _loss_of(record: dict[str, Any], where: str) -> float:
    loss, loss_hex = record.get("loss"), record.get("loss_hex")
    if loss is not None and not _is_number(loss):
        raise LossLogError(f"{where}: 'loss' must be a number, got {loss!r}")
    if loss_hex is None:
        if loss is None:
            raise LossLogError(f"{where}: record has neither 'loss' nor 'loss_hex'")
        return float(loss)
    return _hex_value(record, "loss", where)


def _grad_norm_of(record: dict[str, Any], where: str) -> float | None:
    """The grad norm from grad_norm_hex; None where the record has none (not compared)."""
    if record.get("grad_norm_hex") is None:
        return None
    return _hex_value(record, "grad_norm", where)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _hex_value(record: dict[str, Any], key: str, where: str) -> float:
    """record[key + '_hex'] as a float; it must agree with record[key] where that is a number
    (`loss` was checked to be one; a non-number `grad_norm` is left alone, as before)."""
    text = record[f"{key}_hex"]
    try:
        value = float.fromhex(text) if isinstance(text, str) else None
    except ValueError:
        value = None
    if value is None:
        raise LossLogError(f"{where}: '{key}_hex' is not a float.hex() string: {text!r}")
    plain = record.get(key)
    if _is_number(plain) and not same_bits(float(plain), value):
        raise LossLogError(
            f"{where}: '{key}' {plain!r} and '{key}_hex' {text} disagree ({value!r})"
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
    """Compare two loss logs step by step: the losses, and the grad norms where both records
    of a step carry grad_norm_hex. Raises LossLogError if either is malformed."""
    log_a, log_b = _read_log(path_a), _read_log(path_b)
    losses_a, losses_b = log_a.losses, log_b.losses
    warnings = tuple(f"warning: {path} was not run with --deterministic-mode: runs that are not "
                     f"can differ without a bug" for path, det in ((path_a, log_a.deterministic),
                                                                   (path_b, log_b.deterministic))
                     if not det)
    common = sorted(losses_a.keys() & losses_b.keys())
    differing = [step for step in common if not same_bits(losses_a[step], losses_b[step])]
    norm_steps = [step for step in common
                  if step in log_a.grad_norms and step in log_b.grad_norms]
    norms_differing = [step for step in norm_steps
                       if not same_bits(log_a.grad_norms[step], log_b.grad_norms[step])]
    only_a = sorted(losses_a.keys() - losses_b.keys())
    only_b = sorted(losses_b.keys() - losses_a.keys())
    if not (differing or norms_differing or only_a or only_b):
        message = f"identical ({len(common)} steps)"
        if norm_steps:
            message += (": losses and grad norms" if len(norm_steps) == len(common) else
                        f": losses, and grad norms at {len(norm_steps)} of them")
        return LossComparison(True, len(common), None, message, warnings, len(norm_steps))
    first = min(differing[:1] + norms_differing[:1] + only_a[:1] + only_b[:1])
    if first in differing:
        kind = "loss"
        a_value, b_value = losses_a[first], losses_b[first]
        lead = f"losses differ at step {first}"
        if first in norms_differing:
            lead += " (the grad norms too)"
    elif first in norms_differing:
        kind = "grad_norm"
        a_value, b_value = log_a.grad_norms[first], log_b.grad_norms[first]
        lead = f"grad norms differ at step {first} (its losses are equal)"
    else:
        kind = "step"
        a_value, b_value = losses_a.get(first), losses_b.get(first)
        lead = f"step {first} is only in {path_a if a_value is not None else path_b}"
    parts = [f"{lead}: {path_a}: {_show(a_value)} vs {path_b}: {_show(b_value)}"]
    if differing:
        parts.append(f"{len(differing)} of {len(common)} common steps differ")
    if norms_differing:
        parts.append(f"grad norms differ at {len(norms_differing)} of {len(norm_steps)} steps "
                     f"compared (first: step {norms_differing[0]})")
    if only_a or only_b:
        parts.append(f"step sets differ: {path_a} has {_span(sorted(losses_a))}, {path_b} has "
                     f"{_span(sorted(losses_b))}")
    return LossComparison(False, len(common), (first, a_value, b_value), "; ".join(parts),
                          warnings, len(norm_steps), kind)


def main(argv: Sequence[str] | None = None) -> int:
    """0 identical, 1 different, 2 unreadable or malformed input."""
    parser = argparse.ArgumentParser(
        prog="epoverlap-compare-losses",
        description="Compare the per-step losses of two --log-json files bit for bit, and their "
                    "grad norms where both carry grad_norm_hex.")
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
