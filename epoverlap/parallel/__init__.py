"""Parallel setup and communication: process groups (world = PP x DP, DP = EP x EDP, in
Megatron-core's order) built once and passed down (`groups`), the differentiable
expert-parallel all-to-all and the transfers between pipeline stages (`comm`), and liveness:
a dead or stalled peer named in one line within the collective timeout (`watch`).

May import: config, errors. Never imports the model or the schedule.
"""
