"""Training: one run of the training command, in rooms with one owner each:

  loop         the step and the loop: `Trainer`, the run built once (`build.RunParts`) with
               its execution paths (`path.ExecutionPath`), one optimizer step
               (`step.StepRunner`), evaluation, stopping, manual GC, the
               Triton compile watch, test-only fault injection
  setup        what a command sets and checks before it builds a run: the process
               environment, data sources and the steps' feed, the memory estimate
  optimizer    fp32 grad buffers and their reduction, the NaN/Inf check, AdamW and its flat
               form, the learning-rate schedule
  tuning       the measured path tuner (`--tune`) and its cache
  checkpoints  the saved state, its folders, Megatron-core checkpoints in and out
  telemetry    the step line, `--log-json`, TensorBoard, W&B, MFU, the step's agreed figures,
               a rank's warning line

`loop` may import every other room; the others import each other only as their own
docstrings say. The training command and the main-job launcher are `epoverlap.cli`.

The top layer: may import every other subpackage.
"""
