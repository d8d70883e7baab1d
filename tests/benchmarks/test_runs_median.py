"""benchmarks/harness/runs_median.py: each run's figure from folders written as
bench_train_rounds writes them (its own `write_report`), the tuning run's cost with the steps
after its window, and the median and range over the runs."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.harness import bench_train_rounds, data_archive, runs_median


def _run(ms: list) -> dict:
    """One run of a side: two warmup steps, then `ms`."""
    return {"round": 1, "rc": 0, "step_ms": [900.0, 800.0] + ms}


def _folder(tmp_path, name: str, sides: dict, tune_ms: list = None, window: int = 4):
    """A recipe's folder: train_rounds.json with `sides` ({name: [step ms after the warmup]}),
    and a tuning run of `tune_ms` whose tuner's window ends at step `window`."""
    folder = tmp_path / name
    folder.mkdir()
    bench_train_rounds.write_report(
        folder, ["train"], 1, 2, [{"name": n, "tree": None, "flags": []} for n in sides],
        {n: [_run(ms)] for n, ms in sides.items()})
    if tune_ms is not None:
        (folder / "tune_first.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "step_time_s": ms / 1e3}) + "\n"
            for i, ms in enumerate(tune_ms)))
        (folder / "tune_first.log").write_text(
            f"tune: steps 2-{window}, each path's step time on the slowest rank (ms): x\n")
    return folder


def test_hand_and_seq_figures_take_each_sides_median_after_the_warmup(tmp_path):
    folder = _folder(tmp_path, "a", {"default": [100.0, 104.0, 102.0],
                                     "seq_graphs": [130.0, 120.0, 125.0],
                                     "ovl_full": [99.0, 101.0, 100.0],
                                     "seq_full": [110.0, 118.0, 114.0]})
    assert runs_median.run_figure(folder, "hand") == (102.0 / 100.0, "")
    assert runs_median.run_figure(folder, "seq") == (114.0 / 102.0, "")  # seq_full, not ovl_full


def test_tune_figure_counts_the_steps_after_the_window_and_says_how_slow_they_ran(tmp_path):
    """Steps 2-4 tune (150 ms), steps 5-6 run 1.2x the cached default's 100 ms: 2 x 50 + 2 x 20
    ms over 5 steps of 100, as a share of 1000 steps."""
    folder = _folder(tmp_path, "a", {"default": [100.0], "seq_graphs": [120.0]},
                     tune_ms=[5000.0, 150.0, 150.0, 150.0, 120.0, 120.0], window=4)
    value, note = runs_median.run_figure(folder, "tune")
    assert value == pytest.approx((3 * 50 + 2 * 20) / (1000 * 100))
    assert note == "(window ends at step 4 of 6; the steps after it 1.200x the default's)"
    assert math.isnan(runs_median.after_window([1.0, 2.0], 2, 1.0))


def test_tune_figure_reads_the_tuning_run_from_its_experiments_archive(tmp_path):
    """As committed under benchmarks/data/: the logs packed into the experiment's raw.tar.xz,
    train_rounds.json kept beside the report; the figure is the unpacked folder's."""
    folder = _folder(tmp_path, "a", {"default": [100.0]},
                     tune_ms=[5000.0, 150.0, 150.0, 150.0, 120.0, 120.0], window=4)
    before = runs_median.run_figure(folder, "tune")
    packed = data_archive.pack(tmp_path)
    assert {p.name for p in packed} == {"tune_first.jsonl", "tune_first.log"}
    assert not (folder / "tune_first.log").exists()
    assert runs_median.run_figure(folder, "tune") == before


def test_a_run_that_did_not_tune_has_no_tune_figure(tmp_path, capsys):
    folder = _folder(tmp_path, "a", {"default": [100.0]}, tune_ms=[500.0, 100.0])
    (folder / "tune_first.log").write_text("tune: cannot tune: 6 paths need 40 steps\n")
    assert runs_median.main(["--figure", "tune", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "did not tune" in err and str(folder) in err


def test_the_summary_is_the_median_and_range_of_every_run_the_latest_named(tmp_path, capsys):
    folders = [_folder(tmp_path, name, {"default": [d], "ovl_full": [100.0]})
               for name, d in (("first", 139.0), ("second", 101.5), ("third", 96.0))]
    assert runs_median.main(["--figure", "hand", *map(str, folders)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"hand 1.3900  {folders[0]}"
    assert lines[-1] == (f"hand: 3 run(s), median 1.0150, 0.9600 - 1.3900, "
                         f"latest {folders[-1]}")
