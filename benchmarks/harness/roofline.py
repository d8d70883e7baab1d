"""Where a one-GPU step's time goes against the GPU's limits: a profiled step's kernels by class,
each class's work by formula, its achieved rate and its time at the limit.

    python -m benchmarks.harness.roofline KTABLE.json --flags "--preset NAME ..." [--step-ms MS]
        [--tflops 989] [--hbm-gbs 4300] [--out FILE.json]

KTABLE.json is `benchmarks.harness.kernel_table --out` over the torch.profiler traces of the
training command's `--profile-steps` (its `--steps` must be the number of profiled steps: the
range is inclusive, 20:22 is three). Kernels are classed by name (`CLASSES`, first match) and
each class's work comes from the model's shapes (the config of `--flags`, the vocabulary
the data sets, padded as the run pads it, T tokens a step = micro-batch size x microbatches x sequence; k top-k, H hidden,
Fe expert FFN, Q query width, S sequence):
  dense GEMMs      6 T (attention projections + dense and shared MLPs + H x padded V)  FLOPs
  expert GEMMs     6 T k 3 H Fe                                                       FLOPs
  attention        6 T Q S (causal: half the scores, forward and backward as Megatron counts)
  optimizer        30 bytes a parameter (fp32 master, grad, two moments; the bf16 copy)
  grad norm        4 bytes a parameter (the fp32 main grads read once: `_square_sums_kernel`)
  grad clip        8 bytes a parameter (read and written once)
  grad zero        4 bytes a parameter
The rest (routing, permutes, norms, rotary, SwiGLU, loss, copies) is listed by time only. The
limits are the H200's dense bf16 peak (989 TFLOP/s) and its measured HBM bandwidth (~4300 GB/s
for a device-to-device copy). "Left" is a class's time over its time at the limit; the step's
kernel sum against `--step-ms` (its wall time, unprofiled) gives the host gaps.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Optional, Sequence

from epoverlap.config.parse import parse_config
from epoverlap.model.flops import megatron_flops_per_token
from epoverlap.training.checkpoints.megatron_mapping import data_vocab_size

# class -> kernel-name pattern (first match wins), in the order printed
CLASSES = (
    ("expert GEMMs", r"grouped_wgrad|GroupProblemShape|grouped"),
    ("attention", r"flash|fmha|sdpa"),
    ("dense GEMMs", r"nvjet|gemm|cutlass|cublas|matmul"),
    ("optimizer", r"adamw|adam|multi_tensor_apply_kernel.*(Adam|adam)"),
    ("grad norm", r"LpNorm|norm_kernel|square_sums"),
    ("grad clip", r"MulFunctor<float>"),
    ("grad zero", r"FillFunctor<float>"),
    ("loss", r"_ce_|cross_entropy|softmax"),
    ("routing and row moves", r"permute|unpermute|router|topk|gather|scatter|where|index|sort"),
    ("norms, rotary, SwiGLU", r"rms|rotary|swiglu"),
)
OTHER = "other kernels"


def class_of(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return OTHER


def work(flags: Sequence[str]) -> dict:
    """Each class's work a step under these training flags: (amount, unit 'TFLOP' | 'GB')."""
    cfg = parse_config(list(flags))
    cfg = cfg.with_vocab_size(data_vocab_size(cfg))
    m, moe, t = cfg.model, cfg.moe, cfg.train
    tokens = t.micro_batch_size * t.num_microbatches * m.seq_length
    query, kv = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim
    fe = moe.moe_ffn_hidden_size or m.ffn_hidden_size
    shared = moe.moe_shared_expert_intermediate_size or 0
    dense = m.hidden_size * m.padded_vocab_size
    expert = 0
    for is_moe in cfg.moe_layer_pattern():
        dense += m.hidden_size * (query + 2 * kv) + query * m.hidden_size
        dense += 3 * m.hidden_size * (shared if is_moe else m.ffn_hidden_size)
        expert += 3 * m.hidden_size * fe * moe.moe_router_topk if is_moe else 0
    params = _parameters(cfg)
    return {"tokens": tokens, "parameters": params,
            "megatron_tflop": megatron_flops_per_token(cfg.model, cfg.moe) * tokens / 1e12,
            "dense GEMMs": (6 * tokens * dense / 1e12, "TFLOP"),
            "expert GEMMs": (6 * tokens * expert / 1e12, "TFLOP"),
            "attention": (6 * tokens * query * m.seq_length * m.num_layers / 1e12, "TFLOP"),
            "optimizer": (30 * params / 1e9, "GB"), "grad norm": (4 * params / 1e9, "GB"),
            "grad clip": (8 * params / 1e9, "GB"), "grad zero": (4 * params / 1e9, "GB")}


