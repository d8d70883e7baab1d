"""Time the GEMMs whose shape or output dtype decides the one-GPU step: the logit GEMM at aligned
and unaligned vocabularies, and the weight-grad GEMM with its fp32 accumulation done three ways.

Run on one GPU:  python -m benchmarks.harness.bench_gemm_shapes [--out PATH]
Without CUDA it prints why and exits 0.

Rows (bf16 inputs, T tokens, H hidden, V vocabulary, times are medians of
triton.testing.do_bench, TFLOP/s = 2 T H V / time):
  logits fwd      x_TH @ head_VH^T -> [T, V] bf16
  logits dgrad    g_TV @ head_VH -> [T, H]
  logits wgrad    g_TV^T @ x_TH -> [V, H]
and for the weight grad accumulated into an fp32 main grad (the Megatron-LM gradient-accumulation
fusion question), at the dense shapes [O, I] with N rows:
  mm + add        main += (g^T @ x) in bf16, then an fp32 add (epoverlap's bf16 path today)
  mm fp32 + add   main += torch.mm(g^T, x, out_dtype=fp32) (no bf16 rounding, still an add)
  addmm fp32      torch.addmm(main, g^T, x, out_dtype=fp32, out=main) where torch takes it
The printed markdown table is also written to --out as JSON rows.

--logit-variants times only the logit GEMM's forward, useful TFLOP/s (2 T H V over the real V)
at the padded vocabularies 152064 and 50304, as it runs today and as it could run instead: cuBLASLt
in place of cuBLAS; the head stored [H, V] (an NN GEMM); the transposed product (head @ x^T);
the vocabulary in 2-4 column blocks (separate outputs: the GEMMs alone); the tokens in 2 blocks;
the vocabulary padded further (to 1024 and 2048 columns); and today's layout again, timed last
(the first row of a shape read 10-20% off in one session). The weight-grad rows likewise end with
`addmm fp32` again, and take cuBLASLt once.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

LOGIT_SHAPES = [(4096, 2048, v) for v in (151937, 151936, 152064, 50257, 50304, 32000)]
WGRAD_SHAPES = [(4096, 2048, 4096), (4096, 2048, 2048), (4096, 2048, 512), (4096, 152064, 2048),
                (4096, 14336, 4096), (4096, 4096, 14336)]  # (N rows, O, I)


def _bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def logit_rows(dev) -> list[dict]:
    rows = []
    for t, h, v in LOGIT_SHAPES:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02
        g = torch.randn(t, v, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * t * h * v
        for name, fn in (("logits fwd", lambda: x @ w.t()), ("logits dgrad", lambda: g @ w),
                         ("logits wgrad", lambda: g.t() @ x)):
            ms = _bench(fn)
            rows.append({"row": name, "T": t, "H": h, "V": v, "ms": ms,
                         "tflops": flops / ms / 1e9})
        del x, w, g
    return rows


LOGIT_VARIANT_SHAPES = [(4096, 2048, 151937, 152064), (8192, 2048, 151937, 152064),
                        (4096, 2048, 50257, 50304)]  # (T, H, V real, V padded)


def _blocks(size: int, count: int, unit: int = 128) -> list[tuple[int, int]]:
    step = -(-size // count // unit) * unit
    return [(a, min(a + step, size)) for a in range(0, size, step)]


def _with_cublaslt(fn):
    def run():
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            fn()
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
    return run


def logit_variant_rows(dev) -> list[dict]:
    rows = []
    for t, h, real, v in LOGIT_VARIANT_SHAPES:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02
        w_hv = w.t().contiguous()
        ways = {"today: x @ w^T": lambda: x @ w.t(),
                "cublaslt": _with_cublaslt(lambda: x @ w.t()),
                "head stored [H, V]: x @ w_hv": lambda: x @ w_hv,
                "transposed: w @ x^T": lambda: w @ x.t()}
        for count in (2, 3, 4):
            ways[f"V in {count} blocks"] = (
                lambda blocks=_blocks(v, count): [x @ w[a:b].t() for a, b in blocks])
        ways["T in 2 blocks"] = lambda: [x[a:b] @ w.t() for a, b in _blocks(t, 2)]
        for unit in (1024, 2048):
            padded = -(-real // unit) * unit
            wp = torch.randn(padded, h, device=dev, dtype=torch.bfloat16) * 0.02
            ways[f"V padded to {unit} ({padded})"] = lambda wp=wp: x @ wp.t()
        # the first row of a shape read 10-20% off in session 69: today's layout again, last
        ways["today again, timed last"] = lambda: x @ w.t()
        for name, fn in ways.items():
            try:
                fn()
                ms = _bench(fn)
                rows.append({"row": name, "T": t, "H": h, "V": real, "V padded": v, "ms": ms,
                             "useful tflops": 2.0 * t * h * real / ms / 1e9})
            except Exception as exc:  # an API this torch lacks: say so, time the rest
                rows.append({"row": name, "T": t, "V padded": v, "error": repr(exc)[:160]})
        del x, w, w_hv
    return rows


def _addmm_fp32(main, gt, x):
    return torch.addmm(main, gt, x, out_dtype=torch.float32, out=main)


def wgrad_rows(dev) -> list[dict]:
    rows = []
    for n, o, i in WGRAD_SHAPES:
        g = torch.randn(n, o, device=dev, dtype=torch.bfloat16)
        x = torch.randn(n, i, device=dev, dtype=torch.bfloat16)
        main = torch.zeros(o, i, device=dev, dtype=torch.float32)
        flops = 2.0 * n * o * i
        ways = {"mm + add": lambda: main.add_(g.t() @ x),
                "mm fp32 + add": lambda: main.add_(torch.mm(g.t(), x, out_dtype=torch.float32)),
                "addmm fp32": lambda: _addmm_fp32(main, g.t(), x),
                "addmm fp32, cublaslt": _with_cublaslt(lambda: _addmm_fp32(main, g.t(), x)),
                "addmm fp32 again, timed last": lambda: _addmm_fp32(main, g.t(), x)}
        for name, fn in ways.items():
            try:
                fn()
                ms = _bench(fn)
                rows.append({"row": name, "N": n, "O": o, "I": i, "ms": ms,
                             "tflops": flops / ms / 1e9})
            except Exception as exc:  # an API this torch lacks: say so, time the rest
                rows.append({"row": name, "N": n, "O": o, "I": i, "error": repr(exc)[:160]})
        if all("error" not in r for r in rows[-len(ways):]):
            ref = (g.t().float() @ x.float())
            for name, fn in (("mm fp32", lambda: torch.mm(g.t(), x, out_dtype=torch.float32)),
                             ("addmm fp32", lambda: torch.addmm(
                                 torch.zeros_like(main), g.t(), x, out_dtype=torch.float32))):
                err = (fn() - ref).abs().max().item() / ref.abs().max().item()
                rows.append({"row": f"{name} rel err", "N": n, "O": o, "I": i, "value": err})
        del g, x, main
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON rows here")
    parser.add_argument("--logit-variants", action="store_true",
                        help="time only the logit forward's variants (module docstring)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_shapes: no CUDA device; nothing to time")
        return 0
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    rows = (logit_variant_rows(dev) if args.logit_variants
            else logit_rows(dev) + wgrad_rows(dev))
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
