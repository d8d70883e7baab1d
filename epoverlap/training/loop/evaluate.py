"""Evaluation on validation data (--eval-interval N --eval-iters K).

Owns `Evaluator` (its result is `training.telemetry.metrics.EvalResult`). Every N steps and after
the last step (`Evaluator.due`), the mean loss over K global batches of the run's validation data
(`training.setup.data.validation_source`: the --split valid part of --data-path, or a fresh
--mock-data stream). Evaluation e of a run (e = ceil(step / N), so a resumed run reads what the
uninterrupted one would) reads validation batches (e - 1) * K + 1 .. e * K, as Megatron-LM's
validation iterator moves on from one evaluation to the next.

Each batch is a forward only (torch.no_grad, the model in eval mode: dropout off) of this
rank's microbatches through `MoEModel.stage_forward`, by the dispatch and all-to-all transport
of the path the step ran (`StepRunner.path_of`), one microbatch at a time through this
stage's chunks in order (with pipeline stages each receives from the stage before and sends to
the next; the stage holding the head has the losses), on every rank alike: the forward holds
the MoE all-to-alls, so every rank runs the same batches. With the budget dispatch a batch
whose dispatch overflowed is rerun at the level that holds it (`StepRunner.overflow_level`),
never cut. The loss is the mean over
microbatches, batches and data-parallel ranks (summed over the DP group, then the pipeline,
as the training loss is), one host read per evaluation.

Evaluation changes nothing training computes: the router's force-balancing generators, torch's
global RNG and the budget level are restored afterwards, the data sources are pure functions
of their indices, and the routers' per-step scratch (counts, aux loss) is zeroed by the next
step before use.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from epoverlap.parallel.watch import host_list
from epoverlap.training.loop.build import router_generators
from epoverlap.training.setup.data import evaluates, step_batches, validation_source
from epoverlap.training.telemetry.metrics import EvalResult

if TYPE_CHECKING:
    from epoverlap.config import RunConfig
    from epoverlap.model.transformer import MoEModel
    from epoverlap.parallel.groups import ParallelGroups
    from epoverlap.training.loop.step import StepRunner

class Evaluator:
    """Evaluation of one built run (module docstring); `run` is a collective."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, model: MoEModel, data,
                 stepper: StepRunner):
        """`data`: the run's training source (the validation data follows it, see
        `validation_source`); `stepper`: the run's step (its budget reruns and clock)."""
        self.cfg, self.groups, self.device, self.model = cfg, groups, groups.device, model
        self.budget, self.stepper = model.dispatch_budget, stepper
        self.enabled = evaluates(cfg)
        self.data = validation_source(cfg, groups.data_size, data) if self.enabled else None

    def due(self, step: int) -> bool:
        if not self.enabled:
            return False
        return step % self.cfg.eval.eval_interval == 0 or step == self.cfg.train.train_iters

    def maybe_run(self, step: int) -> Optional[EvalResult]:
        return self.run(step) if self.due(step) else None

    def run(self, step: int) -> EvalResult:
        """The validation loss after `step` (every rank calls it)."""
        iters = self.cfg.eval.eval_iters
        first = (math.ceil(step / self.cfg.eval.eval_interval) - 1) * iters + 1
        start = self.stepper.sync_time()
        generators = router_generators(self.model)
        states = [g.get_state() for g in generators]
        level = self.budget.level if self.budget is not None else None
        was_training = self.model.training
        cuda = [self.device] if self.device.type == "cuda" else []
        self.model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                losses, reruns = [], 0
                path = self.stepper.path_of(step)
                path.engage()
                for index in range(first, first + iters):
                    batch_losses, batch_reruns = self._batch(index, path.dispatcher)
                    losses += batch_losses
                    reruns += batch_reruns
                loss = self._mean_over_ranks(losses)
        finally:
            self.model.train(was_training)
            for generator, state in zip(generators, states):
                generator.set_state(state)
            self.stepper.select_budget_level(level if level is not None else 0)
        return EvalResult(step, loss, self.stepper.sync_time() - start, iters, reruns)

    def _batch(self, index: int, dispatch) -> tuple[list[torch.Tensor], int]:
        """Global validation batch `index`: this rank's microbatch losses by `dispatch`, rerun
        at a larger budget level while the dispatch overflowed, as a training step is
        (`StepRunner.until_it_fits`). -> (losses, reruns)."""
        t = self.cfg.train
        batches = step_batches(self.data, index, self.groups.data_rank, t.num_microbatches,
                               t.micro_batch_size, self.cfg.model.seq_length)
        if self.model.documents is not None:
            self.model.documents.check_batches(batches)
        inputs = [(tokens.to(self.device), labels.to(self.device)) for tokens, labels in batches]
        return self.stepper.until_it_fits(lambda level: self._forward(inputs, level, dispatch))

    def _forward(self, inputs: list, level: int, dispatch) -> list[torch.Tensor]:
        self.stepper.select_budget_level(level)
        if self.budget is not None:
            self.budget.reset_demand()
        waves = self.cfg.overlap.moe_a2a_waves  # the flags' waves, whichever path ran
        losses = [self.model.stage_forward(tokens, labels, dispatch=dispatch, waves=waves)
                  for tokens, labels in inputs]
        return [loss.detach().float() for loss in losses if loss is not None]

    def _mean_over_ranks(self, losses: list[torch.Tensor]) -> float:
        """Mean of every microbatch loss of every data-parallel rank (fp64 sums of the losses
        and their count, over the DP group, then over the pipeline, where only the stage holding
        the head has losses; one read)."""
        g = self.groups
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if losses:
            total[0] = torch.stack(losses).double().sum()
        total[1] = len(losses)
        if g.dp_size > 1:
            g.dp.all_reduce(total)
        if g.pp_size > 1:
            g.pp.all_reduce(total)
        loss_sum, count = host_list(total)
        return loss_sum / count
