"""The `flat` AdamW form: Adam's state in flat fp32 buffers laid out as the grad buffers.

Owns `FlatAdamW`. The fp32 main grads are views into flat buffers (`grads.GradBuffers`: one
for the dense parameters, one for the expert ones); each run of parameters whose grads follow
one another in one buffer is a segment. The masters and both moments are flat fp32 buffers
holding the segments in the same order (each segment's start rounded up to 64 values, so every
segment starts 256-byte aligned), so one update runs over a whole segment at the same offsets
in every buffer: one launch per grad buffer (`kernels.adamw_triton` on GPUs, its torch form
`kernels.adamw` on CPUs; same bits). Each parameter becomes a view too: a bf16 parameter into a
flat bf16 buffer of the same layout, which the update writes in the same pass; an fp32
parameter into the masters (it is its own master). Weight decay applies to the matrices (2-D
and up), as the torch forms' two groups do, through a per-segment `kernels.adamw.DecayLayout`.

Per parameter, the masters and moments are views of the flat buffers and the step count is a
view of one [parameters] fp32 CPU tensor, so a checkpoint keeps them per parameter, the same
keys as the torch forms: one saved with either form resumes with the other.

Two costs of the views. A parameter starts where its grad does, after the sizes of those before
it in its buffer: a size not a multiple of 8 values would leave the parameters after it off
16-byte alignment, which slows their GEMMs (no preset has such a size). And making them copies
each parameter once into the flat bf16 buffer, allocated beside the parameters it replaces: 2
bytes a value more at start-up, before Adam's moments exist (well under the training peak).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from epoverlap.config import TrainConfig
from epoverlap.kernels.adamw import DecayLayout, adam_scalars, adamw_flat_torch, decay_layout

ALIGN = 64  # values: each segment starts 256 bytes into the flat fp32 buffers (16-byte loads)
BLOCK = 1024  # values per program of the Triton update: 8 a thread of 4 warps (16 or 32 a
# thread held fewer programs an SM: 91% of the bound at 4096, 98% at 1024, one H200, s72)


def flat_update(device: torch.device) -> Callable:
    """The update over one segment: the Triton kernel on GPUs, its torch form elsewhere."""
    if device.type == "cuda":
        from epoverlap.kernels.adamw_triton import adamw_flat_triton
        return adamw_flat_triton
    return adamw_flat_torch


@dataclass
class _Segment:
    """Parameters (indices into `FlatAdamW.params`, in grad-buffer order) whose grads are one
    run of `grad`, held at [start, start + grad.numel()) of the flat buffers."""

    members: list[int]
    grad: torch.Tensor  # [n] fp32 view of the grad buffer
    start: int
    decay: Optional[DecayLayout] = None


def _flat_view(t: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """[numel] view of t's storage from storage offset `offset`."""
    return t.new_empty(0).set_(t.untyped_storage(), offset, (numel,), (1,))


def _grad_segments(params: list) -> list[_Segment]:
    """The parameters grouped into runs of one grad buffer, each in storage order; buffers in
    the order their first parameter comes."""
    by_buffer: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        grad = p.main_grad
        if grad.dtype != torch.float32 or not grad.is_contiguous():
            raise ValueError(f"the flat AdamW needs contiguous fp32 main grads; parameter {i} "
                             f"has {grad.dtype}{'' if grad.is_contiguous() else ' strided'}")
        by_buffer.setdefault(grad.untyped_storage().data_ptr(), []).append(i)
    segments: list[_Segment] = []
    for members in by_buffer.values():
        members.sort(key=lambda i: params[i].main_grad.storage_offset())
        run: list[int] = []
        for i in members:
            grad = params[i].main_grad
            if run:
                last = params[run[-1]].main_grad
                if grad.storage_offset() != last.storage_offset() + last.numel():
                    segments.append(_segment(params, run))
                    run = []
            run.append(i)
        segments.append(_segment(params, run))
    return segments


def _segment(params: list, run: list[int]) -> _Segment:
    first = params[run[0]].main_grad
    numel = sum(params[i].numel() for i in run)
    return _Segment(run, _flat_view(first, first.storage_offset(), numel), 0)


