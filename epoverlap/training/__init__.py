"""Training: the trainer (`trainer`), the training command (`main`), the main-job launcher
(`launch`), data sources (`data`), optimizer and LR schedule (`optim`), fp32 grad buffers and
their reduction (`grads`).

The top layer: may import every other subpackage.
"""
