"""GEMMs whose weight gradient can be split off the critical path: dense and grouped (experts).

Owns the autograd functions `linear` and `grouped_gemm`, `accumulate_weight_grad`,
`accumulate_weight_grad_gemm` and `accumulate_expert_weight_grad` (the dense and the experts'
weight grads added into `main_grad` by the GEMM itself: gradient-accumulation fusion, unless
--no-gradient-accumulation-fusion), and `fused_main_grad` (the main grad the norms' and the
embedding's ops add their weight grads into under the same rule). The GEMMs' backward computes
the input grad at once and offers the weight-grad GEMM to a `WeightGradQueue` (when one is
given): deferred, it runs later at the plan's `W` action; otherwise inline. Both paths run the
same GEMM and the same fp32 accumulation into `param.main_grad`, so deferring changes no bit of
any gradient.

Shape legend: N rows (tokens), I input features, O output features, E local experts.

Grouped GEMM: rows are sorted by expert; `offsets_E` (int32, device) holds the cumulative row
end of each expert. `torch._grouped_mm` is used where it runs (CUDA, or CPU for aligned
shapes); otherwise a loop of matmuls over the host-side `counts` (a correct fallback). Counts
None: only the device knows them (the budget dispatch) and rows past the last offset are
padding, which `torch._grouped_mm` leaves unwritten; the fallback then reads the offsets on the
host (it runs only where `_grouped_mm` does not, never on CUDA) and writes zeros there.
With an SM carveout (`--moe-grouped-gemm-sm-carveout`) each grouped GEMM leaves that many SMs
free for the all-to-all kernels running beside it on the comm stream.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from epoverlap.kernels.grouped_wgrad import grouped_weight_grad_torch
from epoverlap.parallel.watch import host_list


def accumulate_weight_grad(param: torch.Tensor, grad: torch.Tensor,
                           experts: Optional[tuple[int, int]] = None) -> None:
    """param.main_grad += grad (fp32 buffer), or into param.grad when no buffer is attached.
    `experts` (a, b): grad holds experts a..b-1 of an [E, ...] param (a wave of them)."""
    main_grad = getattr(param, "main_grad", None)
    if experts is not None:
        start, end = experts
        if main_grad is None and param.grad is None:
            param.grad = torch.zeros_like(param)
        (param.grad if main_grad is None else main_grad)[start:end].add_(grad)
    elif main_grad is not None:
        main_grad.add_(grad)
    elif param.grad is None:
        param.grad = grad.to(param.dtype).clone()
    else:
        param.grad.add_(grad)


# aten::addmm's dtype overload: a bf16/fp16 GEMM whose fp32 C is added to with beta = 1 (cuBLAS
# with half inputs and an fp32 C, Megatron-LM's fused wgrad call); registered on CUDA only
_ADDMM_INTO_FP32 = torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", "CUDA")


@functools.lru_cache(maxsize=8)
def _addmm_takes_fp32_c(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch's `addmm(fp32 C, half, half, out_dtype=fp32, out=C)` runs (its
    checks are on the host: a release that asked C in the inputs' dtype would raise here,
    once, and the GEMM then add would be taken instead)."""
    if not _ADDMM_INTO_FP32:
        return False
    c = torch.zeros(2, 2, device=device)
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError):
        return False
    return True


def fuses_weight_grad(param: torch.Tensor) -> bool:
    """Whether param's weight grads go into its fp32 `main_grad` inside the GEMM: a main grad is
    attached and `param.fuse_grad_accumulation` (set by the grad buffers unless
    --no-gradient-accumulation-fusion) is on."""
    return (getattr(param, "main_grad", None) is not None
            and getattr(param, "fuse_grad_accumulation", False))


def fused_main_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """param's fp32 `main_grad` where its weight grads go there directly (`fuses_weight_grad`):
    what the norms and the embedding hand their op (`kernels.MoEOps`), whose backward then adds
    the grad there; else None (autograd's grad, which the grad buffers' hook adds)."""
    return param.main_grad if fuses_weight_grad(param) else None


