"""What a run tells the user and the logs: the step line, `--log-json` records, the start-up
banner and the run's summary (`metrics`: `Reporter`), TensorBoard (`tensorboard`) and W&B
(`wandb_log`) scalars, the MFU (`mfu`), the figures of a step every rank agrees on
(`step_stats`), and a rank's warning line outside the step log (`console`).

Imports the tuning room (the tuner's phases, for the step line) and `loop.stop` (each rank's
reasons to stop ride in the step's reduction).
"""
