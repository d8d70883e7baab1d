"""epoverlap.kernels: MoE token-routing ops (router top-k, permute, unpermute, chunk sort, row
gather and padding-row zeroing), the fused elementwise ops of the layers around them (RMSNorm,
rotary, SwiGLU), the embedding lookup, the loss (cross-entropy) and the experts' weight grads
added into their fp32 main grad (grouped wgrad).

Each op has a torch reference and a Triton kernel side by side (`router_topk.py` /
`router_topk_triton.py`, `permutation.py` / `permutation_triton.py` (its row-id map in
`permutation_map_triton.py`), `sort_chunks.py` / `sort_chunks_triton.py`, `rmsnorm.py`,
`rotary.py`, `swiglu.py`, `cross_entropy.py`, `grouped_wgrad.py`, `rows.py`, `embedding.py` and
their `*_triton.py`; `main_grad.py` holds the references' way of sending a weight's grad into
its fp32 main grad; `triton_ops.py` gathers the Triton ones; `triton_reduce.py` holds device-side
helpers they share; `launch_cache.py` is the host fast path of every Triton launch (the
compiled kernel reused per launch key); `megatron_api.py` gives the routing ops Megatron-core's
call signatures over either backend).
Outside the table, `adamw.py` / `adamw_triton.py` hold the optimizer's flat AdamW update, which
the optimizer's form chooses (`epoverlap.training.optimizer.flat_adam`).
The implementation is chosen once, by building an `MoEOps` table from the config's kernel
backend; model code calls `ops.permute(...)` and never branches on the backend itself.

Installed under the import name `epoverlap.kernels` (the source folder is `kernels/`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Callable, Optional

KERNEL_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class MoEOps:
    """One implementation of every op: the routing ops (permute, unpermute, sort_chunks_by_idxs
    and topk_routing_with_score_function take Megatron-core's signatures and keyword names, see
    `megatron_api`; router_topk / router_topk_with_counts are our keyword-only router), and
    rms_norm(x, weight, eps, main_grad=None), embedding(tokens_T, weight_VH, main_grad=None)
    (with main_grad, fp32 of the weight's shape, the weight's grad is added there by the
    backward and the weight gets none), rotary(x_BNSD, cos_SD2, sin_SD2),
    swiglu(h_M2F, probs_M=None),
    cross_entropy(logits_TV, labels_T, vocab=None) (vocab: the real vocabulary, columns from it
    on are an output layer's padding, out of the softmax), grouped_weight_grad(main_grad_EIO,
    x_NI, grad_NO, offsets_E, counts=None, sm_carveout=None) (main_grad[e] += x_e^T @ grad_e in
    fp32), gather_rows(src_X, index_Y) (src[index], a zero row where index < 0: a plain copy,
    `model.dispatch.rows.move_rows` is its autograd form) and zero_rows_from(x_M, end_1) (rows from
    the device-held end on zeroed; the Triton one writes into x: use the returned tensor)."""

    backend: str
    router_topk: Callable
    router_topk_with_counts: Callable
    topk_routing_with_score_function: Callable
    permute: Callable
    unpermute: Callable
    sort_chunks_by_idxs: Callable
    rms_norm: Callable
    embedding: Callable
    rotary: Callable
    swiglu: Callable
    cross_entropy: Callable
    grouped_weight_grad: Callable
    gather_rows: Callable
    zero_rows_from: Callable


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
    kernel = getattr(loaded, "_permute_kernel", None)
    if loaded is not None and type(getattr(kernel, "fn", kernel)).__name__ != "InterpretedFunction":
        return ("no CUDA device, and TRITON_INTERPRET=1 was set after the Triton kernels were "
                "imported: set it before importing epoverlap.kernels.triton_ops")
    return None


def _table(backend: str, module) -> MoEOps:
    """The table of `module`'s ops, the routing ops behind Megatron-core's signatures."""
    from .megatron_api import megatron_entries

    wrapped = megatron_entries(module)
    ops = {f.name: wrapped[f.name] if f.name in wrapped else getattr(module, f.name)
           for f in fields(MoEOps) if f.name != "backend"}
    return MoEOps(backend, **ops)


def make_moe_ops(backend: str) -> MoEOps:
    """The op table for `backend` ('torch' or 'triton').

    Raises ValueError for an unknown backend, or for 'triton' where it cannot run (the reason
    from `triton_unavailable_reason`).
    """
    if backend == "torch":
        from . import reference
        return _table("torch", reference)
    if backend == "triton":
        reason = triton_unavailable_reason()
        if reason is not None:
            raise ValueError(f"kernel backend 'triton': {reason}")
        from . import triton_ops
        return _table("triton", triton_ops)
    raise ValueError(f"kernel backend {backend!r}: allowed {KERNEL_BACKENDS}")


TRITON_KERNEL_MODULES = ("cross_entropy_triton", "embedding_triton", "grouped_wgrad_triton",
                         "permutation_map_triton",
                         "permutation_triton", "rmsnorm_triton", "rotary_triton",
                         "router_topk_triton", "rows_triton", "sort_chunks_triton", "swiglu_triton")


def _loaded_kernels():
    """(name, kernel) of every launched Triton kernel of the modules imported so far."""
    import sys

    for module_name in TRITON_KERNEL_MODULES:
        module = sys.modules.get(f"{__name__}.{module_name}")
        if module is None:
            continue
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and getattr(obj, "device_caches", None) is not None:
                yield name, obj


def set_launch_cache(enabled: bool) -> None:
    """Turn the per-shape launch cache (`launch_cache`) of every loaded kernel on or off: off,
    each launch takes Triton's own `JITFunction.run`, so the two paths can be compared (host
    time per launch; the GPU tests check that both compute the same bits)."""
    for _, kernel in _loaded_kernels():
        kernel.enabled = enabled


def launch_cache_stats() -> dict[str, tuple[int, int]]:
    """Kernel name -> (launches the launch cache served, launches it looked up and missed, each
    of which then went through Triton's path; launches with the cache off are in neither)."""
    return {name: (kernel.hits, kernel.misses) for name, kernel in _loaded_kernels()
            if hasattr(kernel, "hits")}


def triton_compiled_variants() -> Optional[dict[str, int]]:
    """Compiled variants of every Triton kernel in this process: kernel name -> count.

    A variant is one entry of a kernel's in-memory cache (one per distinct constexpr set and
    argument specialization): each new one cost a compile (or a disk-cache load) on the calling
    thread. None when the kernels were never imported or run under the interpreter (no cache).
    Row counts are excluded from specialization (`do_not_specialize`), so after the first step
    of a run this number stays flat; `Trainer` warns when it does not.
    """
    counts = {name: sum(len(entry[0]) for entry in kernel.device_caches.values())
              for name, kernel in _loaded_kernels()}
    return counts or None
