"""Parallel setup and communication: process groups (world = DP x EP) built once and passed
down (`groups`), the differentiable expert-parallel all-to-all (`comm`), and liveness: a dead
or stalled peer named in one line within the collective timeout (`watch`).

May import: config, errors. Never imports the model or the schedule.
"""
