"""Training: the trainer (`trainer`), the training command (`main`), the main-job launcher
(`launch`), data sources (`data`), optimizer and LR schedule (`optim`), fp32 grad buffers and
their reduction (`grads`), checkpoints (`checkpoint`: the saved state and its resharding;
`checkpoint_files`: folders, atomic publishing, checks), the NaN/Inf check (`numerics`) and
test-only fault injection (`faults`).

The top layer: may import every other subpackage.
"""
