"""Shared pytest setup.

Without a GPU, Triton kernels run under the Triton interpreter: TRITON_INTERPRET must be set
before any kernel is decorated, so it is set here, before project modules are imported.

Without a GPU, torch runs one intra-op thread here and in the processes the tests start
(OMP_NUM_THREADS, unless set): the tests' tensors are tiny, and on a 2-core machine two OpenMP
threads per op, beside the executor's lane threads and other processes, made the schedule A/B
of tests/benchmarks/test_bench_host.py 8x slower (92 s of CPU against 11 s).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (GPU machines keep torch's own count otherwise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

