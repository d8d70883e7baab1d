"""benchmarks/harness/bench_wgrad.py on CPU (tiny shapes, the Triton side under the interpreter):
every side runs, the fused ones match the fp32 product where the old ones show their bf16
product's rounding."""

import pytest

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from benchmarks.harness import bench_wgrad


def test_bench_wgrad_runs_every_side_on_cpu(capsys):
    assert bench_wgrad.main(["--device", "cpu", "--sweep"]) == 0
    rows = [[c.strip() for c in line.split("|")[1:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| experts [")
            or line.startswith("| dense [")]
    sides = {(r[0].split()[0], r[1].split()[0].rstrip(",")) for r in rows}
    assert sides == {("experts", "old"), ("experts", "fused"), ("dense", "old"),
                     ("dense", "triton")}
    # old, default, the sweep; twice; the experts' two sources and overwrite
    assert len(rows) == 2 * (2 + len(bench_wgrad.SWEEP)) + 2
    for row in rows:
        assert row[-1] in ("same", "differ")
        error = float(row[-2])
        assert error < 1e-6 if row[1] != "old" else 1e-4 < error < 1e-2, row


def test_bench_wgrad_times_the_tiles_given_and_refuses_a_bad_one(capsys):
    assert bench_wgrad.parse_configs("128x256x128/w8/s2/g8, 64x64x32/w4/s3") == (
        bench_wgrad.WgradConfig(128, 256, 128, 8, 2, group_i=8),
        bench_wgrad.WgradConfig(64, 64, 32, 4, 3))
    assert bench_wgrad.main(["--device", "cpu", "--configs", "32x32x32/w4/s2/g2"]) == 0
    out = capsys.readouterr().out
    assert "| experts [4, 40, 72] | fused 32x32x32 w4 s2 g2 |" in out
    with pytest.raises(SystemExit) as stop:
        bench_wgrad.main(["--device", "cpu", "--configs", "128x256/w8/s2"])
    assert stop.value.code == 2
    assert "--configs '128x256/w8/s2': expected IxOxK/wW/sS[/gG]" in capsys.readouterr().err
