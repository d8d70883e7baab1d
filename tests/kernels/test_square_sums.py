"""The grad norm's per-parameter sums of squares (`epoverlap.kernels.square_sums_triton`):
against a float64 reference with chunks that cross no parameter's end, parameters of one value,
none, unaligned starts and several chunks each; a parameter's sum with the same bits wherever
it sits in the buffer (the norm's contract at any pipeline size) and run after run. CPU tier
under the Triton interpreter (small chunks); on a GPU at the default chunk too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels.square_sums_triton import SquareSums

from kernel_test_utils import INTERPRETED

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(chunk=64, block=16)  # several chunks a parameter under the interpreter


def _spans(sizes: list[int], first: int = 0) -> list[tuple[int, int]]:
    spans, start = [], first
    for size in sizes:
        spans.append((start, start + size))
        start += size
    return spans


def _reference(flat: torch.Tensor, spans) -> torch.Tensor:
    return torch.stack([flat[a:b].double().square().sum() for a, b in spans])


@pytest.mark.parametrize("sizes", [[200, 1, 0, 64, 65, 3], [128, 256, 4, 8], [1000]])
def test_each_parameters_sum_of_squares(triton_device, sizes):
    gen = torch.Generator().manual_seed(len(sizes))
    spans = _spans(sizes)
    flat = torch.randn(sum(sizes), generator=gen).to(triton_device)
    sums = SquareSums(spans, torch.device(triton_device), **SMALL)
    got = sums(flat)
    assert got.dtype == torch.float32 and got.shape == (len(sizes),)
    torch.testing.assert_close(got.double().cpu(), _reference(flat, spans).cpu(), rtol=1e-6,
                               atol=0)
    assert sums.aligned == all(s % 4 == 0 for s in sizes)


def test_a_parameters_bits_do_not_depend_on_where_it_sits(triton_device):
    """The same values after 0, 3 or 64 others (another pipeline stage's layout): equal bits,
    and equal again on a second call (the table's unused slots stay 0)."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(300, generator=gen)
    device = torch.device(triton_device)
    got = []
    for before in (0, 3, 64):
        flat = torch.cat([torch.randn(before, generator=gen), values]).to(device)
        sums = SquareSums([(before, before + 300)], device, **SMALL)
        got += [sums(flat)[0].item(), sums(flat)[0].item()]
    assert len(set(got)) == 1


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_default_chunks_match_foreach_norm_and_repeat_bit_for_bit():
    sizes = [4096 * 2048, 2048, 3 * (1 << 18) + 12, 8, 1 << 20]
    gen = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.randn(sum(sizes), generator=gen, device="cuda") * 1e-3
    spans = _spans(sizes)
    sums = SquareSums(spans, torch.device("cuda"))
    first = sums(flat)
    assert torch.equal(first, sums(flat)) and sums.aligned
    views = [flat[a:b] for a, b in spans]
    foreach = torch.stack(torch._foreach_norm(views, 2)).square()
    torch.testing.assert_close(first, foreach, rtol=1e-5, atol=0)
    torch.testing.assert_close(first.double(), _reference(flat, spans), rtol=1e-5, atol=0)


_SM90_SCRIPT = """
import json, sys
sys.path.insert(0, "tests/kernels")
import sm90_compile
records, context = [], {}
sm90_compile._install_fake_driver(records, context)
import torch
from epoverlap.kernels.square_sums_triton import SquareSums
for sizes in ([1 << 20, 4096, 12], [1 << 20, 4097]):
    context["shape"] = "aligned" if sizes[-1] % 4 == 0 else "unaligned"
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    SquareSums(list(zip([0] + ends[:-1], ends)), torch.device("cpu"))(torch.zeros(ends[-1]))
print(json.dumps(records))
"""


@pytest.mark.skipif(not INTERPRETED, reason="a GPU compiles the kernel for real")
def test_the_kernel_compiles_for_sm90_with_16_byte_loads_where_aligned():
    """sm_90 PTX: no spills either way; where every parameter starts and ends on 4 values,
    16-byte loads (4 a thread an iteration of 16 values), where not, none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["shape"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert set(records) == {"aligned", "unaligned"}
    assert all(r["local_bytes"] == 0 for r in records.values()), records
    assert records["aligned"]["v4_loads"] == 4 and records["unaligned"]["v4_loads"] == 0, records
