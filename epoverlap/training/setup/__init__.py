"""What a command sets and checks before it builds a run: the process environment before CUDA
init (`environment`), the data sources and the feed of each step's batches (`data`), and the
memory estimate checked against the device before anything is allocated (`memory`).

Imports the optimizer room only (where the experts' weight grads go, for the estimate).
"""
