"""Profiling: span recording in the runtime (`recorder`: CUDA events or host clock per action,
NVTX ranges), the span file format that the timeline tool reads (`spans`) and the interval
math both use (`intervals`).

May import: schedule.plan (action names). Nothing imports it but the trainer and tools.
"""
