"""Kernel-test setup: skip the Triton tests where Triton cannot run, and say whether the
kernels are interpreted (CPU) or compiled (GPU). tests/conftest.py has already set
TRITON_INTERPRET=1 when there is no CUDA device."""

import pytest
import torch

from epoverlap.kernels import triton_unavailable_reason
from kernel_test_utils import INTERPRETED


@pytest.fixture(scope="session")
def triton_device() -> str:
    """Device the Triton kernels run on here: 'cpu' under the interpreter, else 'cuda'."""
    reason = triton_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
