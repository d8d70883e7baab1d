"""How a command's process ends, with nothing heavy imported (no torch, no runtime module), so
that it can be set up first: a SIGTERM or SIGINT before the work starts ends the process at once
with one line (`stop_at_once`), and once the work is done the process exits without the
interpreter's teardown (`exit_now`)."""

from __future__ import annotations

import atexit
import os
import signal
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_at_once(prog: str, printing: bool, when: str = "before training") -> None:
    """Until another handler takes them, SIGTERM and SIGINT end the process at once with status
    128 + the signal and, where `printing`, one line naming the signal received:
    `{prog}: stopped by SIGINT before training` (no traceback, even during an import)."""
    def stop(signum, frame):
        if printing:
            print(f"{prog}: stopped by {signal.Signals(signum).name} {when}", file=sys.stderr,
                  flush=True)
        os._exit(128 + signum)
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held by the launcher's spawn


def spawn_with_stops_held(spawn):
    """`spawn` (a function starting processes) wrapped so that SIGTERM and SIGINT are blocked
    while it runs: the processes start with them blocked (a signal mask is inherited), so one
    that arrives while a rank's interpreter starts waits for the rank's `stop_at_once` instead
    of breaking its start-up with a traceback; one the launcher gets meanwhile is taken after."""
    def spawn_held(*args, **kwargs):
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return spawn(*args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    spawn_held.__wrapped__ = spawn
    return spawn_held


def exit_now(status: int) -> None:
    """Run the atexit functions, flush, and exit with `status` without finalizing the
    interpreter: after a run had closed its logs, groups and threads, tearing down torch's
    modules took another 3-6 s of a CPU rank (and 1-2 s of the launcher) before the process
    ended, holding the job's end that long."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
