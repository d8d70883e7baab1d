"""Why a run stops before --train-iters, and every rank agreeing on the step it stops after.

Owns `StopRequest`. Its reasons: a SIGTERM or SIGINT for the whole job (the liveness watch hands
it over at once, `watch.stop_handler`, and reports it as a peer's failure instead when its probe
finds a peer silent), and the time limit of
--exit-duration-in-mins. A signal reaches the ranks at slightly different moments, so the
reasons are not acted on where they arise: each rank puts its own into the step's stats
reduction as flags (`local_flags`), and the sums come back the same on every rank
(`agreed`): every rank stops after that step. --exit-interval needs no agreement (a step
number). The exit status follows the reason: 128 + the signal, or 0 for the limits.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

SIGNALS = ("SIGTERM", "SIGINT")  # the reasons a signal gives (exit status 128 + signal)
REASONS = SIGNALS + ("time limit",)  # the order of the flags in the reduction


class StopRequest:
    """This rank's reasons to stop after the current step."""

    def __init__(self, exit_duration_mins: Optional[float]):
        self.signals: set[str] = set()  # written by the watch's monitor thread
        self.deadline = (None if exit_duration_mins is None
                         else time.monotonic() + 60 * exit_duration_mins)

    def signal(self, name: str) -> None:
        """The watch's `stop_handler`: a signal for the whole job."""
        self.signals.add(name)

    def local_flags(self) -> list[float]:
        """One flag per reason in REASONS, 1.0 where this rank has it."""
        late = self.deadline is not None and time.monotonic() >= self.deadline
        return [float(name in self.signals) for name in SIGNALS] + [float(late)]

    @staticmethod
    def agreed(summed: list[float]) -> Optional[str]:
        """The reason every rank stops for, from the flags summed over ranks (None: go on)."""
        return next((name for name, count in zip(REASONS, summed) if count > 0), None)


def exit_status(reason: Optional[str]) -> int:
    """The process's status for a run that stopped for `reason` (None: it ran to the end)."""
    if reason in SIGNALS:
        return 128 + signal.Signals[reason]
    return 0
