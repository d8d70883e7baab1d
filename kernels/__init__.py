"""epoverlap_kernels: MoE token-routing ops (router top-k, permute, unpermute, chunk sort).

Each op has a torch reference and a Triton kernel side by side (one file per op). The
implementation is chosen once, by building an `MoEOps` table from the config's kernel backend;
model code calls `ops.permute(...)` and never branches on the backend itself.

Installed under the import name `epoverlap_kernels` (the source folder is `kernels/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

KERNEL_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class MoEOps:
    """One implementation of every routing op, with Megatron-core compatible signatures."""

    backend: str
    router_topk: Callable
    router_topk_with_counts: Callable
    permute: Callable
    unpermute: Callable
    sort_chunks_by_idxs: Callable


def make_moe_ops(backend: str) -> MoEOps:
    """The op table for `backend` ('torch' or 'triton')."""
    if backend == "torch":
        from . import reference
        return MoEOps("torch", reference.router_topk,
                      reference.router_topk_with_counts, reference.permute, reference.unpermute,
                      reference.sort_chunks_by_idxs)
    if backend == "triton":
        from . import triton_ops
        return MoEOps("triton", triton_ops.router_topk,
                      triton_ops.router_topk_with_counts, triton_ops.permute, triton_ops.unpermute,
                      triton_ops.sort_chunks_by_idxs)
    raise ValueError(f"kernel backend {backend!r}: allowed {KERNEL_BACKENDS}")
