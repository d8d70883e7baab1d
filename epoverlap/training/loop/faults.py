"""Test-only fault injection into the real training command, from the environment variable
EPOVERLAP_TEST_FAULT. Not a flag and not for users: unset (always, outside tests) it does
nothing. The tests use it to make a run fail in a controlled way, end to end.

Forms (STEP counts from 1; RANK is the global rank, every rank when left out):
  nan-loss@STEP[:RANK]          every microbatch's loss of STEP is NaN (so are the grads after it)
  nan-grad@STEP[:RANK]:PARAM    one element of PARAM's gradient (model name, e.g.
                                layers.1.experts.fc2) is NaN once the backward of STEP is done
  exit@STEP[:RANK]              the process exits with status 17 as STEP starts, in the first run
                                of a torchrun job only (TORCHELASTIC_RESTART_COUNT unset or 0),
                                so a job started with --max-restarts can resume

Owns `FaultInjector` and `parse_fault`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
from torch import nn

from epoverlap.model.nodes import NodeSpec

ENV = "EPOVERLAP_TEST_FAULT"
KINDS = ("nan-loss", "nan-grad", "exit")
EXIT_STATUS = 17


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: Optional[int]
    param: Optional[str] = None


def parse_fault(text: str) -> Fault:
    """`KIND@STEP[:RANK][:PARAM]` -> Fault; ValueError naming the variable when malformed."""
    try:
        kind, where = text.split("@", 1)
        parts = where.split(":")
        step = int(parts[0])
        rank = int(parts[1]) if len(parts) > 1 and parts[1] != "" else None
        param = parts[2] if len(parts) > 2 else None
        if kind not in KINDS or (kind == "nan-grad") != (param is not None):
            raise ValueError(text)
    except ValueError:
        raise ValueError(f"{ENV}={text}: expected nan-loss@STEP[:RANK], "
                         f"nan-grad@STEP:RANK:PARAM or exit@STEP[:RANK]") from None
    return Fault(kind, step, rank, param)


class FaultInjector:
    """Applies the fault of EPOVERLAP_TEST_FAULT (if any) to one rank's run."""

    def __init__(self, rank: int, environ: Mapping[str, str] = os.environ):
        text = environ.get(ENV)
        self.fault = parse_fault(text) if text else None
        self.rank = rank
        self.first_run = environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.step = 0

    def _hits(self, kind: str) -> bool:
        f = self.fault
        return (f is not None and f.kind == kind and f.step == self.step
                and f.rank in (None, self.rank))

    def begin_step(self, step: int) -> None:
        self.step = step
        if self._hits("exit") and self.first_run:
            print(f"{ENV}: rank {self.rank} exits at step {step}", flush=True)
            os._exit(EXIT_STATUS)

    def wrap_specs(self, specs: Sequence[NodeSpec]) -> list[NodeSpec]:
        """The nodes, the loss node made to return NaN at the fault's step (nan-loss only)."""
        if self.fault is None or self.fault.kind != "nan-loss":
            return list(specs)
        return [dataclasses.replace(spec, fn=self._poisoned(spec)) if spec.loss else spec
                for spec in specs]

    def _poisoned(self, spec: NodeSpec):
        def fn(**inputs):
            out = spec.fn(**inputs)
            if self._hits("nan-loss"):
                out = dict(out, **{spec.loss: out[spec.loss] * float("nan")})
            return out
        return fn

    @torch.no_grad()
    def after_backward(self, model: nn.Module) -> None:
        if self._hits("nan-grad"):
            param = dict(model.named_parameters())[self.fault.param]
            param.main_grad.view(-1)[0] = float("nan")
