"""The optimizer step's cost in each AdamW form (`epoverlap.training.optimizer.optim.ADAM_IMPLS`).

    python -m benchmarks.harness.bench_optim [--preset megatron-cmp] [--impls flat,fused,...]
        [--rounds 10] [--iters 5] [--hbm-gbs 4300] [--flat-block 1024] [--flat-configs BxW,...]
        [--one-at-a-time] [FLAGS...]

Builds the training command's model and grad buffers on one GPU (EP 1, bf16: every expert on
this GPU, so more parameters than one rank of an EP run holds), fills `main_grad` with fixed
random values, and runs the mixed-precision AdamW step (fp32 masters, Adam's update, the bf16
parameters written from the masters) in each form of `--impls` (default: all): host CPU time
(the process, before the closing sync), GPU time (CUDA events around the steps) and wall time
per step, medians over the rounds; kernel launches per step (torch.profiler); the bytes the
step must move over the GPU time (GB/s) and that against `--hbm-gbs` (the fraction of the
memory bound reached); and how far each form's masters are from the `single` form's after 3
steps from the same start (they may differ in the last bits; each is reproducible; compared on
the first 65536 values of each master). The bytes are those of the update's memory bound: per
value the fp32 master read and written (8), the fp32 grad read (4), both moments read and
written (16) and, for a bf16 parameter, its write (2): 30 bytes a value in bf16 runs.

The forms' timed steps are alternated round by round, each form first in turn, all forms built
at once (each holds its own masters and moments: 12 bytes a value). Where they do not fit beside
one another (`--one-at-a-time`, or chosen when the GPU's free memory is short; e.g. --preset
qwen3-30b-a3b-proxy, 4.2B values, 50 GB a form beside the model's 25 GB), each form is built,
timed over all its rounds and freed before the next; `--flat-configs BxW,...` times the flat
form at each window x warps instead, one at a time. Then the step before it, the global grad
norm's per-parameter squares (`GradBuffers.norm_squared`: on a GPU one Triton launch per grad
buffer) against `_foreach_norm` and the per-parameter `pow(2).sum()` they replaced, timed the
same way. Extra FLAGS go to the model
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
from epoverlap.training.optimizer import flat_adam
from epoverlap.training.optimizer.grads import GradBuffers
from epoverlap.training.optimizer.optim import ADAM_IMPLS, MixedPrecisionAdamW
from epoverlap.training.loop.trainer import Trainer
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


def print_norms(buffers: GradBuffers, rounds: int, iters: int, device: torch.device) -> None:
    """The grad norm's per-parameter squares, as `GradBuffers.norm_squared` takes them and as
    it took them before (the same grads; the slots and the host read left out of both)."""
    grads = [p.main_grad for p in buffers.params]

    def foreach_norm():
        return float(torch.stack(torch._foreach_norm(grads, 2)).square().sum().sqrt())

    def per_param():  # the form before that: a temporary as large as each grad
        return float(torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt())
    runs = {"_foreach_norm (before)": foreach_norm, "pow(2).sum() per parameter": per_param}
    if device.type == "cuda":
        runs = {"square sums kernel (now)": lambda: float(buffers._squares().sum().sqrt()),
                **runs}
    rows, count = alternated(runs, rounds, iters, device)
    values = {name: run() for name, run in runs.items()}
    print("\n| grad norm squares | host CPU ms | GPU ms | wall ms | launches | norm |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for name, runs_of in rows.items():
        print(f"| {name} | {_median_cells(runs_of)} | {count[name]} | {values[name]:.9g} |")


SAMPLE = 65536  # values of each master kept (on the host) for the comparison with `single`
LR = 1e-4


def step_bytes(params: list) -> int:
    """Bytes one step must move (module docstring): 28 a value, 30 for a bf16 parameter's."""
    return sum(p.numel() * (28 if p.dtype == torch.float32 else 30) for p in params)


def build(argv: list[str], on_cpu: bool):
    groups = init_distributed(1, "cpu" if on_cpu else "cuda")
    trainer = Trainer(parse_config(argv), groups, log=lambda msg: None)
    # its masters and moments: this tool makes its own per form (the checkpointer holds them too)
    trainer.parts.optimizer = trainer.stepper.optimizer = trainer.parts.checkpointer = None
    return groups, trainer


def make_form(model, cfg, impl: str, start: list) -> tuple[MixedPrecisionAdamW, list]:
    """Form `impl` after 3 steps from the parameter values `start`; the first SAMPLE values of
    each of its masters then (on the host)."""
    optimizer = MixedPrecisionAdamW(model, cfg, impl)
    with torch.no_grad():
        for param, first, master in zip(optimizer.params, start, optimizer.masters):
            param.copy_(first)
            master.copy_(first)
    for _ in range(3):
        optimizer.step(LR)
    return optimizer, [m.detach().flatten()[:SAMPLE].cpu() for m in optimizer.masters]


def time_forms(model, cfg, impls: list[str], start: list, args, device):
    """({form: [timed, ...]}, {form: launches}, {form: masters sample}): all forms built at
    once and alternated, or (`args.one_at_a_time`) each built, timed and freed in turn."""
    if not args.one_at_a_time:
        forms = {impl: make_form(model, cfg, impl, start) for impl in impls}
        steps = {impl: (lambda o=form[0]: o.step(LR)) for impl, form in forms.items()}
        rows, count = alternated(steps, args.rounds, args.iters, device)
        return rows, count, {impl: form[1] for impl, form in forms.items()}
    rows, count, samples = {}, {}, {}
    for impl in impls:
        optimizer, samples[impl] = make_form(model, cfg, impl, start)
        one, launches_of = alternated({impl: lambda: optimizer.step(LR)}, args.rounds,
                                      args.iters, device)
        rows[impl], count[impl] = one[impl], launches_of[impl]
        del optimizer, one
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, count, samples


