"""Profiling: span recording in the runtime (`recorder`: CUDA events or host clock per action,
NVTX ranges; each action's wait on the other lane timed apart from its run), the span file
format that the timeline tool reads (`spans`), the interval math both use (`intervals`), a
step's exposed communication (`overlap`) and per compute node the compute time apart from the
waits, and two runs compared by it (`node_times`).

May import: schedule.plan (action names). Nothing imports it but the trainer and tools.
"""
