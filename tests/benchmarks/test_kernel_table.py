"""benchmarks.harness.kernel_table: a hand-made torch.profiler trace with known kernel times,
by kind and by name, per step; a trace without kernels is refused in one line."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness import kernel_table as kt


def _event(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0,
            "tid": stream, "args": {"device": 0, "stream": stream}}


def _trace(path, events, rank=0):
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": rank}}))


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all-to-all and collectives"),
    ("cutlass::device_kernel<GroupProblemShape<...>>", "grouped GEMM (experts)"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "GEMM"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise and copies"),
    ("_permute_rows_kernel", "other"),
])
def test_a_kernel_is_the_kind_its_name_first_matches(name, kind):
    assert kt.kind_of(name) == kind


def test_kinds_and_top_kernels_per_step(tmp_path, capsys):
    # two steps: per step 30 us of GEMM (two calls), 10 of all-to-all, 10 of a Triton kernel
    events = []
    for step in (0, 1000):
        events += [_event("nvjet_gemm_a", step, 20), _event("nvjet_gemm_a", step + 20, 10),
                   _event("ncclDevKernel_AllToAll", step, 10, stream=9),
                   _event("_permute_rows_kernel", step + 40, 10)]
    _trace(tmp_path / "torch-trace-rank00001.json", events + [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}], rank=1)
    out = tmp_path / "t.json"
    assert kt.main([str(tmp_path), "--steps", "2", "--top", "2", "--out", str(out)]) == 0
    table = json.loads(out.read_text())["ranks"][0]
    assert table["rank"] == 1 and table["kernel_ms"] == pytest.approx(0.05)
    kinds = {k["kind"]: k["ms"] for k in table["kinds"]}
    assert kinds == pytest.approx({"GEMM": 0.03, "all-to-all and collectives": 0.01,
                                   "other": 0.01})
    assert [k["name"] for k in table["top"]][0] == "nvjet_gemm_a"
    assert len(table["top"]) == 2
    assert table["top"][0]["calls"] == 2 and table["top"][0]["share"] == pytest.approx(0.6)
    text = capsys.readouterr().out
    assert "| GEMM | 0.03 | 0.600 |" in text and "ms per step" in text


def test_a_trace_without_kernels_is_refused_in_one_line(tmp_path, capsys):
    _trace(tmp_path / "torch-trace-rank00000.json",
           [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}])
    assert kt.main([str(tmp_path / "torch-trace-rank00000.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kernel_table: ") and "no GPU kernel events" in err
