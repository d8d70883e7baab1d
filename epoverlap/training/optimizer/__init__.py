"""Gradients and the optimizer: the fp32 grad buffers, their reduction and clipping (`grads`),
the NaN/Inf check before the reduction (`numerics`), AdamW over fp32 masters and the
learning-rate schedule (`optim`), and Adam's flat-buffer form (`flat_adam`).

Imports no other room of `training`.
"""
