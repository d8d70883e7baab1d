"""Grad buffers whose expert part is left NaN where the step no longer zeroes it: what a first
expert weight grad that added instead of overwriting would read, so a test of the placement
fails on such a run instead of passing on stale zeros."""

from __future__ import annotations

from epoverlap.training.optimizer import grads


def poison_unzeroed_expert_grads(monkeypatch) -> None:
    zero = grads.GradBuffers.zero

    def stale_experts(self, experts=True):
        zero(self, experts)
        if not experts:
            self.expert_flat.fill_(float("nan"))
    monkeypatch.setattr(grads.GradBuffers, "zero", stale_experts)
