"""benchmarks/harness/bench_train_rounds.py on CPU with a stub training command: the sides run in
rotated order each round, a side with a tree runs from it, every step's time is kept and the
figures are the medians after the warmup."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.harness import bench_train_rounds as rounds

STUB = '''import json, os, sys
args = sys.argv[1:]
if "--fail" in args:
    sys.exit(1)
scale = 2.0 if "--slow" in args else 1.0
with open(args[args.index("--log-json") + 1], "w") as log:
    for step in range(1, 6):
        log.write(json.dumps({"step": step, "step_time_s": scale * step / 1000,
                              "loss_hex": "0x1.8p+0"}) + "\\n")
print("cwd", os.getcwd())
'''


def test_sides_parse_with_and_without_a_tree():
    assert rounds.parse_side("seq=") == {"name": "seq", "tree": None, "flags": []}
    assert rounds.parse_side("before@.baseline=--a 'b c'") == {
        "name": "before", "tree": ".baseline", "flags": ["--a", "b c"]}
    with pytest.raises(ValueError):
        rounds.parse_side("no_flags_part")


def test_each_round_rotates_the_order():
    assert [rounds.round_order(["a", "b", "c"], r) for r in (1, 2, 3, 4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert [rounds.round_order(["a", "b"], r) for r in (1, 2, 3)] == [
        ["a", "b"], ["b", "a"], ["a", "b"]]


def test_rounds_keep_every_step_and_report_medians_after_the_warmup(tmp_path, capsys):
    stub, tree, out = tmp_path / "stub.py", tmp_path / "tree", tmp_path / "out"
    stub.write_text(STUB)
    tree.mkdir()
    rc = rounds.main(["--side", "a=", "--side", "b=--slow", "--side", f"c@{tree}=",
                      "--rounds", "3", "--warmup", "2", "--out", str(out), "--",
                      sys.executable, str(stub)])
    assert rc == 0
    report = json.loads((out / "train_rounds.json").read_text())
    a, b, c = (report["sides"][name] for name in "abc")
    assert [run["position"] for run in a["runs"]] == [0, 2, 1]
    assert [run["round"] for run in b["runs"]] == [1, 2, 3]
    assert a["runs"][0]["step_ms"] == pytest.approx([1, 2, 3, 4, 5])
    assert a["median_ms"] == pytest.approx(4.0) and b["median_ms"] == pytest.approx(8.0)
    assert (a["steps_timed"], a["min_ms"], a["max_ms"]) == (9, pytest.approx(3), pytest.approx(5))
    assert b["flags"] == ["--slow"] and c["tree"] == str(tree)
    assert f"cwd {tree.resolve()}" in (out / "logs" / "c_1.log").read_text()
    assert f"cwd {tree.resolve()}" not in (out / "logs" / "a_1.log").read_text()
    assert (out / a["runs"][0]["log"]).exists()
    assert "| b | 8.0 | 6.0 - 10.0 | 9 | 2.000 |" in capsys.readouterr().out


def test_a_failed_run_fails_the_whole(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    rc = rounds.main(["--side", "ok=", "--side", "bad=--fail", "--rounds", "1", "--out",
                      str(tmp_path / "out"), "--", sys.executable, str(stub)])
    assert rc == 1
    report = json.loads((tmp_path / "out" / "train_rounds.json").read_text())
    bad = report["sides"]["bad"]
    assert bad["steps_timed"] == 0 and bad["runs"][0]["rc"] == 1


@pytest.mark.parametrize("argv", [["--side", "a=", "--side", "a=", "--", "x"],
                                  ["--side", "a="], ["--", "x"], ["--side", "bad", "--", "x"]])
def test_bad_arguments_exit_2(argv, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        rounds.main(argv)
    assert exit_info.value.code == 2