def time_flat_configs(model, cfg, configs: list[tuple[int, int]], start: list, args, device):
    """The flat form at each (block, warps) of `configs`, each built, timed over all its rounds
    and freed in turn (the same bits at every config: compared with the first)."""
    from epoverlap.kernels import adamw_triton
    rows, count, samples = {}, {}, {}
    default_block, default_warps = flat_adam.BLOCK, adamw_triton.num_warps_for
    try:
        for block, warps in configs:
            flat_adam.BLOCK = block
            adamw_triton.num_warps_for = lambda _block, w=warps: w
            name = f"flat {block}x{warps}"
            name += f" ({sum(n.startswith(name) for n in rows) + 1})" if name in rows else ""
            optimizer, samples[name] = make_form(model, cfg, "flat", start)
            one, launches_of = alternated({name: lambda: optimizer.step(LR)}, args.rounds,
                                          args.iters, device)
            rows[name], count[name] = one[name], launches_of[name]
            del optimizer, one
            torch.cuda.empty_cache()
    finally:
        flat_adam.BLOCK, adamw_triton.num_warps_for = default_block, default_warps
    return rows, count, samples


def _fits_side_by_side(params: list, impls: list[str], device: torch.device) -> bool:
    """Whether every form's masters and moments (12 bytes a value each) fit in free memory."""
    if device.type != "cuda":
        return True
    need = 12 * sum(p.numel() for p in params) * len(impls)
    return need < 0.9 * torch.cuda.mem_get_info(device)[0]


def print_forms(rows, count, samples, params, args, device) -> None:
    numel, moved = sum(p.numel() for p in params), step_bytes(params)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    how = "one form at a time" if args.one_at_a_time else "alternated rounds"
    print(f"\nbench_optim: {where}, preset {args.preset} {' '.join(args.model_flags)}, "
          f"flat block {'per row' if args.flat_configs else flat_adam.BLOCK}, "
          f"{len(params)} parameters, {numel / 1e6:.1f}M values, medians of {args.rounds} "
          f"{how} of {args.iters} steps; {moved / 1e9:.2f} GB a step must move, "
          f"{moved / args.hbm_gbs / 1e6:.2f} ms at {args.hbm_gbs:.0f} GB/s")
    print("| form | host CPU ms/step | GPU ms/step | wall ms/step | launches/step | GB/s | "
          "of the bound | max abs diff from single after 3 steps |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for impl, runs in rows.items():
        gpu_ms = medians(runs)["gpu_ms"]
        rate = f"{moved / gpu_ms / 1e6:.0f} | {moved / gpu_ms / 1e6 / args.hbm_gbs:.0%}" \
            if gpu_ms else "- | -"
        diff = _diff(samples[impl], samples["single"]) if "single" in samples else "-"
        print(f"| {impl} | {_median_cells(runs)} | {count[impl]} | {rate} | {diff} |")


def _diff(sample: list, reference: list) -> str:
    return f"{max(float((a - b).abs().max()) for a, b in zip(sample, reference)):.3g}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="megatron-cmp")
    parser.add_argument("--impls", default=",".join(ADAM_IMPLS),
                        help=f"forms to time, comma-separated, of {','.join(ADAM_IMPLS)}")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--hbm-gbs", type=float, default=4300.0,
                        help="the GPU's memory bandwidth in GB/s (measured; H200: ~4300)")
    parser.add_argument("--flat-block", type=int, default=flat_adam.BLOCK,
                        help="values per program of the flat form's kernel (a power of two)")
    parser.add_argument("--flat-configs", default="",
                        help="instead of --impls, the flat form at each BLOCKxWARPS of this "
                             "comma-separated list (e.g. 4096x8,8192x16), one at a time")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="build, time and free each form in turn (chosen by itself where "
                             "the forms do not fit side by side)")
    args, args.model_flags = parser.parse_known_args(argv)
    impls = args.impls.split(",")
    flat_adam.BLOCK = args.flat_block
    if not set(impls) <= set(ADAM_IMPLS):
        parser.error(f"--impls {args.impls}: forms of {','.join(ADAM_IMPLS)}")
    on_cpu = parse_config(args.model_flags).train.device == "cpu"
    if not on_cpu and not torch.cuda.is_available():
        print("bench_optim: needs a CUDA device (or --device cpu)")
        return 2
    flags = ["--preset", args.preset, "--mock-data", *([] if on_cpu else ["--bf16"]),
             "--cuda-graph-impl", "none", *args.model_flags]  # eager: no graph bank is built
    groups, trainer = build(flags, on_cpu)
    try:
        model, cfg, device = trainer.model, trainer.cfg.train, trainer.device
        params = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator(device).manual_seed(0)
        for param in params:
            param.main_grad.normal_(0.0, 1e-3, generator=gen)
        start = [p.detach().cpu() for p in params]  # on the host: the GPU holds the forms
        args.one_at_a_time = args.one_at_a_time or not _fits_side_by_side(params, impls, device)
        if args.flat_configs:
            configs = [tuple(int(v) for v in c.split("x")) for c in args.flat_configs.split(",")]
            rows, count, samples = time_flat_configs(model, cfg, configs, start, args, device)
            samples["single"] = next(iter(samples.values()))  # the diffs: against the first
        else:
            rows, count, samples = time_forms(model, cfg, impls, start, args, device)
        print_forms(rows, count, samples, params, args, device)
        print_norms(trainer.stepper.grads, args.rounds, args.iters, device)
        return 0
    finally:
        trainer.close()
        destroy_distributed(groups)


if __name__ == "__main__":
    sys.exit(main())
