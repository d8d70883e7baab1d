"""Watching for Triton compiles mid-run: a compile is a stall of a large fraction of a second on
one rank that every other rank waits for at its next all-to-all.

Owns `CompileWatch`: after each step it counts the compiled variants of the Triton kernels
(`epoverlap.kernels.triton_compiled_variants`), names the kernels that gained one after the
warmup steps (a warning line), and gives the per-rank total for the end-of-run report.
"""

from __future__ import annotations

from typing import Callable, Optional

from epoverlap.kernels import triton_compiled_variants


class CompileWatch:
    """Counts Triton kernel variants step by step; warns when one is compiled after warmup."""

    def __init__(self, warmup_steps: int, rank: int, warn: Callable[[str], None]):
        self.warmup_steps, self.rank, self.warn = warmup_steps, rank, warn
        self._last: dict[str, int] = {}
        self.late_compiles = 0

    def after_step(self, step: int) -> None:
        counts = triton_compiled_variants() or {}
        new = {name: n - self._last.get(name, 0) for name, n in counts.items()
               if n > self._last.get(name, 0)}
        self._last = counts
        if new and step > self.warmup_steps:
            self.late_compiles += sum(new.values())
            names = ", ".join(f"{name} (+{n})" for name, n in sorted(new.items()))
            self.warn(f"rank {self.rank}: step {step} compiled new Triton kernel variant(s) "
                      f"after the {self.warmup_steps} warmup steps: {names}; each is a stall "
                      f"every other rank waits for")

    def total(self) -> Optional[int]:
        """Compiled variants in this process so far (None: no compiled Triton kernels here)."""
        counts = triton_compiled_variants()
        return None if counts is None else sum(counts.values())
