"""How a rank speaks outside the step log: one warning line on stderr, from every rank that
meets the condition (the step log is rank 0's)."""

import sys


def warn_every_rank(message: str) -> None:
    print(f"epoverlap-train: warning: {message}", file=sys.stderr, flush=True)
