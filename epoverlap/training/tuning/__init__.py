"""The measured path tuner (`--tune`): the turns, timings, decision and its table (`tuner`),
and the decision kept for reruns of the same job (`tune_cache`, `--tune-cache DIR`). The paths
it chooses between, and its steps, are the config's (`config.tuning`); the run switches path
in `training.loop.build`.

Imports the telemetry room only (a rank's warning line).
"""
