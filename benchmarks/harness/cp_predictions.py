"""The simulator's predictions for context parallelism's K/V exchange (benchmarks/
context_parallel.md): `python -m benchmarks.harness.cp_predictions [--cp 2,4,8]
[--links nvlink,shm,ib] [--out FILE.json] [-- TRAINING FLAGS]`.

Predictions, not measurements: per CP size and link, the exchange's bytes and time per layer
and phase (epoverlap/simulator/context_costs.py: the all-gather as the `kv_gather` node on the
comm lane, the p2p ring inside `attn`), beside a layer's attention forward on FLOP counts at
the simulator's default rates; then each exchange's simulated step (EP = CP, the combined 1F1B
with delayed weight grads) through the same functions `epoverlap-simulate --flops` runs.
The default model is the GPU recipes' (benchmarks/gpu/recipes_context.py). Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from epoverlap.cli import simulate as sim
from epoverlap.schedule.plan import Action
from epoverlap.simulator import context_costs as cc

MODEL = ["--preset", "megatron-cmp", "--seq-length", "4096", "--micro-batch-size", "1",
         "--num-microbatches", "8", "--bf16", "--delay-wgrad-compute",
         "--kernel-backend", "torch"]  # the simulated model only: no kernels run here


def scenario(flags: list, cp: int, comm_type: str, link: str):
    args = sim.parse_args(["--flops", "--link", link, "--", *flags, "--expert-model-parallel-"
                           "size", str(cp), "--context-parallel-size", str(cp),
                           "--cp-comm-type", comm_type])
    return sim.build_scenario(args)


def row(flags: list, cp: int, link: str) -> dict:
    gather, ring = (scenario(flags, cp, kind, link) for kind in ("allgather", "p2p"))
    kv = cc.KvShape.from_config(gather.cfg)
    model = sim.sc.LINKS[link]
    attn = gather.compute.for_plan(True)(0, Action("F", 0, "attn", 0))
    return {"cp": cp, "link": link, "kv_mib": kv.kv_bytes / 2**20,
            "sent_mib": cc.exchange_volume(kv, "allgather")[0] / 2**20,
            "allgather_us": cc.kv_exchange_us(model, kv, "allgather"),
            "ring_us": cc.kv_exchange_us(model, kv, "p2p"), "attn_forward_us": attn,
            "wgrad_allgather_ms": sim.run_mode(gather, "wgrad").step_us / 1e3,
            "wgrad_p2p_ms": sim.run_mode(ring, "wgrad").step_us / 1e3}


def table(rows: list) -> str:
    lines = ["| CP | link | K/V per rank (MiB) | sent per layer and phase (MiB) | all-gather "
             "(us) | ring (us) | attn forward, FLOPs (us) | step, all-gather (ms) | step, "
             "ring (ms) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['cp']} | {r['link']} | {r['kv_mib']:.1f} | {r['sent_mib']:.1f} | "
              f"{r['allgather_us']:.0f} | {r['ring_us']:.0f} | {r['attn_forward_us']:.0f} | "
              f"{r['wgrad_allgather_ms']:.1f} | {r['wgrad_p2p_ms']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="cp_predictions", description=__doc__.split("\n")[0])
    parser.add_argument("--cp", default="2,4,8")
    parser.add_argument("--links", default="nvlink,shm,ib")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv[:split])
    flags = argv[split + 1:] or MODEL
    rows = [row(flags, int(cp), link) for cp in args.cp.split(",")
            for link in args.links.split(",")]
    print(f"predictions (epoverlap-simulate's models, not measured): {' '.join(flags)}\n")
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"flags": flags, "rows": rows}, indent=1) + "\n",
                            encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
