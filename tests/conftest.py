"""Shared pytest setup.

Without a GPU, Triton kernels run under the Triton interpreter: TRITON_INTERPRET must be set
before any kernel is decorated, so it is set here, before project modules are imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