def _addmm_into(main_grad: torch.Tensor, grad_NO: torch.Tensor, x_NI: torch.Tensor) -> bool:
    """main_grad += grad^T @ x as one GEMM when one exists for these dtypes; False otherwise."""
    if x_NI.dtype == main_grad.dtype:  # fp32 training
        main_grad.addmm_(grad_NO.t(), x_NI)
        return True
    if (x_NI.is_cuda and main_grad.dtype == torch.float32
            and x_NI.dtype in (torch.bfloat16, torch.float16)
            and _addmm_takes_fp32_c(x_NI.dtype, x_NI.device)):
        torch.addmm(main_grad, grad_NO.t(), x_NI, out_dtype=torch.float32, out=main_grad)
        return True
    return False


def accumulate_weight_grad_gemm(param: torch.Tensor, grad_NO: torch.Tensor,
                                x_NI: torch.Tensor) -> None:
    """param's grad += grad^T @ x. Fused (`fuses_weight_grad`), the GEMM accumulates into
    `main_grad` itself (beta = 1, Megatron-LM's gradient-accumulation fusion): fp32 training
    by `addmm_`; bf16/fp16 by torch's `addmm` with an fp32 `out_dtype` on CUDA, which runs
    cuBLAS with half-precision inputs and the fp32 main grad as C, so no half-precision product
    is written and no add runs. Unfused, or where no such GEMM exists (half precision on the
    CPU), the GEMM writes the product and `accumulate_weight_grad` adds it. Every mode
    (inline or deferred, overlapped or not) takes the same branch for a parameter, so they keep
    the same bits."""
    if fuses_weight_grad(param) and _addmm_into(param.main_grad, grad_NO, x_NI):
        return
    accumulate_weight_grad(param, grad_NO.t() @ x_NI)


def _run_or_defer(queue, work) -> None:
    if queue is None or not queue.defer(work):
        work()


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, weight_OI, queue):
        ctx.save_for_backward(x_NI, weight_OI)
        ctx.queue = queue
        return x_NI @ weight_OI.t()

    @staticmethod
    def backward(ctx, grad_NO):
        x_NI, weight_OI = ctx.saved_tensors
        grad_x_NI = grad_NO @ weight_OI if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            def weight_grad_work(grad_NO=grad_NO, x_NI=x_NI, weight_OI=weight_OI):
                accumulate_weight_grad_gemm(weight_OI, grad_NO.reshape(-1, grad_NO.shape[-1]),
                                            x_NI.reshape(-1, x_NI.shape[-1]))
            _run_or_defer(ctx.queue, weight_grad_work)
        return grad_x_NI, None, None


def linear(x_NI: torch.Tensor, weight_OI: torch.nn.Parameter, queue=None) -> torch.Tensor:
    """y = x @ W^T (no bias), with a deferrable weight grad."""
    return _Linear.apply(x_NI, weight_OI, queue)


def _grouped_mm_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if a.is_cuda:
        return True
    # torch's CPU kernel needs each operand's leading dimension (the stride of its last two
    # dims that is not the unit one) to be a multiple of 16 bytes; a transposed operand carries
    # its row width there (the weight grad's x^T: a fuzzed --moe-ffn-hidden-size 3 found
    # this), and a width-1 operand has two unit strides (--moe-ffn-hidden-size 1). The output's
    # row width (b's last dim) is asked aligned too, as before: where torch would also run
    # without it, the loop stays the path taken, so results keep their bits.
    return (_leading_dim_aligned(a) and _leading_dim_aligned(b)
            and (b.shape[-1] * a.element_size()) % 16 == 0 and a.dtype == torch.float32)


