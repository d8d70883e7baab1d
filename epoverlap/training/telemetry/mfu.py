"""Model FLOPs utilization: the dense bf16 peak of the GPU a run is on (`PEAK_BF16_TFLOPS`,
matched on substrings of `torch.cuda.get_device_name`) and the MFU of a step's Megatron-LM
TFLOP/s (`model.flops.megatron_flops_per_token`) against it. No MFU on CPU, in fp32
or on a GPU the table does not name."""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

# Dense (no sparsity) bf16 tensor-core peaks of NVIDIA's datasheets, TFLOP/s. First match
# wins: the PCIe/NVL parts (lower clocks and power) come before the SXM name they contain.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),
    ("A100", 312.0),  # SXM4 and PCIe alike
)


def peak_bf16_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a GPU by its name; None for one the table does not name."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


@lru_cache(maxsize=None)
def _device_peak(index: int) -> Optional[float]:
    return peak_bf16_tflops(torch.cuda.get_device_name(index))


def device_peak_tflops(device: torch.device, bf16: bool) -> Optional[float]:
    """The peak a run's MFU is taken against: bf16 runs on a named GPU only."""
    if device.type != "cuda" or not bf16:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_peak(index)


def mfu(tflops_per_gpu: float, peak_tflops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization, a fraction; None without a peak."""
    return None if peak_tflops is None else tflops_per_gpu / peak_tflops
