"""Where the host time of one kernel op call goes, piece by piece (one GPU).

    python -m benchmarks.harness.bench_launch [--rows 1024] [--hidden 512] [--calls 200] [--repeats 15]

Times, on the host, each layer of one RMSNorm forward op call at a small (host-bound) shape,
from the bare pieces up to the whole autograd op:

  - torch.empty of the output, an elementwise torch op (`add_`), a small `torch.mm`;
  - an autograd Function that does nothing: through `Function.apply` and through the C
    `_FunctionBase.apply` under it (what `apply`'s Python wrapper costs);
  - the compiled kernel's launcher alone (`CompiledKernel.run`, Triton's C launcher);
  - the launch through the launch cache (`epoverlap.kernels.launch_cache`), and through
    Triton's own `JITFunction.run`;
  - the op's launch helper (output allocations + the cached launch);
  - the whole op, without and with autograd (a leaf input that requires grad).

Then grouped-query attention forward + backward at the small model's shape two ways: K/V
expanded with `repeat_interleave` before SDPA, and SDPA's own `enable_gqa=True` (host us per
call and GPU ms per call from CUDA events, same inputs; max abs difference of the outputs).
And `torch.mm` at the small model's GEMM shapes (forward, input grad, weight grad).

Each figure is the median over --repeats of the mean host wall time per call of --calls calls
issued back to back after a `torch.cuda.synchronize()` (the GPU runs behind and never fills the
launch queue at these sizes), in microseconds. Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def host_us(fn: Callable[[], object], calls: int, repeats: int,
            sync: Callable[[], object] = torch.cuda.synchronize) -> float:
    """Median over `repeats` of the mean host wall time of `calls` back-to-back calls (us),
    each batch started after `sync()` (the device's work done)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    sync()
    return statistics.median(samples)


def pieces(rows: int, hidden: int) -> dict[str, Callable[[], object]]:
    """name -> a call to time, smallest piece first."""
    from epoverlap.kernels import rmsnorm_triton as rms
    from epoverlap.kernels.triton_utils import cdiv

    device = torch.device("cuda")
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    w = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    x_grad = x.clone().requires_grad_(True)
    a = torch.randn(rows, 64, device=device, dtype=torch.bfloat16)
    b = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rstd = torch.empty(rows, device=device, dtype=torch.float32)
    tile = rms.rms_norm_tile(hidden)
    grid = (cdiv(rows, tile.block_t),)
    kernel = rms._rms_norm_fwd_kernel
    args = (x, w, y, rstd, rows, hidden, x.stride(0), 1e-5)
    options = dict(BLOCK_T=tile.block_t, BLOCK_H=tile.block_h, num_warps=tile.num_warps)
    kernel[grid](*args, **options)  # compiles; the launch cache remembers it
    kernel[grid](*args, **options)
    compiled, tail = next(iter(kernel._entries.values()))
    values = list(args) + [options[name] for name, _ in tail]
    c_apply = super(torch.autograd.Function, _Nothing).apply

    def c_launcher():
        compiled.run(grid[0], 1, 1, torch.cuda.current_stream().cuda_stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *values)

    def triton_path():
        kernel.enabled = False
        try:
            kernel[grid](*args, **options)
        finally:
            kernel.enabled = True

    def op_autograd():
        return rms.rms_norm_triton(x_grad, w, 1e-5)

    def op_no_grad():
        with torch.no_grad():
            return rms.rms_norm_triton(x, w, 1e-5)

    return {
        "torch.empty (one output)": lambda: torch.empty((rows, hidden), device=device,
                                                        dtype=torch.bfloat16),
        "torch add_ (an aten launch)": lambda: y.add_(1),
        "torch.mm (small)": lambda: torch.mm(a, b),
        "empty autograd Function, Function.apply": lambda: _Nothing.apply(x_grad, w, 1e-5),
        "empty autograd Function, C apply": lambda: c_apply(x_grad, w, 1e-5),
        "Triton C launcher alone (CompiledKernel.run)": c_launcher,
        "launch through the launch cache": lambda: kernel[grid](*args, **options),
        "launch through Triton's JITFunction.run": triton_path,
        "op launch helper (2 outputs + cached launch)": lambda: rms._launch_fwd(x, w, 1e-5),
        "RMSNorm op, no autograd": op_no_grad,
        "RMSNorm op, autograd (leaf needs grad)": op_autograd,
    }


def attention_variants(batch=2, heads=8, kv_heads=2, seq=512, dim=64) -> dict:
    """name -> (fwd+bwd callable, output) for the two ways to run grouped-query attention."""
    import torch.nn.functional as F

    device, group = torch.device("cuda"), heads // kv_heads
    gen = torch.Generator(device=device).manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16,
                           generator=gen).requires_grad_(True)
    q, k, v = make(batch, heads, seq, dim), make(batch, kv_heads, seq, dim), make(
        batch, kv_heads, seq, dim)
    grad = torch.randn(batch, heads, seq, dim, device=device, dtype=torch.bfloat16,
                       generator=gen)

    def expanded():
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                             v.repeat_interleave(group, dim=1), is_causal=True)
        out.backward(grad)
        return out

    def native():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)
        return out
    return {"repeat_interleave + SDPA": expanded, "SDPA enable_gqa": native}


def gpu_ms(fn: Callable[[], object], calls: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def mm_shapes(tokens=1024, hidden=512, out=768) -> dict:
    """The small model's qkv GEMM: forward, input grad, weight grad."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(out, hidden, device=device, dtype=dtype)
    g = torch.randn(tokens, out, device=device, dtype=dtype)
    return {f"mm forward x[{tokens},{hidden}] @ w[{out},{hidden}].t()": lambda: x @ w.t(),
            "mm input grad g @ w": lambda: g @ w,
            "mm weight grad g.t() @ x": lambda: g.t() @ x,
            "F.linear forward": lambda: torch.nn.functional.linear(x, w)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_launch: needs a CUDA device (it times kernel launches)")
        return 2
    rows = {name: host_us(fn, args.calls, args.repeats)
            for name, fn in pieces(args.rows, args.hidden).items()}
    print(f"\nbench_launch: {torch.cuda.get_device_name()}, RMSNorm forward [{args.rows}, "
          f"{args.hidden}] bf16, host us per call (median of {args.repeats} x {args.calls})")
    print("| piece | host us per call |\n| --- | --- |")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")
    for name, fn in mm_shapes().items():
        print(f"| {name} | {host_us(fn, args.calls, args.repeats):.1f} |")
    variants = attention_variants()
    outputs = {name: fn().detach().float() for name, fn in variants.items()}
    first, second = outputs.values()
    print("\n| attention fwd+bwd, B2 Q8 G2 S512 D64 bf16 causal | host us per call | GPU ms "
          "per call |\n| --- | --- | --- |")
    for name, fn in variants.items():
        print(f"| {name} | {host_us(fn, 20, args.repeats):.1f} | {gpu_ms(fn):.4f} |")
    print(f"max |difference| of the two outputs: {(first - second).abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
