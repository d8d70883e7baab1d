"""epoverlap_kernels: MoE token-routing ops (router top-k, permute, unpermute, chunk sort) and
the fused elementwise ops of the layers around them (RMSNorm, rotary, SwiGLU).

Each op has a torch reference and a Triton kernel side by side (`router_topk.py` /
`router_topk_triton.py`, `permutation.py` / `permutation_triton.py`, `sort_chunks.py` /
`sort_chunks_triton.py`, `rmsnorm.py`, `rotary.py`, `swiglu.py` and their `*_triton.py`;
`triton_ops.py` gathers the Triton ones). The implementation is chosen
once, by building an `MoEOps` table from the config's kernel backend;
model code calls `ops.permute(...)` and never branches on the backend itself.

Installed under the import name `epoverlap_kernels` (the source folder is `kernels/`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

KERNEL_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class MoEOps:
    """One implementation of every op: the routing ops with Megatron-core compatible signatures,
    and rms_norm(x, weight, eps), rotary(x_BNSD, cos_SD2, sin_SD2), swiglu(h_M2F, probs_M=None)."""

    backend: str
    router_topk: Callable
    router_topk_with_counts: Callable
    permute: Callable
    unpermute: Callable
    sort_chunks_by_idxs: Callable
    rms_norm: Callable
    rotary: Callable
    swiglu: Callable


def triton_installed() -> bool:
    """Whether `import triton` would find it (without importing it: CPU runs never load it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # sys.modules["triton"] is None: imports of it are blocked
        return False


def triton_unavailable_reason() -> Optional[str]:
    """None when the Triton kernels can run here (triton installed, and CUDA present or
    TRITON_INTERPRET=1), else why.

    Without either, the first kernel launch would fail with "0 active drivers"; callers check
    this instead. TRITON_INTERPRET only counts if it was set before the kernels were decorated
    (imported).
    """
    import sys

    import torch

    if not triton_installed():
        return "triton is not installed: pip install -e '.[triton]', or use --kernel-backend torch"
    if torch.cuda.is_available():
        return None
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "no CUDA device and TRITON_INTERPRET is not set: use --kernel-backend torch"
    loaded = sys.modules.get(f"{__name__}.permutation_triton")
    if loaded is not None and type(loaded._permute_kernel).__name__ != "InterpretedFunction":
        return ("no CUDA device, and TRITON_INTERPRET=1 was set after the Triton kernels were "
                "imported: set it before importing epoverlap_kernels.triton_ops")
    return None


def make_moe_ops(backend: str) -> MoEOps:
    """The op table for `backend` ('torch' or 'triton').

    Raises ValueError for an unknown backend, or for 'triton' where it cannot run (the reason
    from `triton_unavailable_reason`).
    """
    if backend == "torch":
        from . import reference
        return MoEOps("torch", reference.router_topk,
                      reference.router_topk_with_counts, reference.permute, reference.unpermute,
                      reference.sort_chunks_by_idxs, rms_norm=reference.rms_norm,
                      rotary=reference.rotary, swiglu=reference.swiglu)
    if backend == "triton":
        reason = triton_unavailable_reason()
        if reason is not None:
            raise ValueError(f"kernel backend 'triton': {reason}")
        from . import triton_ops
        return MoEOps("triton", triton_ops.router_topk,
                      triton_ops.router_topk_with_counts, triton_ops.permute, triton_ops.unpermute,
                      triton_ops.sort_chunks_by_idxs, rms_norm=triton_ops.rms_norm,
                      rotary=triton_ops.rotary, swiglu=triton_ops.swiglu)
    raise ValueError(f"kernel backend {backend!r}: allowed {KERNEL_BACKENDS}")
