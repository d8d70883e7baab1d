"""Loss-log comparison (epoverlap/cli/compare_losses.py): identical logs, the first differing step named
with both values in hex, different step sets, bitwise semantics, and malformed files; the grad
norms (grad_norm_hex) compared beside the losses when both logs carry them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from epoverlap.cli.compare_losses import LossComparison, compare_loss_logs, main

REPO = Path(__file__).resolve().parents[2]
LOSSES = [5.123456789, 4.87654321, 4.5, 4.25]


def write_log(path: Path, losses, steps=None, with_hex=True, with_loss=True) -> Path:
    lines = []
    for step, loss in zip(steps or range(1, len(losses) + 1), losses):
        record = {"step": step, "lr": 1e-3, "grad_norm": 0.5}
        if with_loss:
            record["loss"] = loss
        if with_hex:
            record["loss_hex"] = float.hex(loss)
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def run_main(capsys, a: Path, b: Path) -> tuple[int, str, str]:
    code = main([str(a), str(b)])
    out, err = capsys.readouterr()
    return code, out, err


def test_identical(tmp_path, capsys):
    a = write_log(tmp_path / "a.jsonl", LOSSES)
    b = write_log(tmp_path / "b.jsonl", LOSSES, with_hex=False)  # loss only: same bits
    result = compare_loss_logs(a, b)
    assert result == LossComparison(True, 4, None, "identical (4 steps)")
    code, out, _ = run_main(capsys, a, b)
    assert code == 0 and out.strip() == "identical (4 steps)"


def test_first_difference(tmp_path, capsys):
    changed = list(LOSSES)
    changed[1] = math.nextafter(changed[1], math.inf)  # one ulp
    changed[3] = 9.0
    a = write_log(tmp_path / "a.jsonl", LOSSES)
    b = write_log(tmp_path / "b.jsonl", changed)
    result = compare_loss_logs(a, b)
    assert not result.identical and result.steps_compared == 4
    assert result.first_difference == (2, LOSSES[1], changed[1])
    assert "losses differ at step 2" in result.message
    assert LOSSES[1].hex() in result.message and changed[1].hex() in result.message
    assert repr(LOSSES[1]) in result.message and "2 of 4 common steps differ" in result.message
    code, out, _ = run_main(capsys, a, b)
    assert code == 1 and "step 2" in out


def test_loss_hex_preferred_over_loss(tmp_path):
    a = write_log(tmp_path / "a.jsonl", LOSSES)
    b = tmp_path / "b.jsonl"
    records = [{"step": i + 1, "loss_hex": v.hex()} for i, v in enumerate(LOSSES)]
    b.write_text("\n".join(json.dumps(r) for r in records))
    assert compare_loss_logs(a, b).identical


@pytest.mark.parametrize("a_value, b_value, same", [(0.0, -0.0, False), (math.nan, math.nan, True),
                                                    (math.inf, math.inf, True)])
def test_bitwise_semantics(tmp_path, a_value, b_value, same):
    a = write_log(tmp_path / "a.jsonl", [1.0, a_value])
    b = write_log(tmp_path / "b.jsonl", [1.0, b_value])
    assert compare_loss_logs(a, b).identical is same


def test_different_lengths(tmp_path, capsys):
    a = write_log(tmp_path / "a.jsonl", LOSSES)
    b = write_log(tmp_path / "b.jsonl", LOSSES[:3])
    result = compare_loss_logs(a, b)
    assert not result.identical and result.steps_compared == 3
    assert result.first_difference == (4, LOSSES[3], None)
    assert f"step 4 is only in {a}" in result.message
    assert f"{a} has 4 steps, 1..4, {b} has 3 steps, 1..3" in result.message
    code, out, _ = run_main(capsys, b, a)
    assert code == 1 and "step 4 is only in" in out


def test_different_step_sets_same_length(tmp_path):
    a = write_log(tmp_path / "a.jsonl", LOSSES[:3], steps=[1, 2, 3])
    b = write_log(tmp_path / "b.jsonl", LOSSES[:3], steps=[1, 2, 5])
    result = compare_loss_logs(a, b)
    assert result.first_difference == (3, LOSSES[2], None)
    assert "step sets differ" in result.message and "common steps differ" not in result.message


@pytest.mark.parametrize("content, needle", [
    ('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 1.', "line 2: not valid JSON"),
    ('{"step": 1, "lr": 0.1}\n', "line 1: record has neither 'loss' nor 'loss_hex'"),
    ('{"step": 1, "loss": 1.0, "loss_hex": "0x1.8p+0"}\n', "disagree"),
    ('{"step": 1, "loss_hex": "one"}\n', "not a float.hex() string"),
    ('{"step": "1", "loss": 1.0}\n', "'step' must be an int"),
    ('{"step": 1, "loss": 1.0}\n{"step": 1, "loss": 1.0}\n', "step 1 appears more than once"),
    ('[1, 2]\n', "expected a JSON object"),
    ('\n\n', "no step records"),
])
def test_malformed(tmp_path, capsys, content, needle):
    good = write_log(tmp_path / "good.jsonl", LOSSES)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    code, out, err = run_main(capsys, good, bad)
    assert code == 2 and out == ""
    assert str(bad) in err and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_missing_file(tmp_path, capsys):
    good = write_log(tmp_path / "good.jsonl", LOSSES)
    code, _, err = run_main(capsys, tmp_path / "absent.jsonl", good)
    assert code == 2 and "absent.jsonl" in err and "cannot read" in err


@pytest.mark.parametrize("how", [["-m", "epoverlap.cli.compare_losses"]])
def test_runs_as_module(tmp_path, how):
    a = write_log(tmp_path / "a.jsonl", LOSSES)
    done = subprocess.run([sys.executable, *how, str(a), str(a)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "identical (4 steps)"


def _write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_log_without_deterministic_runs_is_named_in_a_warning(tmp_path, capsys):
    det, loose = tmp_path / "det.jsonl", tmp_path / "loose.jsonl"
    _write_records(det, [{"step": 1, "loss": 2.5, "deterministic": True}])
    _write_records(loose, [{"step": 1, "loss": 2.5, "deterministic": False}])
    assert compare_loss_logs(det, det).warnings == ()
    result = compare_loss_logs(det, loose)
    assert result.identical and len(result.warnings) == 1 and str(loose) in result.warnings[0]
    assert main([str(loose), str(det)]) == 0
    err = capsys.readouterr().err
    assert "not run with --deterministic-mode" in err and str(loose) in err and str(det) not in err


NORMS = [3.25, 2.0000001, 1.5, 1.125]


def write_norm_log(path: Path, losses=LOSSES, norms=NORMS, steps=None) -> Path:
    """A log as --log-json writes it now: loss and grad norm, each with its float.hex."""
    records = [{"step": step, "loss": loss, "loss_hex": loss.hex(), "grad_norm": norm,
                "grad_norm_hex": norm.hex()}
               for step, loss, norm in zip(steps or range(1, len(losses) + 1), losses, norms)]
    _write_records(path, records)
    return path


def test_grad_norms_are_compared_when_both_logs_carry_them(tmp_path, capsys):
    a = write_norm_log(tmp_path / "a.jsonl")
    b = write_norm_log(tmp_path / "b.jsonl")
    result = compare_loss_logs(a, b)
    assert result.identical and result.steps_compared == 4 and result.grad_norms_compared == 4
    assert result.message == "identical (4 steps): losses and grad norms"
    code, out, _ = run_main(capsys, a, b)
    assert code == 0 and out.startswith("identical (4 steps)")


def test_a_grad_norm_difference_with_equal_losses_is_named(tmp_path, capsys):
    norms = list(NORMS)
    norms[1] = math.nextafter(norms[1], 0.0)  # one ulp: the backward summed in another order
    a = write_norm_log(tmp_path / "a.jsonl")
    b = write_norm_log(tmp_path / "b.jsonl", norms=norms)
    result = compare_loss_logs(a, b)
    assert not result.identical and result.grad_norms_compared == 4
    assert result.first_difference == (2, NORMS[1], norms[1])
    assert result.first_difference_kind == "grad_norm"
    assert result.message.startswith("grad norms differ at step 2 (its losses are equal): ")
    assert NORMS[1].hex() in result.message and norms[1].hex() in result.message
    assert "grad norms differ at 1 of 4 steps compared" in result.message
    assert "common steps differ" not in result.message  # no loss differs
    code, out, _ = run_main(capsys, a, b)
    assert code == 1 and "grad norms differ at step 2" in out


def test_the_earlier_of_a_grad_norm_and_a_loss_difference_comes_first(tmp_path):
    losses, norms = list(LOSSES), list(NORMS)
    norms[0], losses[2] = 4.0, 9.0  # the grad norm on step 1, the loss from step 3
    a = write_norm_log(tmp_path / "a.jsonl")
    b = write_norm_log(tmp_path / "b.jsonl", losses=losses, norms=norms)
    result = compare_loss_logs(a, b)
    assert result.first_difference == (1, NORMS[0], 4.0)
    assert result.first_difference_kind == "grad_norm"
    assert "1 of 4 common steps differ" in result.message
    # the loss first: named as the loss, the grad norm of the same step mentioned
    losses, norms = list(LOSSES), list(NORMS)
    losses[1], norms[1], norms[3] = 9.0, 4.0, 5.0
    b = write_norm_log(tmp_path / "b2.jsonl", losses=losses, norms=norms)
    result = compare_loss_logs(a, b)
    assert result.first_difference == (2, LOSSES[1], 9.0)
    assert result.first_difference_kind == "loss"
    assert result.message.startswith("losses differ at step 2 (the grad norms too): ")
    assert "grad norms differ at 2 of 4 steps compared (first: step 2)" in result.message


def test_grad_norms_are_not_compared_unless_both_records_carry_the_hex(tmp_path):
    new = write_norm_log(tmp_path / "new.jsonl")
    old = write_log(tmp_path / "old.jsonl", LOSSES)  # grad_norm 0.5, no grad_norm_hex
    result = compare_loss_logs(new, old)
    assert result.identical and result.grad_norms_compared == 0
    assert result.message == "identical (4 steps)"
    # some steps with it (a log resumed by an older version): those are compared
    records = [json.loads(line) for line in new.read_text().splitlines()]
    for record in records[:2]:
        del record["grad_norm_hex"]
    mixed = tmp_path / "mixed.jsonl"
    _write_records(mixed, records)
    result = compare_loss_logs(new, mixed)
    assert result.identical and result.grad_norms_compared == 2
    assert result.message == "identical (4 steps): losses, and grad norms at 2 of them"


@pytest.mark.parametrize("record, needle", [
    ({"step": 1, "loss": 1.0, "grad_norm_hex": "big"}, "'grad_norm_hex' is not a float.hex()"),
    ({"step": 1, "loss": 1.0, "grad_norm_hex": 2.0}, "'grad_norm_hex' is not a float.hex()"),
    ({"step": 1, "loss": 1.0, "grad_norm": 2.5, "grad_norm_hex": "0x1.0p+1"},
     "'grad_norm' 2.5 and 'grad_norm_hex' 0x1.0p+1 disagree"),
])
def test_malformed_grad_norm(tmp_path, capsys, record, needle):
    good = write_norm_log(tmp_path / "good.jsonl")
    bad = tmp_path / "bad.jsonl"
    _write_records(bad, [record])
    code, out, err = run_main(capsys, good, bad)
    assert code == 2 and out == ""
    assert f"{bad} line 1" in err and needle in err and len(err.strip().splitlines()) == 1
