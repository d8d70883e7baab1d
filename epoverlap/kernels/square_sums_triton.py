"""Per-parameter sums of squares of a flat fp32 buffer in one Triton launch: `SquareSums`, the
grad norm's read of the grads on GPUs (`training.optimizer.grads.GradBuffers.norm_squared`).

torch's `_foreach_norm` over the grads is a multi-tensor kernel launched once per 320 chunks of
64K values: 221 launches a step at 4.6B values (one H200, the Mixtral-like shape), each a
partial wave, 1.2x the read's memory bound. Here every parameter's values are cut into chunks
of CHUNK values counted from the parameter's own start, and one program sums one chunk's
squares: BLOCK fp32 lanes, each adding its values in order, then one tree over the lanes, into
the chunk's slot of a [parameters, most chunks] table whose unused slots stay 0; torch sums
each row (a reduction with no atomics, so the same bits every run). A chunk's values and their
order depend on its parameter alone, not on where the parameter sits in the buffer, so a
parameter's sum has the same bits at any pipeline size (the norm's contract). The launch's
cost is one read of the buffer plus 4 bytes per chunk.

Where every parameter starts and ends on a multiple of 4 values (every preset), the loads are
16-byte vectors (`ALIGNED`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_cache import launch_cached

CHUNK = 1 << 18  # values a program sums (1 MiB of fp32)
BLOCK = 4096  # lanes of a program's loads


@launch_cached
@triton.jit
def _square_sums_kernel(
    x_ptr,       # [n] fp32: the flat buffer
    starts_ptr,  # [chunks] int64: each chunk's first value in x
    sizes_ptr,   # [chunks] int32: its values (CHUNK but a parameter's last)
    slots_ptr,   # [chunks] int64: its slot in out
    out_ptr,     # [parameters * most chunks] fp32: the chunks' sums of squares
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
):
    chunk = tl.program_id(0)
    start = tl.load(starts_ptr + chunk)
    size = tl.load(sizes_ptr + chunk)
    if ALIGNED:
        start = tl.multiple_of(start, 4)
        size = tl.multiple_of(size, 4)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, CHUNK, BLOCK):
        index = offset + lanes
        x = tl.load(x_ptr + start + index, mask=index < size, other=0.0)
        acc += x * x
    tl.store(out_ptr + tl.load(slots_ptr + chunk), tl.sum(acc, axis=0))


class SquareSums:
    """The sums of squares of the parameters `spans` ([start, end) each, in order) of a flat
    fp32 buffer on `device`; the chunk table is made once."""

    def __init__(self, spans: list[tuple[int, int]], device: torch.device,
                 chunk: int = CHUNK, block: int = BLOCK):
        self.chunk, self.block = chunk, block  # others than the defaults: the tests' small ones
        starts, sizes, slots = [], [], []
        most = max([-(-(end - start) // chunk) for start, end in spans] + [1])
        for row, (start, end) in enumerate(spans):
            for first in range(start, end, chunk):
                starts.append(first)
                sizes.append(min(chunk, end - first))
                slots.append(row * most + (first - start) // chunk)
        self.aligned = all(start % 4 == 0 and end % 4 == 0 for start, end in spans)
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self.sizes = torch.tensor(sizes, dtype=torch.int32, device=device)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)
        self.table = torch.zeros(len(spans), most, dtype=torch.float32, device=device)

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """[parameters] fp32: each parameter's sum of squares in `flat`."""
        if len(self.starts):
            _square_sums_kernel[(len(self.starts),)](
                flat, self.starts, self.sizes, self.slots, self.table,
                CHUNK=self.chunk, BLOCK=self.block, ALIGNED=self.aligned, num_warps=8)
        return self.table.sum(dim=1)
