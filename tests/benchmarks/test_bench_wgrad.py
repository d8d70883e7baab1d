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
