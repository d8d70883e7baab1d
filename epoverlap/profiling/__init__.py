"""Profiling: span recording in the runtime (`recorder`: CUDA events or host clock per action,
NVTX ranges) and the span file format that the timeline tool reads (`spans`).

May import: schedule.plan (action names). Nothing imports it but the trainer and tools.
"""
