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
                "addmm fp32": lambda: _addmm_fp32(main, g.t(), x)}
        for name, fn in ways.items():
            try:
                fn()
                ms = _bench(fn)
                rows.append({"row": name, "N": n, "O": o, "I": i, "ms": ms,
                             "tflops": flops / ms / 1e9})
            except Exception as exc:  # an API this torch lacks: say so, time the rest
                rows.append({"row": name, "N": n, "O": o, "I": i, "error": repr(exc)[:160]})
        if all("error" not in r for r in rows[-3:]):
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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_shapes: no CUDA device; nothing to time")
        return 0
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    rows = logit_rows(dev) + wgrad_rows(dev)
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
