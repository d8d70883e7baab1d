"""--manual-gc / --manual-gc-interval N: Python's garbage collector between steps only.

Owns `ManualGC`, Megatron-LM's semantics: at the start of training the automatic collector is
disabled and one collection runs; then one collection after every step whose number is a
multiple of N (N = 0: none after the start), so no collection pauses a step midway (on one rank
of many, such a pause stalls every rank at the next collective). At the end, on every exit
path, the collector is enabled again if it was before.
"""

from __future__ import annotations

import gc


class ManualGC:
    """For the training loop: `start()` before the first step, `after_step(step)` between
    steps, `stop()` on every way out."""

    def __init__(self, enabled: bool, interval: int):
        self.enabled, self.interval = enabled, interval
        self._was_enabled = False

    def start(self) -> None:
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()

    def after_step(self, step: int) -> None:
        if self.enabled and self.interval and step % self.interval == 0:
            gc.collect()

    def stop(self) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()
        self._was_enabled = False
