"""A run's execution path: one way to run the step, built once, as a value.

Owns `ExecutionPath`. A path is what a step runs by: its spec (`config.tuning.TunePath`: its
name, its plan's name, weight-grad deferral, chunks of the all-to-alls, dispatch once per rank,
the all-to-alls' transport), this stage's plan (made from the plan's name through the registry
`schedule.plan.PLANS`), the dispatcher of its MoE layers, the executor of its nodes (the model's
pure `node_specs(chunks=..., dispatch=...)`) on its lanes, and its CUDA graph banks
(`graphs.banks.StepGraphs`; None without graphs). One builder makes every path
(`RunParts.build_path` in `training.loop.build`): the flags' path, or with the path tuner one
per candidate. Nothing is switched between paths: the step is handed the path it runs
(`training.loop.step`), and the path sets, as it starts, the two things every path shares: the
weight-grad queue's deferral and whether the all-to-alls go through host memory (`engage`).
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
    from epoverlap.parallel.comm import ExpertComm
    from epoverlap.schedule.wgrad import WeightGradQueue


@dataclass(frozen=True)
class ExecutionPath:
    """One path, built (module docstring). `wgrad_queue` and `comm` are the run's own, which
    `engage` sets for this path."""

    spec: TunePath
    plan: list
    executor: Executor
    dispatcher: Optional[TokenDispatcher]
    graphs: Optional[StepGraphs]
    wgrad_queue: WeightGradQueue
    comm: ExpertComm

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def lanes(self):
        return self.executor.lanes

    def engage(self) -> None:
        """Before this path runs a forward: weight grads deferred as it says, the all-to-alls
        through host memory where it says so and the run has the transport."""
        self.wgrad_queue.enabled = self.spec.delay_wgrad
        self.comm.host_memory = self.spec.host_memory and self.comm.transport is not None

    def without_graphs(self) -> ExecutionPath:
        """The same path run eagerly: its executor over the same nodes and lanes, without a
        graph bank's callables."""
        old = self.executor
        executor = Executor(list(old.specs.values()), old.lanes, old.wgrad_queue, old.recorder,
                            grad_reduce=old.grad_reduce, hold=old.hold)
        return dataclasses.replace(self, executor=executor, graphs=None)
