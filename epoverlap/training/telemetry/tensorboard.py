"""TensorBoard scalars of a run (`--tensorboard-dir DIR`), written by the first rank.

Owns `TensorBoardLog` and the tag of each scalar, Megatron-LM's tag where it has one, so runs of
both sit side by side in one TensorBoard:

  lm loss               mean loss over microbatches and ranks
  learning-rate         the step's learning rate
  grad-norm             global grad norm before clipping
  load_balancing_loss   Switch aux loss, summed over MoE layers
  load-imbalance        max over MoE layers of (most tokens on one expert / mean per expert)
  tokens-per-sec        tokens of the whole job per second of the step
  iteration-time        seconds per step
  throughput            model TFLOP/s per rank
  moe/dropped-tokens    routed (token, expert) pairs over capacity (--moe-expert-capacity-factor)
  moe/dispatch-reruns   reruns of the step after a budget overflow (--moe-dispatch-budget)
  lm loss validation      steps that evaluated (--eval-interval): the validation loss
  lm loss validation ppl  and its perplexity, exp(min(20, loss)) as Megatron-LM's
and, for steps recorded with --profile-steps, from the first rank's spans
(`profiling.overlap`): comm/comm-ms, comm/exposed-comm-ms, comm/overlap-ratio.

Needs the `tensorboard` package (the optional extra `tensorboard`); the x axis is the step.
`SCALAR_TAGS` is also what the W&B run logs (`training.telemetry.wandb_log`), under the same names.
"""

from __future__ import annotations

SCALAR_TAGS = {  # StepResult field -> tag
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "aux_loss": "load_balancing_loss",
    "load_imbalance": "load-imbalance",
    "tokens_per_s": "tokens-per-sec",
    "step_time_s": "iteration-time",
    "tflops_per_gpu": "throughput",
    "dropped_tokens": "moe/dropped-tokens",
    "dispatch_reruns": "moe/dispatch-reruns",
    "comm_ms": "comm/comm-ms",
    "exposed_comm_ms": "comm/exposed-comm-ms",
    "overlap_ratio": "comm/overlap-ratio",
    "valid_loss": "lm loss validation",
    "valid_ppl": "lm loss validation ppl",
}


def scalars_of(record: dict) -> dict[str, float]:
    """tag -> value of the scalars a step's JSON record holds."""
    return {tag: record[field] for field, tag in SCALAR_TAGS.items()
            if record.get(field) is not None}


class TensorBoardLog:
    """One event file under `directory`; `write(record)` takes a step's JSON record."""

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=directory)

    def write(self, record: dict) -> None:
        for tag, value in scalars_of(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
