"""The weight-gradient queue: where deferred weight-grad GEMMs wait for their `W` action.

Owns `WeightGradQueue`. The executor owns one instance; the model's deferrable GEMMs (see
`epoverlap.model.linear`) hold a reference to it and, in their backward, offer their weight-grad
closure with `defer`. While the executor runs the backward of a node inside
`collecting(key)` and deferral is enabled, the closure is stored under that key; otherwise
`defer` returns False and the caller computes the weight grad inline. The executor runs a key's
closures, in the order they were queued, at the plan's `W` action for that node, and checks
that every key is drained by the end of the step.

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

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self._collecting: Optional[Hashable] = None
        self._pending: "OrderedDict[Hashable, list[Callable[[], None]]]" = OrderedDict()

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
        with torch.no_grad():  # as inside the backward it was taken from: build no graph
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
