"""benchmarks/harness/bench_loss.py on CPU (the fused side under the Triton interpreter): both levels run,
the fused side reruns bit for bit, its grads agree with the reference's, bad shapes are refused."""

import pytest

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from benchmarks.harness import bench_loss


def test_bench_loss_runs_both_levels_on_cpu(capsys):
    assert bench_loss.main(["--device", "cpu", "--shapes", "24x40", "--hidden", "64",
                            "--rounds", "2", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| 24x40")]
    assert [line.split("|")[2:4] for line in table] == [
        [" op ", " fused "], [" op ", " torch "], [" node ", " fused "], [" node ", " torch "]]
    for line in table:
        cells = [c.strip() for c in line.split("|")]
        assert cells[11] == "True"  # the fused side's rerun is bitwise
        assert float(cells[10]) < 1e-2  # max grad diff against the reference (bf16)


def test_bench_loss_refuses_bad_shapes():
    with pytest.raises(ValueError, match="--shapes: '24' is not TOKENSxVOCAB"):
        bench_loss.parse_shapes("24")
    assert bench_loss.parse_shapes("8x3,16X5") == [(8, 3), (16, 5)]
