"""Weight grads accumulated inside the GEMM against the GEMM and then the fp32 add.

    python -m benchmarks.harness.bench_wgrad [--rounds 5] [--iters 10]
        [--sweep | --candidates | --configs IxOxK/wW/sS[/gG],...]
        [--device cuda|cpu] [--shapes qwen3,qwen3-step,mixtral,mixtral-step,qwen3-experts]

At the Qwen3 proxy's shapes (`--preset qwen3-30b-a3b-proxy`: hidden 2048, 16/4 heads of dim
128, 128 experts top-8 of FFN 768, 4096 tokens a microbatch, vocabulary 151936), one
microbatch's weight grad of each weight kind, into an fp32 main grad (`--shapes`: `qwen3-step`
is the experts' with both microbatches' rows in one call, `mixtral` the experts' of `--preset
mixtral-1gpu-proxy`, 1024 rows an expert; `mixtral-step` every one-GPU proxy's experts as its
step runs them, `qwen3-experts` the Qwen3 proxy's experts alone):
  - experts (grouped, weights [E, I, O], rows spread evenly, 256 per expert):
      `old`    torch._grouped_mm(x^T, grad) in bf16, then main_grad.add_ (what ran before);
      `fused`  the Triton grouped kernel (`grouped_weight_grad_triton`, its default tiles);
  - dense (weights [O, I], 4096 rows):
      `old`      grad^T @ x in bf16, then main_grad.add_;
      `cublas`   torch.addmm(main_grad, grad^T, x, out_dtype=fp32, out=main_grad) (the fused
                 path: cuBLAS, bf16 inputs, fp32 C, beta 1), torch's default BLAS library;
      `cublaslt` the same call with torch.backends.cuda.preferred_blas_library("cublaslt");
      `triton`   the grouped kernel with one group (main_grad [1, O, I] += grad^T @ x).
`--candidates` adds the grouped kernel at the short list `CANDIDATES` only; `--configs
128x256x128/w8/s2/g8,...` at the tiles given (IxOxK, warps, stages, input blocks a group).
`--sweep` adds the grouped kernel at other tiles (`SWEEP`, labelled by their WgradConfig), for
the dense weights too, and for the experts one program per SM walking the tiles (the SM
carveout's form, with a carveout of 0).

Sides alternate round by round (each round: every side `iters` calls between two CUDA events);
ms is the median over rounds of the time per call. TFLOP/s = 2 N I O / time (N rows, E x I x O
the grad); GB/s counts the compulsory HBM bytes: inputs once (2 N (I + O) in bf16) and the main
grad read and written (8 E I O), plus for the `old` sides the bf16 product written and read
(4 E I O). Before timing each side's result is compared with the fp32 product of the torch
reference (`grouped_weight_grad_torch`; largest difference relative to the largest magnitude:
`old` shows its bf16 rounding, about 4e-3). `--device cpu` (the tool's test) runs tiny shapes once,
the Triton side under TRITON_INTERPRET. Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from epoverlap.kernels.grouped_wgrad import grouped_weight_grad_torch
from epoverlap.kernels.grouped_wgrad_triton import (WgradConfig, grouped_weight_grad_triton,
                                                    wgrad_config)

SWEEP = (WgradConfig(128, 128, 64, 8, 3), WgradConfig(128, 64, 64, 4, 3),
         WgradConfig(64, 128, 64, 4, 3), WgradConfig(64, 64, 64, 4, 4),
         WgradConfig(128, 256, 64, 8, 3), WgradConfig(128, 256, 64, 8, 4),
         WgradConfig(256, 128, 64, 8, 3))
# the short list: the defaults before and after session 71 and the best of its sweeps (the
# rows through TMA and a flattened one-program-an-SM loop were measured and dropped: roofline.md)
CANDIDATES = (WgradConfig(64, 128, 64, 4, 4), WgradConfig(128, 128, 64, 4, 3),
              WgradConfig(128, 256, 64, 8, 4), WgradConfig(128, 256, 64, 8, 4, group_i=4),
              WgradConfig(128, 256, 64, 8, 4, group_i=8),
              WgradConfig(128, 256, 64, 8, 3, group_i=8),
              WgradConfig(128, 128, 64, 4, 3, group_i=8))


@dataclass(frozen=True)
class Case:
    name: str
    experts: int  # 0: a dense weight
    rows: int
    width_in: int
    width_out: int
    step: bool = False  # timed as the step runs it: two microbatches' sources, overwriting


PROXY = (Case("experts fc1 [128, 2048, 1536]", 128, 4096 * 8, 2048, 1536),
         Case("experts fc2 [128, 768, 2048]", 128, 4096 * 8, 768, 2048),
         Case("qkv [3072, 2048]", 0, 4096, 2048, 3072),
         Case("proj [2048, 2048]", 0, 4096, 2048, 2048),
         Case("head [151936, 2048]", 0, 4096, 2048, 151936))
# both microbatches' rows in one call (512 an expert): the main grad read and written once a step
QWEN3_STEP = (Case("experts fc1 [128, 2048, 1536] x 2 microbatches", 128, 8192 * 8, 2048, 1536),
              Case("experts fc2 [128, 768, 2048] x 2 microbatches", 128, 8192 * 8, 768, 2048))
# `--preset mixtral-1gpu-proxy`: 8 experts top-2 of FFN 14336, hidden 4096, 1024 rows an expert
MIXTRAL = (Case("experts fc1 [8, 4096, 28672]", 8, 4096 * 2, 4096, 28672),
           Case("experts fc2 [8, 14336, 4096]", 8, 4096 * 2, 14336, 4096))
# each one-GPU proxy's experts as its step runs them (8192 tokens: both microbatches' rows as two
# sources in one launch, the main grad overwritten); `--shapes mixtral-step`, named when it held
# the Mixtral proxy's alone
STEPS = (Case("experts fc1 [8, 4096, 28672], step", 8, 8192 * 2, 4096, 28672, True),
         Case("experts fc2 [8, 14336, 4096], step", 8, 8192 * 2, 14336, 4096, True),
         Case("Qwen3 experts fc1 [128, 2048, 1536], step", 128, 8192 * 8, 2048, 1536, True),
         Case("Qwen3 experts fc2 [128, 768, 2048], step", 128, 8192 * 8, 768, 2048, True),
         Case("DeepSeek experts fc1 [64, 2048, 2816], step", 64, 8192 * 6, 2048, 2816, True),
         Case("DeepSeek experts fc2 [64, 1408, 2048], step", 64, 8192 * 6, 1408, 2048, True))
# one microbatch's rows added into the main grad (the Qwen3 preset's microbatches 2 and 3 of 4)
QWEN3_EXPERTS = PROXY[:2]
SHAPES = {"qwen3": PROXY, "qwen3-step": QWEN3_STEP, "mixtral": MIXTRAL,
          "mixtral-step": STEPS, "qwen3-experts": QWEN3_EXPERTS}
TINY = (Case("experts [4, 40, 72]", 4, 64, 40, 72), Case("dense [48, 40]", 0, 33, 40, 48))


def _grouped_sides(case: Case, device, sweep: bool,
                   configs: tuple = ()) -> tuple[dict, Callable, Callable]:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(case.rows, case.width_in, generator=gen, device=device).bfloat16()
    grad = torch.randn(case.rows, case.width_out, generator=gen, device=device).bfloat16()
    per = case.rows // case.experts
    counts = [per] * (case.experts - 1) + [case.rows - per * (case.experts - 1)]
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    main_grad = torch.zeros(case.experts, case.width_in, case.width_out, device=device)

    def old():
        if hasattr(torch, "_grouped_mm") and device.type == "cuda":
            product = torch._grouped_mm(x.t(), grad, offs=offsets)
        else:  # the CPU stand-in: a loop
            product = torch.stack([a.t() @ b for a, b in zip(x.split(counts), grad.split(counts))])
        main_grad.add_(product)

    half = case.rows // 2
    first, second = (t.to(device) for t in counts_halves(counts, half))

    def fused(config=None, sm_carveout=None):
        if case.step:
            return lambda: grouped_weight_grad_triton(
                main_grad, x[:half], grad[:half], first, sm_carveout=sm_carveout, config=config,
                more=(x[half:], grad[half:], second), accumulate=False)
        return lambda: grouped_weight_grad_triton(main_grad, x, grad, offsets,
                                                  sm_carveout=sm_carveout, config=config)

    def two_sources():  # the rows as two microbatches' sources in one launch
        grouped_weight_grad_triton(main_grad, x[:half], grad[:half], first,
                                   more=(x[half:], grad[half:], second))

    def overwrite():  # the step's first weight grad: the old main grad never read
        grouped_weight_grad_triton(main_grad, x, grad, offsets, accumulate=False)

    default = wgrad_config(torch.bfloat16, case.rows / case.experts)
    sides = {"old": old, f"fused {_label(default)}": fused()}
    if not case.step:
        sides.update({"fused, two sources": two_sources, "fused, overwrite": overwrite})
    if sweep:
        sides.update({f"fused {_label(c)}": fused(c) for c in SWEEP})
        if device.type == "cuda":  # one program per SM walking the tiles
            sides["fused persistent (carveout 0)"] = fused(sm_carveout=0)
    sides.update({f"fused {_label(c)}": fused(c) for c in configs})
    return sides, lambda: main_grad, lambda: grouped_weight_grad_torch(main_grad, x, grad,
                                                                       offsets, counts)


def counts_halves(counts: list[int], half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets of rows [0, half) and [half, N) of rows sorted by `counts` per expert, each
    as a source of its own (its rows sorted by expert)."""
    ends = torch.tensor(counts).cumsum(0)
    first = ends.clamp(max=half)
    second = (ends - half).clamp(min=0)
    return first.to(torch.int32), second.to(torch.int32)


