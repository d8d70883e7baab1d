"""Profiling: span recording in the runtime (`recorder`: CUDA events or host clock per action,
NVTX ranges; each action's wait on the other lane timed apart from its run), the span file
format that the timeline tool reads (`spans`), the interval math both use (`intervals`), a
step's exposed communication (`overlap`) and per compute node the compute time apart from the
waits, and two runs compared by it (`node_times`). The timeline tool's analysis: the summary
of a run's steps and its metric definitions (`summary`), torch.profiler traces (`torch_trace`),
the merged Perfetto trace and its reader (`chrome_trace`), the Gantt chart (`gantt`).

May import: model.stages (a trace's layer labels). Nothing imports it but the trainer, the
simulator and the commands.
"""