def _leading_dim_aligned(t: torch.Tensor) -> bool:
    """The last two dims are row- or column-major with the leading stride a multiple of 16
    bytes (torch's `_grouped_mm` stride check, mirrored so the fallback runs instead)."""
    align = 16 // t.element_size()
    row_stride, col_stride = t.stride()[-2], t.stride()[-1]
    rows, cols = t.shape[-2], t.shape[-1]
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride % align == 0
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride % align == 0
    return False


def _host_counts(offsets_E: torch.Tensor, num_rows: int) -> list[int]:
    """Per-group rows from the device offsets, plus a last entry: the padding rows (a sync)."""
    ends = host_list(offsets_E)
    return [end - start for start, end in zip([0] + ends, ends)] + [num_rows - ends[-1]]


def _carved_grouped_mm(a, b, offsets_E, sm_carveout: Optional[int]) -> torch.Tensor:
    """`torch._grouped_mm`, on all SMs but `sm_carveout` when given (torch's process-wide SM
    carveout, set for this one launch and put back: the dense GEMMs keep every SM, and with it
    the cuBLAS algorithm and bits they always had). Its CUTLASS kernel is persistent, one CTA
    per SM it is given, each output tile summed over the full K by one CTA, so fewer SMs change
    which CTA computes a tile, not its bits."""
    if sm_carveout is None:
        return torch._grouped_mm(a, b, offs=offsets_E)
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sm_carveout)
    try:
        return torch._grouped_mm(a, b, offs=offsets_E)
    finally:
        torch._C._set_sm_carveout_experimental(before)


def _mm_grouped(a_NI, b_EIO, offsets_E, counts, sm_carveout=None):
    """Row-grouped A [N, I] x per-group B [E, I, O] -> [N, O]."""
    if a_NI.shape[0] == 0:  # a rank that received no token
        return a_NI.new_empty((0, b_EIO.shape[-1]))
    if _grouped_mm_runs(a_NI, b_EIO):
        return _carved_grouped_mm(a_NI, b_EIO, offsets_E, sm_carveout)
    sizes = _host_counts(offsets_E, a_NI.shape[0]) if counts is None else list(counts) + [0]
    pieces = torch.split(a_NI, sizes)
    outs = [p @ b_EIO[e] for e, p in enumerate(pieces[:-1])]
    return torch.cat(outs + [a_NI.new_zeros((sizes[-1], b_EIO.shape[-1]))], dim=0)


def _mm_weight_grad(x_NI, grad_NO, offsets_E, counts, num_experts, sm_carveout=None):
    """Per group x_g^T @ grad_g -> [E, I, O] (zero for empty groups)."""
    x_IN = x_NI.t()
    if _grouped_mm_runs(x_IN, grad_NO) and x_NI.shape[0] > 0:
        return _carved_grouped_mm(x_IN, grad_NO, offsets_E, sm_carveout)
    if counts is None:
        counts = _host_counts(offsets_E, x_NI.shape[0])
    xs, gs = torch.split(x_NI, counts), torch.split(grad_NO, counts)
    out = x_NI.new_zeros((num_experts, x_NI.shape[1], grad_NO.shape[1]))
    for e in range(num_experts):
        if counts[e]:
            out[e] = xs[e].t() @ gs[e]
    return out


def _expert_weights(weight_EIO: torch.Tensor, experts: Optional[tuple[int, int]]):
    return weight_EIO if experts is None else weight_EIO[experts[0]:experts[1]]