def _dense_sides(case: Case, device, sweep: bool) -> tuple[dict, Callable, Callable]:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(case.rows, case.width_in, generator=gen, device=device).bfloat16()
    grad = torch.randn(case.rows, case.width_out, generator=gen, device=device).bfloat16()
    main_grad = torch.zeros(case.width_out, case.width_in, device=device)
    one_group = torch.tensor([case.rows], dtype=torch.int32, device=device)

    def old():
        main_grad.add_(grad.t() @ x)

    def cublas():
        torch.addmm(main_grad, grad.t(), x, out_dtype=torch.float32, out=main_grad)

    def cublaslt():
        with _blas("cublaslt"):
            cublas()

    def triton(config=None):
        return lambda: grouped_weight_grad_triton(main_grad.view(1, *main_grad.shape), grad, x,
                                                  one_group, config=config)

    sides = {"old": old, "triton": triton()}
    if sweep:
        sides.update({f"triton {_label(c)}": triton(c) for c in SWEEP})
    if device.type == "cuda":
        sides.update(cublas=cublas, cublaslt=cublaslt)
    return sides, lambda: main_grad, lambda: grouped_weight_grad_torch(
        main_grad.view(1, *main_grad.shape), grad, x, one_group, [case.rows])


@contextlib.contextmanager
def _blas(library: str):
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _label(config: WgradConfig) -> str:
    return (f"{config.block_i}x{config.block_o}x{config.block_k} w{config.num_warps} "
            f"s{config.num_stages}" + (f" g{config.group_i}" if config.group_i > 1 else ""))


