"""Whether every pipeline stage fits one rank, checked before any process group exists.

Owns `stage_state_bytes` (what one rank of a stage needs for its parameters, their fp32 grads,
the fp32 master copies of a bf16 model and AdamW's two fp32 moments, counted on a shape-only
(meta) model of that stage, so the count is the model's own), `memory_per_rank` (the device's
memory on GPUs; the host's available memory shared by this node's ranks on CPUs) and
`check_stages_fit`, which refuses a run whose largest stage cannot fit: one line naming
--pipeline-model-parallel-size. Activations are left out: this is a floor, and a stage that
fails it cannot run at any batch size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from epoverlap_kernels import make_moe_ops

from epoverlap.config import RunConfig
from epoverlap.errors import ConfigError
from epoverlap.model.stages import describe_layers, stage_layers
from epoverlap.model.transformer import MoEModel, model_dtype
from epoverlap.parallel.comm import ExpertComm, PipelineComm

GIB = 2**30
FP32_BYTES = 4


def stage_state_bytes(cfg: RunConfig, stage: int) -> int:
    """Bytes of one rank of `stage`: each of its parameters (its 1/EP share of the experts)
    in the model dtype, its fp32 main_grad, an fp32 master copy unless the model is fp32, and
    AdamW's two fp32 moments."""
    dtype = model_dtype(cfg)
    pp, ep = cfg.parallel.pipeline_model_parallel_size, cfg.parallel.expert_model_parallel_size
    meta = torch.device("meta")
    pipe = PipelineComm(None, tuple(range(pp)), (1,), dtype, meta) if pp > 1 else None
    model = MoEModel(cfg, ExpertComm(None, ep), 0, make_moe_ops("torch"), dtype=dtype,
                     device=meta, stage=stage, pipe=pipe)
    elements = sum(p.numel() for p in model.parameters())
    master = 0 if dtype == torch.float32 else FP32_BYTES
    per_element = torch.empty((), dtype=dtype).element_size() + FP32_BYTES + master \
        + 2 * FP32_BYTES
    return elements * per_element


def memory_per_rank(cfg: RunConfig) -> Optional[int]:
    """Bytes one rank may use: its GPU's memory, or the host's available memory divided by
    the ranks of this node (LOCAL_WORLD_SIZE). None when unknown."""
    if cfg.resolved_device(torch.cuda.is_available()) == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            return None  # the process-group setup reports that
        return torch.cuda.get_device_properties(local_rank).total_memory
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            return int(line.split()[1]) * 1024 // max(local_ranks, 1)
    return None


def check_stages_fit(cfg: RunConfig, capacity: Optional[int]) -> None:
    """ConfigError naming --pipeline-model-parallel-size if the largest stage's parameter
    states exceed `capacity` bytes (None: unknown, not checked)."""
    if capacity is None:
        return
    pp = cfg.parallel.pipeline_model_parallel_size
    needs = [stage_state_bytes(cfg, stage) for stage in range(pp)]
    worst = max(range(pp), key=needs.__getitem__)
    if needs[worst] <= capacity:
        return
    layers = describe_layers(stage_layers(cfg.model.num_layers, pp, cfg.virtual_stages, worst))
    more_ep = " or more expert parallelism" if cfg.moe.enabled else ""
    raise ConfigError("--pipeline-model-parallel-size", pp,
                      f"stage {worst} ({layers}) needs {needs[worst] / GIB:.1f} GiB for its "
                      f"parameters, fp32 grads and AdamW states alone, more than the "
                      f"{capacity / GIB:.1f} GiB of memory per rank here; use more pipeline "
                      f"stages{more_ep}")
