"""The loss's cost with the fused Triton cross-entropy against the torch reference it replaced.

    python -m benchmarks.harness.bench_loss [--shapes 4096x257,8192x32000,4096x151936] [--hidden 2048]
                               [--rounds 10] [--iters 5] [--device cuda|cpu]

For each T x V shape (tokens x vocabulary), two levels, each timed with the op table's
`cross_entropy` = the Triton kernels at any V (`fused`: `fused_cross_entropy`) and = the torch
reference (`torch`: the fp32 cast, log-softmax and gather they replace; the Triton table takes it
below FUSED_MIN_VOCAB), the two sides' forward + backward alternated round by round, each first
in turn:
  - `op`: the loss alone, from bf16 logits [T, V] to the loss and back to the logits' grad;
  - `node`: the model's loss node as the executor runs it (`MoEModel.loss_forward`: final
    RMSNorm, the output head's GEMM, the loss; then its backward into the hidden states and the
    head's and norm's weights), every other op the Triton table's.
Per forward + backward: host CPU ms, GPU ms (CUDA events), wall ms (medians over the rounds),
kernel launches (torch.profiler), and the peak memory the pass adds above what was allocated
before it. Also: each side's loss, the largest difference of the two sides' grads, and whether
the fused side gives the same bits when run again. Prints markdown tables last. `--device cpu`
(the tool's test) runs the fused side under TRITON_INTERPRET. `--python-profile N` adds
cProfile's top N functions of each side's op passes at the first shape (where host time goes).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from epoverlap.config import parse_config
from epoverlap.model.transformer import MoEModel
from epoverlap.parallel.comm import ExpertComm
from epoverlap.kernels import make_moe_ops
from epoverlap.kernels.cross_entropy import cross_entropy_torch
from epoverlap.kernels.cross_entropy_triton import FUSED_MIN_VOCAB, fused_cross_entropy
from benchmarks.harness.bench_host import own_time_profile
from benchmarks.harness.bench_optim import alternated, medians


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'4096x257,8192x32000' -> [(4096, 257), (8192, 32000)] (ValueError naming --shapes)."""
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {item!r} is not TOKENSxVOCAB (e.g. 4096x32000)")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


class LossSides:
    """The op and node passes of one shape, with the loss op swappable (`use`)."""

    def __init__(self, tokens: int, vocab: int, hidden: int, device: torch.device):
        gen = torch.Generator().manual_seed(tokens + vocab)
        triton_ops = make_moe_ops("triton")
        self.tables = {side: dataclasses.replace(triton_ops, cross_entropy=op)
                       for side, op in (("fused", fused_cross_entropy),
                                        ("torch", cross_entropy_torch))}
        cfg = parse_config(["--preset", "tiny", "--num-layers", "1", "--hidden-size", str(hidden),
                            "--num-attention-heads", "4"]).with_vocab_size(vocab)
        self.model = MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                              ExpertComm(None, 1), 0, triton_ops, dtype=torch.bfloat16,
                              device=device)
        self.labels_T = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        self.logits_TV = (torch.randn(tokens, vocab, generator=gen) * 2).to(
            device, torch.bfloat16).requires_grad_()
        self.hidden_TH = torch.randn(tokens, hidden, generator=gen).to(
            device, torch.bfloat16).requires_grad_()
        self.device = device

    def use(self, side: str) -> None:
        self.model.ops = self.tables[side]

    def op_pass(self, side: str):
        self.logits_TV.grad = None
        loss = self.tables[side].cross_entropy(self.logits_TV, self.labels_T)
        loss.backward()
        return loss.detach(), self.logits_TV.grad

    def node_pass(self, side: str):
        self.use(side)
        self.hidden_TH.grad = None
        loss = self.model.loss_forward(self.hidden_TH, self.labels_T)["loss"]
        loss.backward()
        return loss.detach(), self.hidden_TH.grad

    def peak_mib(self, run) -> float:
        """MiB the pass allocates above what was allocated before it (CUDA; 0 on CPU)."""
        if self.device.type != "cuda":
            run()
            return 0.0
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - before) / 2**20


def measure_shape(tokens: int, vocab: int, args, device: torch.device) -> list[dict]:
    sides = LossSides(tokens, vocab, args.hidden, device)
    rows = []
    for level, pass_of in (("op", sides.op_pass), ("node", sides.node_pass)):
        runs = {side: (lambda side=side: pass_of(side)) for side in ("fused", "torch")}
        for run in runs.values():  # compile, warm the allocator
            run()
        timed, launch_counts = alternated(runs, args.rounds, args.iters, device)
        results = {side: pass_of(side) for side in runs}
        again = pass_of("fused")
        same_bits = all(torch.equal(a, b) for a, b in zip(results["fused"], again))
        grad_diff = float((results["fused"][1].float() - results["torch"][1].float()).abs().max())
        for side in runs:
            rows.append({"shape": f"{tokens}x{vocab}", "level": level, "side": side,
                         **medians(timed[side]),
                         "launches": launch_counts[side],
                         "peak_mib": sides.peak_mib(runs[side]),
                         "loss": float(results[side][0]),
                         "grad_diff": grad_diff, "rerun_bitwise": same_bits})
    return rows


def python_profile(tokens: int, vocab: int, args, device: torch.device, top: int) -> str:
    """cProfile of 50 op passes of each side (own time, the `top` functions by it)."""
    sides = LossSides(tokens, vocab, args.hidden, device)
    text = []
    for side in ("fused", "torch"):
        sides.op_pass(side)
        table = own_time_profile(lambda: [sides.op_pass(side) for _ in range(50)], top)
        text.append(f"--- {tokens}x{vocab} {side}: 50 op passes\n{table}")
    return "\n".join(text)


def markdown(rows: list[dict]) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)
    lines = ["| shape T x V | level | side | host CPU ms | GPU ms | wall ms | launches | "
             "peak MiB added | loss | max grad diff | fused rerun bitwise |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['level']} | {r['side']} | "
                     f"{cell(r['cpu_ms'], '.3f')} | {cell(r['gpu_ms'], '.3f')} | "
                     f"{cell(r['wall_ms'], '.3f')} | {r['launches']} | "
                     f"{r['peak_mib']:.1f} | {r['loss']:.6f} | {r['grad_diff']:.2e} | "
                     f"{r['rerun_bitwise']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4096x257,8192x32000,4096x151936",
                        help="TOKENSxVOCAB,... (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=2048, help="the node's hidden size")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=5, help="passes per timed sample")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--python-profile", type=int, default=0, metavar="N",
                        help="also print cProfile's top N functions of 50 op passes per side, "
                             "at the first shape")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as err:
        parser.error(str(err))
    device = torch.device(args.device)
    if args.python_profile:
        print(python_profile(*shapes[0], args, device, args.python_profile))
    rows = []
    for tokens, vocab in shapes:
        print(f"bench_loss: {tokens} x {vocab} ...", flush=True)
        rows.extend(measure_shape(tokens, vocab, args, device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nbench_loss: {name}, torch {torch.__version__}, hidden {args.hidden}, medians of "
          f"{args.rounds} rounds x {args.iters} passes (the training path fuses from V = "
          f"{FUSED_MIN_VOCAB})")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