def _check(sides: dict, main_grad: Callable, reference: Callable) -> dict:
    """Each side's one call from zero against the fp32 product (the torch reference of the
    grouped kernel): largest difference / largest value (`old` shows its bf16 product)."""
    main_grad().zero_()
    reference()
    expected = main_grad().clone()
    scale = expected.abs().max().item() or 1.0
    errors, results = {}, {}
    for name, side in sides.items():
        main_grad().zero_()
        side()
        errors[name] = (main_grad() - expected).abs().max().item() / scale
        results[name] = main_grad().clone()
    first_fused = next((r for n, r in results.items() if n != "old"), None)
    return {name: (errors[name], torch.equal(results[name], first_fused)) for name in sides}


def _time(sides: dict, rounds: int, iters: int) -> dict:
    times = {name: [] for name in sides}
    for _ in range(rounds):
        for name, side in sides.items():
            side()  # warm: compile, the BLAS library's first call
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                side()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / iters)
    return {name: statistics.median(t) for name, t in times.items()}


def _bytes(case: Case, side: str) -> int:
    groups = max(case.experts, 1)
    grad_elems = groups * case.width_in * case.width_out
    inputs = 2 * case.rows * (case.width_in + case.width_out)
    return inputs + 8 * grad_elems + (4 * grad_elems if side == "old" else 0)


