"""Parallel setup and communication: process groups (world = DP x EP) built once and passed
down (`groups`), and the differentiable expert-parallel all-to-all (`comm`).

May import: config, errors. Never imports the model or the schedule.
"""
