"""The weight-gradient queue: where deferred weight-grad GEMMs wait for their `W` action.

Owns `WeightGradQueue`. The executor owns one instance; the model's deferrable GEMMs (see
`epoverlap.model.linear`) hold a reference to it and, in their backward, offer their weight-grad
closure with `defer`. While the executor runs the backward of a node inside
`collecting(key)` and deferral is enabled, the closure is stored under that key; otherwise
`defer` returns False and the caller computes the weight grad inline. The executor runs a key's
closures, in the order they were queued, at the plan's `W` action for that node, and checks
that every key is drained by the end of the step.

The queue also places the experts' fused weight grads within a run of the plan
(`expert_grad`; `begin_run` starts a run): with `pair_microbatches`, microbatch 2k's rows wait
for microbatch 2k+1's and both go into the main grad in one launch (the kernel's sums start
from the main grad, so the bits are those of two launches; the main grad is read and written
once instead of twice); with `first_write`, a parameter's first call of the run overwrites its
main grad instead of adding to it (the same bits as adding to zeros), so the step need not zero
the expert grads first (`written` says which were, for the step to zero any that were not).

Not thread-local on purpose: on GPU the autograd engine runs backward functions on its own
device thread while the calling thread waits, so the collecting key must be visible there.
Only the compute lane runs nodes that own weights.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Optional

import torch


class WeightGradQueue:
    """Deferred weight-grad work, keyed by the node (microbatch, layer, node name) it belongs to."""

    def __init__(self, enabled: bool = False, first_write: bool = False,
                 pair_microbatches: bool = False):
        self.enabled = enabled
        self.first_write = first_write
        self.pair_microbatches = pair_microbatches
        self._collecting: Optional[Hashable] = None
        self._pending: "OrderedDict[Hashable, list[Callable[[], None]]]" = OrderedDict()
        self._microbatches = 0
        self.written: set = set()  # the expert parameters whose grads the run wrote
        self._waiting: dict = {}  # key -> the even microbatch's rows, until the odd one's

    def begin_run(self, microbatches: int) -> None:
        """A run of the plan over `microbatches` starts: no expert grad written yet."""
        self._microbatches = microbatches
        self.written = set()
        self._waiting = {}

    def _microbatch(self) -> Optional[int]:
        key = self._collecting
        return key[0] if isinstance(key, tuple) and key and isinstance(key[0], int) else None

    def expert_grad(self, param: Hashable, part: Hashable, rows: tuple, run: Callable) -> None:
        """Place one microbatch's weight grad of expert parameter `param` (its experts `part`):
        `rows` (x, grad, offsets, counts); `run(sources, accumulate)` adds each source's
        products into the main grad in order (overwriting the whole parameter's first when
        `accumulate` is False). See the module docstring."""
        key = (param, part)
        microbatch = self._microbatch()
        if (self.pair_microbatches and microbatch is not None and microbatch % 2 == 0
                and microbatch + 1 < self._microbatches):
            self._waiting[key] = rows
            return
        sources = ([self._waiting.pop(key)] if key in self._waiting else []) + [rows]
        accumulate = not self.first_write or param in self.written
        self.written.add(param)
        run(sources, accumulate)

    def check_paired(self) -> None:
        """Raise if an expert grad still waits for its pair at the end of a run."""
        if self._waiting:
            raise RuntimeError(f"expert weight grads never paired in the run: "
                               f"{len(self._waiting)} (the odd microbatch never ran its own)")

    @contextmanager
    def collecting(self, key: Hashable) -> Iterator[None]:
        """Weight-grad work offered inside this block belongs to `key`; an inner block (a graphed
        range's own backward inside a node's) collects for its key until it ends."""
        if key == self._collecting:
            raise RuntimeError(f"weight-grad queue already collecting for {key}")
        outer, self._collecting = self._collecting, key
        try:
            yield
        finally:
            self._collecting = outer

    def defer(self, work: Callable[[], None]) -> bool:
        """Queue `work` if deferral is on and a node is collecting; else return False."""
        if not self.enabled or self._collecting is None:
            return False
        self._pending.setdefault(self._collecting, []).append(work)
        return True

    def run(self, key: Hashable) -> int:
        """Run (and drop) the work queued under `key`, oldest first. Returns how many ran."""
        work_items = self._pending.pop(key, [])
        # under the key: the work's microbatch places its expert grads (`expert_grad`)
        with self.collecting(key), torch.no_grad():  # as in the backward: build no graph
            for work in work_items:
                work()
        return len(work_items)

    def pending_keys(self) -> list:
        return list(self._pending)

    def clear(self) -> None:
        """Drop every queued closure unrun (after a failed CUDA graph capture: its work goes
        with the capture)."""
        self._pending.clear()

    def check_empty(self) -> None:
        """Raise if any deferred weight grad was never run (it would be silently lost)."""
        if self._pending:
            keys = ", ".join(str(k) for k in self._pending)
            raise RuntimeError(f"weight-grad work left in the queue at the end of the step: "
                               f"{keys} (the plan lacks their W actions)")
