"""Training: the trainer (`trainer`, a facade over `build`: the run's pieces built once,
`step`: one optimizer step, and `metrics`: the step line, JSON records, TensorBoard, summary),
data sources (`data`), optimizer and LR schedule (`optim`; its flat form `flat_adam`), fp32
grad buffers and their reduction (`grads`), checkpoints (`checkpoint`: the saved state and its resharding;
`checkpoint_files`: folders, atomic publishing, checks), the NaN/Inf check (`numerics`), the
path tuner (`tuner`, its cache `tune_cache`), the Triton compile watch (`compile_watch`), the
memory estimate (`memory`), the process environment (`environment`), Megatron-core checkpoint
conversion (`megatron_mapping`: names and checks, `megatron_checkpoint`: its folders,
`megatron_convert`: both directions) and test-only fault injection (`faults`).
The training command and the main-job launcher are `epoverlap.cli`.

The top layer: may import every other subpackage.
"""
