"""`EmulatedGraphs`: the CUDA-graph backend's methods on CPU, for the graph tests. A captured
graph is its capture body, and a replay runs the body again; everything else is the production
path."""

from __future__ import annotations

import contextlib


class _Replayable:
    def __init__(self, body):
        self.body = body

    def replay(self):
        self.body()


class EmulatedGraphs:
    """The graph backend's methods, on CPU: capture runs the body once, replay runs it again."""

    def __init__(self, device):
        self.captured = 0

    def capture(self, body, generators):
        body()
        self.captured += 1
        return _Replayable(body)

    def side_stream(self):
        return contextlib.nullcontext()

    def synchronize(self):
        pass

    def reserved_bytes(self):
        return 0

    def make_room(self, reserved_before, what):
        pass

    def begin_warmup(self):
        pass

    def end_warmup(self):
        pass
