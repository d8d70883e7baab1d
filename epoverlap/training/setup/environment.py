"""Process-wide settings a training process makes before CUDA init: CUDA stream connections,
NCCL's error handling, emulated hosts' NCCL identities and NCCL's log for the transport report,
deterministic algorithms, the seed; and the expert-parallel group's NCCL CTA budget from the
flags. Every command that builds a `Trainer` calls `setup_environment` first.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.utils.deterministic

from epoverlap.config import RunConfig
from epoverlap.parallel.groups import NcclCtaBudget
from epoverlap.parallel.transport import emulated_host_id, transport_log_env

NCCL_LOG_FOR_REPORT = "EPOVERLAP_NCCL_LOG"  # the NCCL log this process reads back, if any


def setup_environment(cfg: RunConfig, warn: Callable[[str], None]) -> None:
    """Process-wide settings that must precede CUDA init: stream connections, determinism,
    NCCL's error handling (its watchdog tears a rank down when a collective exceeds the
    timeout; the liveness monitor of parallel/watch.py names the silent peer just before)."""
    on_gpu = cfg.resolved_device(torch.cuda.is_available()) == "cuda"
    if on_gpu:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    _nccl_hosts_and_log(cfg, on_gpu)
    if on_gpu and cfg.overlap.overlap_moe_expert_parallel_comm:
        connections = os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8")
        if connections == "1":
            warn("CUDA_DEVICE_MAX_CONNECTIONS=1 puts both streams on one hardware queue: "
                 "the EP overlap gain roughly halves; unset it or set it > 1")
    if cfg.train.deterministic_mode:
        make_deterministic(on_gpu, cfg.train.deterministic_fill_uninitialized_memory)
    torch.manual_seed(cfg.train.seed)


def _nccl_hosts_and_log(cfg: RunConfig, on_gpu: bool) -> None:
    """--emulate-hosts: this rank's host identity (NCCL's; on gloo it names the rank's host in
    the lost-host line); --nccl-transport-report: NCCL's INFO log into a file of this process,
    named in NCCL_LOG_FOR_REPORT for the report after the first step (`parallel.transport`)."""
    p = cfg.parallel
    if p.emulate_hosts > 1:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        os.environ["NCCL_HOSTID"] = emulated_host_id(
            int(os.environ.get("LOCAL_RANK", "0")), local_world, p.emulate_hosts)
    if p.transport_report(on_gpu):
        log_env = transport_log_env()
        os.environ.update(log_env)
        if log_env:
            os.environ[NCCL_LOG_FOR_REPORT] = log_env["NCCL_DEBUG_FILE"]


def ep_cta_budget(cfg: RunConfig) -> NcclCtaBudget:
    """The expert-parallel communicator's NCCL CTA limits, from --moe-a2a-nccl-max/min-ctas."""
    return NcclCtaBudget(cfg.parallel.moe_a2a_nccl_max_ctas, cfg.parallel.moe_a2a_nccl_min_ctas)


def make_deterministic(on_gpu: bool, fill_uninitialized_memory: bool = False) -> None:
    """--deterministic-mode: every op of the training path deterministic, or the run fails loudly.

    `use_deterministic_algorithms(True)` without warn_only: an op with no deterministic
    implementation raises instead of warning, and scaled-dot-product attention leaves cuDNN
    attention out of its choice (nondeterministic backward) and runs flash attention's
    deterministic backward. cuBLAS gets a fixed workspace; NCCL's all-reduce a fixed algorithm
    (ring: each element reduced in ring order, the same in every run). The Triton kernels and
    the all-to-alls are deterministic by construction (no float atomics, copies only).

    torch's deterministic mode also fills the memory of every new tensor (NaN, or the largest
    integer) so that a result read from memory nothing wrote would be reproducible: one more
    kernel per allocation, half of the mode's eager price (benchmarks/determinism.md). No
    result of this training path reads such memory: a run with the fill and one without give
    the same bits (tests/training/test_determinism.py on CPU ranks, tests/training/test_gpu.py on GPUs), so the
    fill is left off unless `fill_uninitialized_memory` (--deterministic-fill-uninitialized-
    memory) asks for that check.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if on_gpu:
        os.environ.setdefault("NCCL_ALGO", "Ring")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized_memory
