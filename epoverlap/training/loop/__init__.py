"""The step and the loop: one run built once from a validated config (`build`: `RunParts`),
its execution paths, each a value built once (`path`: `ExecutionPath`), one optimizer step of
it by the path it is handed (`step`: `StepRunner`), the training loop (`trainer`: `Trainer`),
evaluation on validation data (`evaluate`), every rank agreeing on the step a run stops after
(`stop`), garbage collection between steps (`manual_gc`), the Triton compile watch
(`compile_watch`) and test-only fault injection (`faults`).

The room above the others of `training`: it may import every one of them.
"""
