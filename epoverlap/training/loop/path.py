"""A run's execution path: one way to run the step, built once, as a value.

Owns `ExecutionPath`. A path is what a step runs by: its spec (`config.tuning.TunePath`: its
name, its plan's name, weight-grad deferral, waves of the all-to-alls, dispatch once per rank,
the all-to-alls' transport), this stage's plan (made from the plan's name through the registry
`schedule.plan.PLANS`), the dispatcher of its MoE layers (its dispatch form and its
all-to-alls' transport), the executor of its nodes (the model's pure
`node_specs(waves=..., dispatch=...)`) on its lanes, and its CUDA graph banks
(`graphs.banks.StepGraphs`; None without graphs). One builder makes every path
(`RunParts.build_path` in `training.loop.build`): the flags' path, or with the path tuner one
per candidate. Nothing is switched between paths: the step is handed the path it runs
(`training.loop.step`), and the path sets, as it starts, the one thing every path shares, the
weight-grad queue's deferral (`engage`: the model's deferrable GEMMs hold the run's one queue).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from epoverlap.config.tuning import TunePath
from epoverlap.schedule.executor import Executor

if TYPE_CHECKING:
    from epoverlap.graphs.banks import StepGraphs
    from epoverlap.model.dispatch import TokenDispatcher
    from epoverlap.schedule.wgrad import WeightGradQueue


@dataclass(frozen=True)
class ExecutionPath:
    """One path, built (module docstring). `wgrad_queue` is the run's own, which `engage` sets
    for this path."""

    spec: TunePath
    plan: list
    executor: Executor
    dispatcher: Optional[TokenDispatcher]
    graphs: Optional[StepGraphs]
    wgrad_queue: WeightGradQueue

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def lanes(self):
        return self.executor.lanes

    def engage(self) -> None:
        """Before this path runs: weight grads deferred as it says."""
        self.wgrad_queue.enabled = self.spec.delay_wgrad

    def without_graphs(self) -> ExecutionPath:
        """The same path run eagerly: its executor over the same nodes and lanes, without a
        graph bank's callables."""
        old = self.executor
        executor = Executor(list(old.specs.values()), old.lanes, old.wgrad_queue, old.recorder,
                            grad_reduce=old.grad_reduce, hold=old.hold)
        return dataclasses.replace(self, executor=executor, graphs=None)
