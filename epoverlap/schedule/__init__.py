"""Schedules: plans as data (`plan`), pipeline schedules across stages (`pipeline`), the
executor that alone owns streams, events and the comm thread (`executor`), nodes cut out of
autograd (`node_run`), the weight-grad queue (`wgrad`).

May import: model.nodes (the node protocol), graphs (the run factory). Never imports the
model's layers: it sees nodes only as `NodeSpec`s.
"""
