"""The norms' and the embedding's weight grads added into the fp32 main grad by their backward,
against the backward then the grad buffers' hook add (what ran before).

    python -m benchmarks.harness.bench_main_grad_ops [--rounds 10] [--iters 20] [--device cuda|cpu]

At the Qwen3 proxy's shapes (4096 tokens a microbatch, hidden 2048, vocabulary 151936 in bf16;
the query/key norms over 16 + 4 heads of dim 128), the weight-grad part of one microbatch's
backward of each op:
  - embedding: `old`   torch's embedding backward (the dense [V, H] grad), then main_grad.add_;
               `fused` `add_embedding_grad` (sort, segment ends, the Triton kernel);
  - norm, qk norm: `old`   the Triton backward returning dw, then main_grad.add_;
                   `fused` the same backward adding dw into the main grad.
Sides alternate round by round (each round: `iters` calls between two CUDA events); ms is the
median over rounds of the time per call. `bits` says whether the side's main grad equals the
`old` one bit for bit (the embedding's above 3072 tokens, where torch sorts: the same order).
`--device cpu` (the tool's test) runs tiny shapes once, the Triton sides interpreted. Prints a
markdown table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from epoverlap.kernels.embedding_triton import add_embedding_grad
from epoverlap.kernels.rmsnorm_triton import _launch_bwd, _launch_fwd

GPU_SHAPES = {"embedding": (4096, 151936, 2048), "norm": (4096, 2048), "qk norm": (81920, 128)}
CPU_SHAPES = {"embedding": (64, 50, 16), "norm": (32, 24), "qk norm": (40, 8)}


def _embedding_sides(tokens, vocab, hidden, device):
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    grad = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    start = torch.randn(vocab, hidden, generator=gen, device=device)

    def old(main_grad):
        main_grad.add_(torch.ops.aten.embedding_dense_backward(grad, ids, vocab, -1, False))

    def fused(main_grad):
        add_embedding_grad(main_grad, ids, grad)
    return start, {"old": old, "fused": fused}


def _norm_sides(rows, hidden, device):
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, hidden, generator=gen, device=device).bfloat16()
    weight = (torch.rand(hidden, generator=gen, device=device) + 0.5).bfloat16()
    dy = torch.randn(rows, hidden, generator=gen, device=device).bfloat16()
    _, rstd = _launch_fwd(x, weight, 1e-6)
    start = torch.randn(hidden, generator=gen, device=device)

    def old(main_grad):
        main_grad.add_(_launch_bwd(dy, x, weight, rstd, True)[1])

    def fused(main_grad):
        _launch_bwd(dy, x, weight, rstd, True, main_grad)
    return start, {"old": old, "fused": fused}


def _time(call, main_grad, iters: int, device) -> float:
    if device == "cpu":
        call(main_grad)
        return float("nan")
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        call(main_grad)
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def run(device: str, rounds: int, iters: int) -> list[dict]:
    shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    cases = {"embedding": _embedding_sides(*shapes["embedding"], device),
             "norm": _norm_sides(*shapes["norm"], device),
             "qk norm": _norm_sides(*shapes["qk norm"], device)}
    rows = []
    for name, (start, sides) in cases.items():
        results = {side: start.clone() for side in sides}
        for side, call in sides.items():
            call(results[side])  # warm-up, and the bits compared
        times: dict = {side: [] for side in sides}
        for _ in range(rounds if device == "cuda" else 1):
            for side, call in sides.items():
                times[side].append(_time(call, start.clone(), iters, device))
        for side in sides:
            rows.append({"op": name, "shape": "x".join(map(str, shapes[name])), "side": side,
                         "ms": statistics.median(times[side]),
                         "bits": torch.equal(results[side], results["old"])})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    rows = run(args.device, args.rounds, args.iters)
    print("| op | shape | side | ms | same bits as old |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['op']} | {r['shape']} | {r['side']} | {r['ms']:.4f} | {r['bits']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
