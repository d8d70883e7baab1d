"""Where a training run's GPU memory peak goes: the training command run in this process with
the CUDA allocator's history on, then the blocks alive at the run's highest allocated moment,
grouped by the innermost epoverlap source line that allocated them, beside the memory
estimate's parts (`epoverlap.training.setup.memory`).

    torchrun --standalone --nproc-per-node 1 -m benchmarks.harness.memory_peak \
        --out peak.json -- --preset small --seq-length 512 --train-iters 3 --mock-data ...

Writes --out (JSON: the peak, the estimate's parts, every group) and prints the top groups.
The replay counts a block from its `alloc` to its `free_requested`, as `max_memory_allocated`
does; the history keeps the last --max-entries events, so keep the run short.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import torch

GIB = 2**30


def peak_blocks(trace: list) -> tuple[int, dict]:
    """Replay one device's allocator events: (the most bytes allocated at once, the blocks
    alive then, address -> event)."""
    live: dict = {}
    now = peak = 0
    at_peak: dict = {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif action == "free_requested" and event["addr"] in live:
            now -= live.pop(event["addr"])["size"]
    return peak, at_peak


def where(event: dict) -> str:
    """The innermost epoverlap frame of an allocation (else the innermost frame)."""
    frames = event.get("frames") or []
    for frame in frames:
        name = frame.get("filename", "")
        if "/epoverlap/" in name:
            return f"{name.split('/epoverlap/')[-1]}:{frame.get('line')} {frame.get('name')}"
    if frames:
        return f"{frames[0].get('filename')}:{frames[0].get('line')} {frames[0].get('name')}"
    return "(no frame)"


def groups(blocks: dict) -> list[dict]:
    """Blocks grouped by `where`, largest first."""
    sums: dict = collections.defaultdict(lambda: [0, 0])
    for event in blocks.values():
        group = sums[where(event)]
        group[0] += event["size"]
        group[1] += 1
    return [{"where": key, "bytes": size, "blocks": count}
            for key, (size, count) in sorted(sums.items(), key=lambda kv: -kv[1][0])]


def estimate_parts(flags: list) -> dict:
    """The memory estimate's parts (bytes) for the run's flags, on one GPU."""
    from epoverlap.config import parse_config, resolve_config
    from epoverlap.training.setup.memory import estimate_memory
    estimate = estimate_memory(resolve_config(parse_config(flags), 1, True), 1)
    return {"states": estimate.states, "activations": estimate.activations,
            "transient": estimate.transient, "total": estimate.total}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-entries", type=int, default=400_000)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("train_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    flags = [f for f in args.train_flags if f != "--"]
    from epoverlap.cli.train import main as train
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    status = train(flags)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, blocks = peak_blocks(trace)
    rows = groups(blocks)
    record = {"train_status": status, "flags": flags, "events": len(trace),
              "peak_bytes": peak, "max_memory_allocated": torch.cuda.max_memory_allocated(),
              "estimate": estimate_parts(flags), "groups": rows}
    with open(args.out, "w") as out:
        json.dump(record, out, indent=1)
    print(f"peak {peak / GIB:.3f} GiB in the replay of {len(trace)} events "
          f"(max_memory_allocated {record['max_memory_allocated'] / GIB:.3f} GiB); estimate "
          + ", ".join(f"{k} {v / GIB:.3f}" for k, v in record["estimate"].items()) + " GiB")
    for row in rows[:args.top]:
        print(f"{row['bytes'] / 2**20:10.1f} MiB {row['blocks']:6d}  {row['where']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
