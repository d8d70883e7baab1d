"""benchmarks/harness/bench_main_grad_ops.py on CPU (tiny shapes, the Triton sides under the
interpreter): every op's two sides run, and the norms' fused side has the old side's bits (the
embedding's on CPU sums in bf16 where the GPU's sort path sums in fp32: not compared here)."""

import pytest

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from benchmarks.harness import bench_main_grad_ops


def test_bench_main_grad_ops_runs_every_side_on_cpu(capsys):
    assert bench_main_grad_ops.main(["--device", "cpu"]) == 0
    rows = [[c.strip() for c in line.split("|")[1:-1]]
            for line in capsys.readouterr().out.splitlines()[2:]]
    assert {(r[0], r[2]) for r in rows} == {(op, side) for op in ("embedding", "norm", "qk norm")
                                            for side in ("old", "fused")}
    assert all(r[4] == "True" for r in rows if r[0] != "embedding"), rows