def run_case(case: Case, device, rounds: int, iters: int, sweep: bool,
             configs: tuple = ()) -> list[dict]:
    """`case`'s sides timed; `sweep` adds the SWEEP tiles, `configs` the grouped kernel at
    those tiles (CANDIDATES for --candidates)."""
    if case.experts:
        sides, main_grad, reference = _grouped_sides(case, device, sweep, configs)
    else:
        sides, main_grad, reference = _dense_sides(case, device, sweep)
    errors = _check(sides, main_grad, reference)
    times = _time(sides, rounds, iters) if device.type == "cuda" else {}
    flops = 2 * case.rows * case.width_in * case.width_out
    rows = []
    for name in sides:
        ms = times.get(name)
        rows.append({"case": case.name, "side": name, "ms": ms, "error": errors[name][0],
                     "same_bits": errors[name][1],
                     "tflops": flops / ms / 1e9 if ms else None,
                     "gbs": _bytes(case, name) / ms / 1e6 if ms else None,
                     "vs_old": times["old"] / ms if ms else None})
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    lines = ["| weight | side | ms | TFLOP/s | GB/s | speedup over old | diff to fp32 / max "
             "| bits of the first fused side |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['side']} | {_fmt(r['ms'], '.3f')} | "
                     f"{_fmt(r['tflops'], '.0f')} | {_fmt(r['gbs'], '.0f')} | "
                     f"{_fmt(r['vs_old'], '.2f')} | {r['error']:.1e} | "
                     f"{'same' if r['same_bits'] else 'differ'} |")
    return "\n".join(lines)


def parse_configs(text: str) -> tuple:
    """`IxOxK/wW/sS[/gG],...` (e.g. 128x256x128/w8/s2/g8) -> WgradConfigs; ValueError names the
    bad one."""
    configs = []
    for spec in filter(None, (part.strip() for part in text.split(","))):
        try:
            tiles, *opts = spec.split("/")
            block_i, block_o, block_k = (int(v) for v in tiles.split("x"))
            named = {opt[0]: int(opt[1:]) for opt in opts}
            if set(named) - {"w", "s", "g"} or not {"w", "s"} <= set(named):
                raise ValueError
            configs.append(WgradConfig(block_i, block_o, block_k, named["w"], named["s"],
                                       group_i=named.get("g", 1)))
        except ValueError:
            raise ValueError(f"--configs {spec!r}: expected IxOxK/wW/sS[/gG], e.g. "
                             "128x256x128/w8/s2/g8") from None
    return tuple(configs)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    tiles = parser.add_mutually_exclusive_group()
    tiles.add_argument("--sweep", action="store_true", help="the grouped kernel at more tiles")
    tiles.add_argument("--candidates", action="store_true",
                       help="the grouped kernel at the short list CANDIDATES only")
    tiles.add_argument("--configs", default="",
                       help="the grouped kernel at these tiles only: IxOxK/wW/sS[/gG],...")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shapes", default="qwen3",
                        help=f"comma-separated, of {', '.join(SHAPES)} (cuda only)")
    args = parser.parse_args(argv)
    try:
        configs = CANDIDATES if args.candidates else parse_configs(args.configs)
    except ValueError as error:
        parser.error(str(error))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_wgrad: no CUDA device (use --device cpu for the tool's own check)")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
              f"BLAS default {torch.backends.cuda.preferred_blas_library()}")
    rows = []
    cases = [c for name in args.shapes.split(",") for c in SHAPES[name]]
    for case in cases if device.type == "cuda" else TINY:
        rows += run_case(case, device, args.rounds, args.iters, args.sweep, configs)
        print(f"done: {case.name}", flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