def _parameters(cfg) -> int:
    """The model's parameters at EP 1 (every expert on the one GPU)."""
    m, moe = cfg.model, cfg.moe
    query, kv = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim
    fe = moe.moe_ffn_hidden_size or m.ffn_hidden_size
    total = 2 * m.padded_vocab_size * m.hidden_size + m.hidden_size
    for is_moe in cfg.moe_layer_pattern():
        total += m.hidden_size * (query + 2 * kv) + query * m.hidden_size + 2 * m.hidden_size
        if is_moe:
            total += moe.num_experts * (3 * m.hidden_size * fe + m.hidden_size)
            total += 3 * m.hidden_size * (moe.moe_shared_expert_intermediate_size or 0)
        else:
            total += 3 * m.hidden_size * m.ffn_hidden_size
    return total


def rows(table: dict, flags: Sequence[str], tflops: float, hbm_gbs: float) -> list[dict]:
    """One row per class: ms a step, work, achieved rate, time at the limit."""
    rank = table["ranks"][0]
    by_class: dict = {}
    for kernel in rank["top"]:
        label = class_of(kernel["name"])
        by_class[label] = by_class.get(label, 0.0) + kernel["ms"]
    listed = sum(by_class.values())
    by_class[OTHER] = by_class.get(OTHER, 0.0) + rank["kernel_ms"] - listed
    shapes = work(flags)
    out = []
    for label, ms in sorted(by_class.items(), key=lambda item: -item[1]):
        row = {"class": label, "ms": ms}
        if label in shapes:
            amount, unit = shapes[label]
            limit = tflops if unit == "TFLOP" else hbm_gbs  # TFLOP/s or GB/s
            row.update(work=amount, unit=unit, rate=amount / ms * 1e3,
                       at_limit_ms=amount / limit * 1e3)
            row["left"] = ms / row["at_limit_ms"]
        out.append(row)
    return out


def markdown(found: list[dict], kernel_ms: float, step_ms: Optional[float]) -> list[str]:
    lines = ["| class | ms a step | work | achieved | at the limit, ms | x the limit's time |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in found:
        if "work" in r:
            rate = f"{r['rate']:.0f} {r['unit']}/s"
            lines.append(f"| {r['class']} | {r['ms']:.1f} | {r['work']:.2f} {r['unit']} | "
                         f"{rate} | {r['at_limit_ms']:.1f} | {r['left']:.2f} |")
        else:
            lines.append(f"| {r['class']} | {r['ms']:.1f} | | | | |")
    lines.append(f"| kernel sum | {kernel_ms:.1f} | | | | |")
    if step_ms:
        lines.append(f"| step (wall, unprofiled) | {step_ms:.1f} | host gaps and overlap: "
                     f"{step_ms - kernel_ms:+.1f} ms | | | |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ktable", help="kernel_table --out JSON")
    parser.add_argument("--flags", required=True,
                        help="the training command's model and batch flags, one string")
    parser.add_argument("--step-ms", type=float, help="the step's unprofiled wall time")
    parser.add_argument("--tflops", type=float, default=989.0)
    parser.add_argument("--hbm-gbs", type=float, default=4300.0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    with open(args.ktable) as f:
        table = json.load(f)
    flags = args.flags.split()
    found = rows(table, flags, args.tflops, args.hbm_gbs)
    shapes = work(flags)
    print(f"{args.flags}: {shapes['tokens']} tokens a step, {shapes['parameters'] / 1e9:.2f}B "
          f"parameters, {shapes['megatron_tflop']:.2f} TFLOP a step by Megatron-LM's formula")
    print("\n".join(markdown(found, table["ranks"][0]["kernel_ms"], args.step_ms)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"flags": args.flags, "work": shapes, "rows": found}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