class FlatAdamW:
    """AdamW over flat buffers (module docstring) for `params`, every one with a `main_grad`.
    Makes every parameter a view of a flat buffer (its values kept)."""

    def __init__(self, params: list, cfg: TrainConfig):
        self.params, self.cfg = params, cfg
        device = params[0].device
        self.segments = _grad_segments(params)
        self.offsets = [0] * len(params)  # each parameter's start in the flat buffers
        size = self._lay_out(device)
        low = _low_precision_dtype(params)
        self.masters_flat = torch.zeros(size, dtype=torch.float32, device=device)
        self.params_flat = torch.zeros(size, dtype=low, device=device) if low else None
        self.masters = [self._attach(i, p) for i, p in enumerate(params)]
        self._index = {master: i for i, master in enumerate(self.masters)}
        self.exp_avg_flat: Optional[torch.Tensor] = None  # made at the first step (torch's)
        self.exp_avg_sq_flat: Optional[torch.Tensor] = None
        self.steps: Optional[torch.Tensor] = None  # [parameters] fp32 on the CPU
        self._states: list[dict] = []
        self._update = flat_update(device)

    def _lay_out(self, device: torch.device) -> int:
        """Each segment's start, each parameter's offset and each segment's decay layout (the
        matrices); returns the flat buffers' size."""
        size = 0
        for segment in self.segments:
            segment.start = size = -(-size // ALIGN) * ALIGN
            ranges = []
            for i in segment.members:
                self.offsets[i] = size
                end = size + self.params[i].numel()
                if self.params[i].ndim >= 2:
                    ranges.append((size - segment.start, end - segment.start))
                size = end
            segment.decay = decay_layout(_merged(ranges), segment.grad.numel(), BLOCK, device)
        return size

    def _view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)

    @torch.no_grad()
    def _attach(self, i: int, p: torch.Tensor) -> torch.Tensor:
        """Parameter i's master (a view of the masters); the parameter made a view too."""
        master = self._view(self.masters_flat, i)
        master.copy_(p)
        if p.dtype == torch.float32:
            p.data = master
            return p
        param = self._view(self.params_flat, i)
        param.copy_(p)
        p.data = param
        return master

    def state_of(self, master: torch.Tensor) -> dict:
        """{"step": 0-d fp32 CPU, "exp_avg", "exp_avg_sq"} of one master; {} before step 1."""
        index = self._index.get(master)
        return self._states[index] if self._states and index is not None else {}

    def create_state(self) -> None:
        """Zero moments and step counts (what the first step makes), for a checkpoint to fill."""
        if self._states:
            return
        self.exp_avg_flat = torch.zeros_like(self.masters_flat)
        self.exp_avg_sq_flat = torch.zeros_like(self.masters_flat)
        self.steps = torch.zeros(len(self.params), dtype=torch.float32)
        self._states = [{"step": self.steps[i], "exp_avg": self._view(self.exp_avg_flat, i),
                         "exp_avg_sq": self._view(self.exp_avg_sq_flat, i)}
                        for i in range(len(self.params))]

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        """bf16 parameters from their masters, rounded to nearest even (one copy)."""
        if self.params_flat is not None:
            self.params_flat.copy_(self.masters_flat)

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One step; the grads are read times `grad_scale` (the clip's factor)."""
        self.create_state()
        self.steps += 1
        c = self.cfg
        scalars = adam_scalars(lr, c.weight_decay, c.adam_beta1, c.adam_beta2, c.adam_eps,
                               self.steps[0].item(), grad_scale)
        for segment in self.segments:
            span = slice(segment.start, segment.start + segment.grad.numel())
            self._update(self.masters_flat[span], segment.grad, self.exp_avg_flat[span],
                         self.exp_avg_sq_flat[span],
                         None if self.params_flat is None else self.params_flat[span],
                         segment.decay, scalars)


def _low_precision_dtype(params: list) -> Optional[torch.dtype]:
    """The parameters' dtype other than fp32 (bf16 in mixed precision), or None."""
    low = {p.dtype for p in params} - {torch.float32}
    if len(low) > 1:
        raise ValueError("the flat AdamW takes one parameter dtype besides fp32, not "
                         f"{sorted(map(str, low))}")
    return low.pop() if low else None


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with touching ones joined."""
    merged: list[list[int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]
