"""Checkpoints and Megatron-LM interop: the saved training state and its resharding
(`checkpoint`), the folders on disk and their atomic publishing (`checkpoint_files`), and
Megatron-core torch_dist checkpoints in and out (`megatron_mapping`: which tensor is which,
`megatron_checkpoint`: its folders, `megatron_convert`: both directions). Megatron-LM's flags
are the config's (`config.compat`); its routing ops' call signatures are the kernels'
(`kernels.megatron_api`).

Imports the optimizer room (the optimizer's state) and the setup room (the data's vocabulary).
"""
