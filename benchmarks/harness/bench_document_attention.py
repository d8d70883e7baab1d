"""Per-document attention (--reset-attention-mask) on a GPU: the variable-length kernel
(`epoverlap.model.varlen`, what runs now) against SDPA with the explicit mask (what ran before),
forward + backward of one microbatch's attention, and plain causal SDPA (one document) as the
floor. Then context parallelism's gathered attention at CP 2 (rank 0's chunks 0 and 3 of 4 over
the keys up to each chunk's end, one document): the kernel with a one-document table against
SDPA with the lower-right causal bias (what runs there: the faster, on an H200 with torch 2.11).

    python -m benchmarks.harness.bench_document_attention [--rounds 7] [--iters 10] [--out F]

At the Qwen3 proxy's attention (1 x 4096 tokens, 32 query heads over 4 K/V heads of dim 128,
bf16), documents of mean length 256, 1024 and 4096 tokens (end-of-document tokens drawn at
random, capacity 64). Sides alternate round by round (each: `iters` calls between two CUDA
events); ms is the median over rounds, every round's figure kept in the JSON. Prints a markdown
table last.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from epoverlap.model.context import _sdpa
from epoverlap.model.documents import Documents
from epoverlap.model.varlen import varlen_document_attention

EOD, SEQ, HEADS, KV_HEADS, DIM, CAPACITY = 7, 4096, 32, 4, 128, 64


def _inputs(mean_doc: int):
    gen = torch.Generator(device="cuda").manual_seed(mean_doc)
    tokens = torch.randint(0, EOD, (1, SEQ), generator=gen, device="cuda")
    ends = torch.rand(1, SEQ, generator=gen, device="cuda") < 1.0 / mean_doc
    tokens = tokens.masked_fill(ends, EOD)
    q = torch.randn(1, HEADS, SEQ, DIM, generator=gen, device="cuda").bfloat16()
    k = torch.randn(1, KV_HEADS, SEQ, DIM, generator=gen, device="cuda").bfloat16()
    v = torch.randn(1, KV_HEADS, SEQ, DIM, generator=gen, device="cuda").bfloat16()
    return tokens, [t.requires_grad_() for t in (q, k, v)]


def _sides(mean_doc: int) -> dict:
    docs = Documents(EOD, reset_positions=False, reset_mask=True, capacity=CAPACITY)
    tokens, (q, k, v) = _inputs(mean_doc)
    docs.check_capacity(tokens.cpu())
    doc_BS = docs.ids(tokens)
    pos = torch.arange(SEQ, device="cuda")

    def varlen():
        return varlen_document_attention(q, k, v, doc_BS, CAPACITY)

    def masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.visible(doc_BS, pos, pos),
                                              enable_gqa=True)

    def causal():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwd_bwd(fn):
        def run():
            out = fn()
            out.backward(torch.ones_like(out))
        return run
    return {"varlen": fwd_bwd(varlen), "masked": fwd_bwd(masked), "causal": fwd_bwd(causal)}


def _cp_sides() -> dict:
    """CP 2, rank 0: queries of chunks 0 and 3 (of 4 of 1024) over keys [0, end)."""
    tokens, (q, k, v) = _inputs(SEQ)
    doc_BS = torch.zeros_like(tokens)
    c = SEQ // 4
    local = [q[:, :, :c].detach().requires_grad_(), q[:, :, 3 * c:].detach().requires_grad_()]

    def run(attend):
        def step():
            outs = [attend(local[0], c, 0), attend(local[1], SEQ, 3 * c)]
            torch.cat(outs, dim=2).backward(torch.ones(1, HEADS, 2 * c, DIM, device="cuda",
                                                       dtype=torch.bfloat16))
        return step
    return {"varlen": run(lambda qc, end, lo: varlen_document_attention(
                qc, k[:, :, :end], v[:, :, :end], doc_BS, 1, q_lo=lo)),
            "masked": run(lambda qc, end, lo: _sdpa(qc, k[:, :, :end], v[:, :, :end]))}


def _time(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record, rows = {}, []
    for mean_doc in (256, 1024, 4096, "cp2"):
        sides = _cp_sides() if mean_doc == "cp2" else _sides(mean_doc)
        for fn in sides.values():
            fn()
        samples = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, fn in sides.items():
                samples[name].append(_time(fn, args.iters))
        ms = {name: statistics.median(s) for name, s in samples.items()}
        record[str(mean_doc)] = {"samples_ms": samples, "median_ms": ms}
        causal = f"{ms['causal']:.3f}" if "causal" in ms else "-"
        rows.append(f"| {mean_doc} | {ms['varlen']:.3f} | {ms['masked']:.3f} | {causal} | "
                    f"{ms['masked'] / ms['varlen']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "shape": [1, HEADS, KV_HEADS, SEQ, DIM], "runs": record}, f)
    print("| mean document (cp2: CP 2's gathered attention) | varlen ms | masked SDPA ms | causal SDPA (one document) ms | "
          "masked / varlen |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
