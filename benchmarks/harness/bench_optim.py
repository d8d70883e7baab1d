"""The optimizer step's cost in each AdamW form (`epoverlap.training.optim.ADAM_IMPLS`).

    python -m benchmarks.harness.bench_optim [--preset megatron-cmp] [--rounds 10] [--iters 5] [FLAGS...]

Builds the training command's model and grad buffers on one GPU (EP 1, bf16: every expert on
this GPU, so more parameters than one rank of an EP run holds), fills `main_grad` with fixed
random values, and runs the mixed-precision AdamW step (fp32 masters, Adam's update, the bf16
parameters written from the masters) in each form, the forms' timed steps alternated round by
round, each form first in turn: host CPU time (the process, before the closing sync), GPU time
(CUDA events around the steps) and wall time per step, medians over the rounds; kernel launches
per step (torch.profiler); and how far each form's masters are from the `single` form's after 3
steps from the same start (they may differ in the last bits; each is reproducible). Then the
step before it, the global grad norm's per-parameter squares (`GradBuffers.global_norm`: one
`_foreach_norm`) against the per-parameter `pow(2).sum()` they replaced, timed the same way. Extra FLAGS go to the model
(e.g. --num-layers 8). Prints markdown tables last. `--device cpu` times the CPU forms (the
tool's test).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from epoverlap.config import parse_config
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.optim import ADAM_IMPLS, MixedPrecisionAdamW
from epoverlap.training.trainer import Trainer
from benchmarks.harness.bench_host import launch_count


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run, iters: int, device: torch.device) -> dict:
    """Per call of `run`: host CPU ms, GPU ms (CUDA events; None on CPU), wall ms."""
    _sync(device)
    events = ([torch.cuda.Event(enable_timing=True) for _ in range(2)]
              if device.type == "cuda" else None)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if events:
        events[0].record()
    for _ in range(iters):
        run()
    if events:
        events[1].record()
    cpu1 = time.process_time()
    _sync(device)
    wall1 = time.perf_counter()
    return {"cpu_ms": (cpu1 - cpu0) * 1e3 / iters, "wall_ms": (wall1 - wall0) * 1e3 / iters,
            "gpu_ms": events[0].elapsed_time(events[1]) / iters if events else None}


def launches(run, device: torch.device) -> int:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        _sync(device)
    return launch_count(prof)


def alternated(runs: dict, rounds: int, iters: int, device: torch.device):
    """({name: [timed, ...]}, {name: launches}): the runs alternated, each first in turn."""
    rows = {name: [] for name in runs}
    for round_index in range(rounds):
        shift = round_index % len(runs)
        for name in list(runs)[shift:] + list(runs)[:shift]:
            rows[name].append(timed(runs[name], iters, device))
    return rows, {name: launches(run, device) for name, run in runs.items()}


def medians(runs: list[dict]) -> dict:
    """Per key of `timed`'s samples, the median over them (None where the key was None)."""
    return {k: statistics.median(r[k] for r in runs) if runs[0][k] is not None else None
            for k in runs[0]}


def _median_cells(runs: list[dict]) -> str:
    med = medians(runs)
    gpu = "-" if med["gpu_ms"] is None else f"{med['gpu_ms']:.2f}"
    return f"{med['cpu_ms']:.2f} | {gpu} | {med['wall_ms']:.2f}"


def print_norms(params: list, rounds: int, iters: int, device: torch.device) -> None:
    """The grad norm's per-parameter squares, as `GradBuffers.global_norm` takes them and as
    it took them before (the same grads; the slots and the host read left out of both)."""
    grads = [p.main_grad for p in params]

    def foreach_norm():
        return float(torch.stack(torch._foreach_norm(grads, 2)).square().sum().sqrt())

    def per_param():  # the form before: a temporary as large as each grad, written and read
        return float(torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt())
    runs = {"_foreach_norm (now)": foreach_norm, "pow(2).sum() per parameter": per_param}
    rows, count = alternated(runs, rounds, iters, device)
    values = {name: run() for name, run in runs.items()}
    print("\n| grad norm squares | host CPU ms | GPU ms | wall ms | launches | norm |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for name, runs_of in rows.items():
        print(f"| {name} | {_median_cells(runs_of)} | {count[name]} | {values[name]:.9g} |")


def build(argv: list[str], on_cpu: bool):
    groups = init_distributed(1, "cpu" if on_cpu else "cuda")
    trainer = Trainer(parse_config(argv), groups, log=lambda msg: None)
    trainer.optimizer = None  # its masters and moments: this tool makes its own per form
    return groups, trainer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="megatron-cmp")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=5)
    args, model_flags = parser.parse_known_args(argv)
    on_cpu = parse_config(model_flags).train.device == "cpu"
    if not on_cpu and not torch.cuda.is_available():
        print("bench_optim: needs a CUDA device (or --device cpu)")
        return 2
    flags = ["--preset", args.preset, "--mock-data", *([] if on_cpu else ["--bf16"]),
             "--cuda-graph-impl", "none", *model_flags]  # eager: no graph bank is built
    groups, trainer = build(flags, on_cpu)
    try:
        model, cfg, device = trainer.model, trainer.cfg.train, trainer.device
        params = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator().manual_seed(0)
        for param in params:
            param.main_grad.copy_(torch.randn(param.shape, generator=gen) * 1e-3)
        start = [p.detach().clone() for p in params]
        forms = {impl: MixedPrecisionAdamW(model, cfg, impl) for impl in ADAM_IMPLS}
        masters = {}
        for impl, optimizer in forms.items():  # 3 steps from the same start, then compare
            with torch.no_grad():
                for param, first, master in zip(params, start, optimizer.masters):
                    param.copy_(first)
                    master.copy_(first)
            for _ in range(3):
                optimizer.step(1e-4)
            masters[impl] = [m.detach().clone() for m in optimizer.masters]
        steps = {impl: (lambda o=optimizer: o.step(1e-4)) for impl, optimizer in forms.items()}
        rows, count = alternated(steps, args.rounds, args.iters, device)
        numel = sum(p.numel() for p in params)
        where = torch.cuda.get_device_name() if not on_cpu else "CPU"
        print(f"\nbench_optim: {where}, preset "
              f"{args.preset} {' '.join(model_flags)}, {len(params)} parameters, "
              f"{numel / 1e6:.1f}M values, medians of {args.rounds} alternated rounds of "
              f"{args.iters} steps")
        print("| form | host CPU ms/step | GPU ms/step | wall ms/step | launches/step | "
              "max abs diff from single after 3 steps |\n| --- | --- | --- | --- | --- | --- |")
        for impl, runs in rows.items():
            diff = max(float((a - b).abs().max()) for a, b in zip(masters[impl],
                                                                 masters["single"]))
            print(f"| {impl} | {_median_cells(runs)} | {count[impl]} | {diff:.3g} |")
        print_norms(params, args.rounds, args.iters, device)
        return 0
    finally:
        trainer.close()
        destroy_distributed(groups)


if __name__ == "__main__":
    sys.exit(main())