def accumulate_expert_weight_grad(param_EIO, x_NI, grad_NO, offsets_E, counts, experts,
                                  sm_carveout, grouped_weight_grad, queue=None) -> None:
    """param's grad (of experts a..b-1 when `experts` is (a, b)) += per expert x_e^T @ grad_e.
    Fused (`fuses_weight_grad`): `grouped_weight_grad` (the op table's, `epoverlap.kernels`)
    adds the product into `main_grad` inside the GEMM, where the queue (`schedule.wgrad`)
    places it: paired with the next microbatch's rows, or overwriting the main grad as the
    run's first; otherwise the grouped GEMM writes the product [E, I, O] and
    `accumulate_weight_grad` adds it."""
    if not fuses_weight_grad(param_EIO):
        num_experts = _expert_weights(param_EIO, experts).shape[0]
        accumulate_weight_grad(param_EIO, _mm_weight_grad(
            x_NI, grad_NO, offsets_E, counts, num_experts, sm_carveout), experts)
        return
    main_grad = param_EIO.main_grad

    def run(sources: list, accumulate: bool) -> None:
        if experts is not None and not accumulate:  # a wave of the experts: zero them all once
            main_grad.zero_()
            accumulate = True
        (x, grad, offsets, known), more = sources[0], sources[1:]
        grouped_weight_grad(_expert_weights(main_grad, experts), x, grad, offsets,
                            counts=known, sm_carveout=sm_carveout,
                            more=tuple(more[0][:3]) if more else None, accumulate=accumulate)

    rows = (x_NI, grad_NO, offsets_E, counts)
    if queue is None:
        run([rows], True)
    else:
        queue.expert_grad(id(param_EIO), experts, rows, run)


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, weight_EIO, offsets_E, counts, queue, sm_carveout, experts,
                grouped_weight_grad):
        ctx.save_for_backward(x_NI, weight_EIO, offsets_E)
        ctx.counts, ctx.queue, ctx.sm_carveout = counts, queue, sm_carveout
        ctx.experts, ctx.grouped_weight_grad = experts, grouped_weight_grad
        return _mm_grouped(x_NI, _expert_weights(weight_EIO, experts), offsets_E, counts,
                           sm_carveout)

    @staticmethod
    def backward(ctx, grad_NO):
        x_NI, weight_EIO, offsets_E = ctx.saved_tensors
        counts, carveout, experts = ctx.counts, ctx.sm_carveout, ctx.experts
        fused_op = ctx.grouped_weight_grad
        weights = _expert_weights(weight_EIO, experts)
        grad_NO = grad_NO.contiguous()
        grad_x_NI = _mm_grouped(grad_NO, weights.transpose(1, 2), offsets_E, counts, carveout)
        if ctx.needs_input_grad[1]:
            def weight_grad_work(x_NI=x_NI, grad_NO=grad_NO, weight_EIO=weight_EIO):
                accumulate_expert_weight_grad(weight_EIO, x_NI, grad_NO, offsets_E, counts,
                                              experts, carveout, fused_op, ctx.queue)
            _run_or_defer(ctx.queue, weight_grad_work)
        return grad_x_NI, None, None, None, None, None, None, None


def grouped_gemm(x_NI: torch.Tensor, weight_EIO: torch.nn.Parameter, offsets_E: torch.Tensor,
                 counts: Optional[list[int]], queue=None,
                 sm_carveout: Optional[int] = None,
                 experts: Optional[tuple[int, int]] = None,
                 grouped_weight_grad: Callable = grouped_weight_grad_torch) -> torch.Tensor:
    """Rows of expert e (counts[e] of them, in order) times weight[e]; deferrable weight grad.
    counts None: see the module docstring (device-only counts, padding rows at the end).
    `sm_carveout`: SMs the forward, input-grad and weight-grad GEMMs leave free (CUDA).
    `experts` (a, b): the rows are those of experts a..b-1 only (a wave of them,
    `model.waves`): weight[a:b] multiplies them and their weight grad lands there.
    `grouped_weight_grad`: the op table's (`MoEOps.grouped_weight_grad`) that adds the weight
    grad into the fp32 main grad when the weight's grad accumulation is fused."""
    return _GroupedGemm.apply(x_NI, weight_EIO, offsets_E, counts, queue, sm_carveout,
                              experts, grouped_weight_grad)


def expert_offsets(counts_E: torch.Tensor) -> torch.Tensor:
    """Cumulative row ends per expert, int32, as torch._grouped_mm wants them."""
    return torch.cumsum(counts_E, 0).to(torch.int32)
