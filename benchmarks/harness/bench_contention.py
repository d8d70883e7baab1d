"""Contention microbenchmark (issue 20): how much slower a GEMM runs while communication runs
beside it on another stream, and how much slower that communication runs beside the GEMM.

    python -m benchmarks.harness.bench_contention [--shapes megatron_e32_k4_mbs2x8,megatron_e8_k8_f4096_mbs8x4]
        [--ep 2] [--max-ctas default,16,8,4,2] [--min-ctas 1] [--copy-ctas sms,32,16,8,4,2]
        [--loads nccl,triton_copy,sm_copy,memcpy_d2d,d2h_pinned] [--computes gemm,grouped]
        [--iters 20] [--warmup 3] [--scale 1.0] [--comm-stream-priority high|normal]
        [--compute-sms all,120,120c] [--out-dir runs/bench_contention]
    torchrun --standalone --nproc-per-node N -m benchmarks.harness.bench_contention ...   (NCCL across N GPUs)

Sizes, from benchmarks/harness/bench_overlap.py's shapes (their flags through the training command's config;
`--ep` the expert-parallel size to size them for, default the world size if > 1, else 2, the
issue's measurement): T = micro batch x sequence tokens per microbatch and rank; the dense GEMM
is the attention's QKV projection [T, H] x [H, H + 2 x kv heads x head dim]; the grouped GEMM is
the experts' first one, `epoverlap.model.linear.grouped_gemm` (what GroupedSwiGLUExperts calls:
torch._grouped_mm on CUDA) over the R = T x topk routed rows a rank receives under balanced
routing, split equally over its E / EP local experts, [R, H] x [E/EP, H, 2 x expert FFN]; the
all-to-all moves the dispatch's tokens, R x H bf16 per rank. `--scale` shrinks T (tests).

Communication loads (each on a second stream, the comm stream of the overlap, high priority by
default as the runtime's):
  nccl        torch.distributed all_to_all_single of the all-to-all's bytes over the expert-
              parallel group made by the runtime's own code (`expert_parallel_groups`), once per
              --max-ctas value (its communicator's NCCL max_ctas/min_ctas, as
              --moe-a2a-nccl-max-ctas sets them). Across 2+ GPUs (torchrun) these are NCCL's
              kernels. With one rank NCCL runs no kernel at all: torch 2.11 with NCCL 2.28 was
              seen to run it as one cudaMemcpy DtoD (the `ran as` column says so, and a note
              follows the table), so on one GPU this load equals memcpy_d2d and the budget
              cannot act; hence triton_copy.
  triton_copy the bytes copied by a kernel launched on exactly --copy-ctas CTAs (each looping
              over its share, as NCCL's kernels do on their CTA budget): the one-GPU stand-in for
              an all-to-all kernel on a CTA budget (`sms`: one CTA per SM).
  sm_copy     the same bytes copied by an SM kernel: `copy_` between row-padded (strided) views,
              which ATen runs as its elementwise copy kernel.
  memcpy_d2d  `copy_` between contiguous tensors of one dtype on one device: ATen's
              copy_device_to_device calls cudaMemcpyAsync (DeviceToDevice) for these, no kernel
              of its own; the `ran as` column gives the profiler's name for it, and the slowdowns
              show whether it needs SMs (on H100 it behaved as an SM copy: it waited for SMs
              held by the grouped GEMM, which a copy engine would not).
  d2h_pinned  a device-to-host copy of the bytes into pinned host memory: certainly a copy engine
              (DMA, no SM): the same-GPU proxy for a copy-engine all-to-all. D2H, not H2D: like the
              send side of an all-to-all it reads HBM; it moves only as fast as PCIe, so it loads
              HBM far less than an NVLink copy would (its GB/s is printed).
  h2d_pinned  the reverse (writes HBM); not in the default list.
  host_transport  the all-to-all of --moe-a2a-transport host_memory (parallel/host_memory.py)
              in --host-slot-kib slots, on copy engines, ordered by stream memory operations.
              Under torchrun: across the expert-parallel group, the bytes in equal splits, as
              the nccl load. On one rank: two ranks' transports on one shared pinned region in
              this process, each sending half the bytes (so the GPU copies the all-to-all's
              bytes once device-to-host and once host-to-device, as one rank of a real pair
              does). Not in the default list.
  peer_transport  the all-to-all of --moe-a2a-transport peer_memory (parallel/peer_memory.py):
              the same protocol, each chunk copied device to device straight into the
              receiver's slots (under torchrun opened through CUDA IPC: a peer copy over
              NVLink). On one rank: two ranks' transports in this process, their slots on this
              GPU addressed directly, so the copies are within the GPU (cuMemcpyDtoDAsync, which
              may run as an SM copy there, as memcpy_d2d: the `ran as` column says). Not in the
              default list.
  symm_vdev   torch symmetric memory's `all_to_all_vdev` (NVSHMEM kernels reading the split
              sizes on the device) of the all-to-all's bytes in equal splits over the
              expert-parallel group (`bench_symm_a2a.Case`): the issue's other SM baseline.
              Under torchrun across 2+ GPUs only, with NVSHMEM (refused in one line
              otherwise). Not in the default list.
`ran as` is asked of the profiler after all timings (a profiler session leaves CUPTI attached,
which serialized later pinned copies with kernels on torch 2.11).

Timing (CUDA events, medians): alone, each side `--iters` times after `--warmup`; beside, the
load is started first and kept looping on its stream while the GEMMs run (one GEMM waits for the
first load to finish, enough loads are queued to outlast every GEMM even at a 2.5x slowdown, the
rest queued behind the GEMMs; retried with more loads or more GEMMs when either side outran the
other). `compute beside` is the median of the GEMMs during at least 90% of which a load ran,
`comm beside` that of the loads during 90% of which a GEMM ran; `load duty` is the share of the
GEMMs' span in which a load ran (below 1: the load stream had gaps, e.g. a host-bound load);
the JSON adds the counts and `compute_duty`, the same the other way round.
Slowdown = beside / alone, of each side.

`--compute-sms` runs the GEMMs on a stream of a CUDA green context holding that many SMs (torch's
`torch.cuda.green_contexts`, beta), once per value; `all` is the ordinary stream on every SM. The
loads stay on ordinary streams, so the SMs the GEMMs cannot take are free for them: whether the
comm slowdown beside the GEMMs is their sharing of SMs, and what a partition costs the GEMMs.
A count with a `c` suffix (`120c`) also sets torch's SM carveout for the GEMMs to the SMs left
out (cuBLAS and `torch._grouped_mm` then size their grids for the SMs they get, instead of
launching a wave for SMs the green context does not have).

Prints the sizes, then a markdown table last; writes OUT/bench_contention.json. Without a CUDA
GPU, or with a `--compute-sms` this GPU or torch cannot give: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from epoverlap.config import parse_config
from epoverlap.parallel.groups import NcclCtaBudget
from epoverlap.profiling.intervals import intersect, measure, union

DEFAULT_SHAPES = ("megatron_e32_k4_mbs2x8", "megatron_e8_k8_f4096_mbs8x4")
LOADS = ("nccl", "triton_copy", "sm_copy", "memcpy_d2d", "d2h_pinned", "h2d_pinned",
         "host_transport", "peer_transport", "symm_vdev")
COPY_TRANSPORTS = {"host_transport": "host_memory", "peer_transport": "peer_memory"}
DEFAULT_LOADS = LOADS[:5]
COMPUTES = ("gemm", "grouped")
ROW_ALIGN = 16  # rows per expert: a multiple of this (torch._grouped_mm's alignment)
SLOWDOWN_MARGIN = 2.5  # the loads queued outlast the GEMMs even if these slow down this much
COVERED = 0.9  # an op counts as "beside" when the other side ran during this much of it
MAX_GEMMS, MAX_LOADS = 4000, 20000
JSON_FILE = "bench_contention.json"


@dataclass(frozen=True)
class BenchSizes:
    """The sizes of one shape on one rank (module docstring)."""

    shape: str
    ep: int
    tokens: int  # T: tokens of one microbatch on one rank
    hidden: int  # H
    qkv_out: int  # the dense GEMM's output width: H + 2 x kv heads x head dim
    topk: int
    experts: int
    local_experts: int  # E / EP
    expert_ffn: int  # F (the grouped GEMM's output is 2F wide: SwiGLU's two halves)
    rows: int  # R: routed rows a rank sends, and receives under balanced routing

    @property
    def a2a_bytes(self) -> int:
        return self.rows * self.hidden * 2  # bf16

    @property
    def gemm_flops(self) -> int:
        return 2 * self.tokens * self.hidden * self.qkv_out

    @property
    def grouped_flops(self) -> int:
        return 2 * self.rows * self.hidden * 2 * self.expert_ffn

    def describe(self) -> str:
        return (f"{self.shape} (EP {self.ep}): T={self.tokens} tokens, H={self.hidden}; "
                f"gemm [{self.tokens}, {self.hidden}] x [{self.hidden}, {self.qkv_out}] "
                f"({self.gemm_flops / 1e9:.1f} GFLOP); grouped [{self.rows}, {self.hidden}] x "
                f"[{self.local_experts}, {self.hidden}, {2 * self.expert_ffn}] "
                f"({self.rows // self.local_experts} rows per expert, "
                f"{self.grouped_flops / 1e9:.1f} GFLOP); all-to-all {self.rows} rows x "
                f"{self.hidden} bf16 = {self.a2a_bytes / 2**20:.1f} MiB per rank")


def bench_sizes(shape: str, ep: int, scale: float = 1.0, world: int = 1) -> BenchSizes:
    """Sizes of a bench_overlap shape for EP `ep`; `scale` shrinks the tokens (rows rounded up
    to whole aligned rows per expert, and to a multiple of `world` for the all-to-all)."""
    from benchmarks.harness.bench_overlap import COMMON, SHAPES
    cfg = parse_config(SHAPES[shape] + COMMON)
    m, moe = cfg.model, cfg.moe
    if moe.num_experts % ep:
        raise ValueError(f"--ep {ep} does not divide the {moe.num_experts} experts of {shape}")
    local = moe.num_experts // ep
    tokens = cfg.train.micro_batch_size * m.seq_length
    tokens = max(ROW_ALIGN, round(tokens * scale / ROW_ALIGN) * ROW_ALIGN)
    unit = ROW_ALIGN * local * world
    rows = math.ceil(tokens * moe.moe_router_topk / unit) * unit
    return BenchSizes(shape, ep, tokens, m.hidden_size,
                      m.hidden_size + 2 * m.kv_heads * m.head_dim, moe.moe_router_topk,
                      moe.num_experts, local, moe.moe_ffn_hidden_size or m.ffn_hidden_size, rows)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The command line; a bad value exits 2 with argparse's one-line error."""
    from benchmarks.harness.bench_overlap import SHAPES, parse_budgets
    parser = argparse.ArgumentParser(prog="bench_contention",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel size the sizes are for (default: the world size "
                             "if > 1, else 2)")
    parser.add_argument("--max-ctas", default=None,
                        help="NCCL CTA budgets of the nccl load: 'default' or counts (default: "
                             "default,16,8,4,2 on 2+ ranks; 'default' on one, where NCCL runs "
                             "no kernel)")
    parser.add_argument("--min-ctas", type=int, default=None)
    parser.add_argument("--copy-ctas", default="sms,32,16,8,4,2",
                        help="grids of the triton_copy load: counts, or 'sms' (every SM)")
    parser.add_argument("--loads", default=",".join(DEFAULT_LOADS),
                        help=f"comma list of {', '.join(LOADS)}")
    parser.add_argument("--computes", default=",".join(COMPUTES))
    parser.add_argument("--host-slot-kib", type=int, default=4096,
                        help="slot size of the host_transport and peer_transport loads "
                             "(--moe-a2a-host-slot-kib)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies the tokens per microbatch (small runs, tests)")
    parser.add_argument("--comm-stream-priority", choices=("high", "normal"), default="high")
    parser.add_argument("--compute-sms", default="all",
                        help="comma list: 'all' (every SM) or SM counts for the GEMMs' green "
                             "context, a 'c' suffix to carve the GEMMs out to it too, e.g. "
                             "all,120,120c")
    parser.add_argument("--out-dir", default="runs/bench_contention")
    args = parser.parse_args(argv)
    args.shapes = _names(parser, "--shapes", args.shapes, SHAPES)
    args.loads = _names(parser, "--loads", args.loads, LOADS)
    args.computes = _names(parser, "--computes", args.computes, COMPUTES)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.max_ctas is None:
        args.max_ctas = "default,16,8,4,2" if world > 1 else "default"
    try:
        args.budgets = parse_budgets(args.max_ctas, args.min_ctas)
    except ValueError as error:
        parser.error(str(error))
    args.copy_ctas = [c.strip() for c in args.copy_ctas.split(",") if c.strip()]
    if not args.copy_ctas or not all(c == "sms" or (c.isdigit() and int(c) >= 1)
                                     for c in args.copy_ctas):
        parser.error(f"--copy-ctas {','.join(args.copy_ctas)!r}: counts >= 1 or 'sms'")
    for flag, value, low in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0)):
        if value < low:
            parser.error(f"{flag} {value}: must be >= {low}")
    if not 0 < args.scale <= 1:
        parser.error(f"--scale {args.scale}: must be in (0, 1]")
    if args.ep is not None and args.ep < 1:
        parser.error(f"--ep {args.ep}: must be >= 1")
    args.compute_sms = [c.strip() for c in args.compute_sms.split(",") if c.strip()]
    try:
        if not args.compute_sms:
            raise ValueError
        for value in args.compute_sms:
            split_compute_sms(value)
    except ValueError:
        parser.error(f"--compute-sms {','.join(args.compute_sms)!r}: 'all' or SM counts >= 1, "
                     "each optionally with a 'c' suffix")
    return args


def split_compute_sms(value: str) -> tuple[Optional[int], bool]:
    """One --compute-sms value -> (SM count, None for 'all'; whether the GEMMs are carved out
    to it too, the 'c' suffix). ValueError if it is neither."""
    if value == "all":
        return None, False
    carve = value.endswith("c")
    count = value[:-1] if carve else value
    if not count.isdigit() or int(count) < 1:
        raise ValueError(value)
    return int(count), carve


def _names(parser, flag: str, text: str, allowed) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        parser.error(f"{flag} {text!r}: allowed: {', '.join(allowed)}")
    return names


# ----------------------------------------------------------------------------------------------
# Report: rows -> markdown table and JSON (pure)
# ----------------------------------------------------------------------------------------------

TABLE_COLUMNS = (  # (header, row key, format)
    ("shape", "shape", "{}"), ("compute", "compute", "{}"), ("load", "load", "{}"),
    ("CTAs", "ctas", "{}"), ("compute SMs", "compute_sms", "{}"),
    ("compute alone ms", "compute_alone_ms", "{:.3f}"),
    ("compute beside ms", "compute_beside_ms", "{:.3f}"),
    ("compute slowdown", "compute_slowdown", "{:.3f}"),
    ("comm alone ms", "comm_alone_ms", "{:.3f}"), ("comm beside ms", "comm_beside_ms", "{:.3f}"),
    ("comm slowdown", "comm_slowdown", "{:.3f}"), ("comm GB/s alone", "comm_gbps", "{:.0f}"),
    ("load duty", "load_duty", "{:.2f}"), ("ran as", "ran_as", "{}"))


def markdown_table(rows: Sequence[dict]) -> str:
    """One line per (shape, compute, load, budget); `-` where a figure is missing."""
    lines = ["| " + " | ".join(h for h, _, _ in TABLE_COLUMNS) + " |",
             "| --- " * len(TABLE_COLUMNS) + "|"]
    for row in rows:
        cells = ["-" if row.get(key) is None else fmt.format(row[key])
                 for _, key, fmt in TABLE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def finish_row(row: dict) -> dict:
    """Slowdowns of both sides (beside / alone) and the load's bandwidth alone."""
    for side in ("compute", "comm"):
        alone, beside = row.get(f"{side}_alone_ms"), row.get(f"{side}_beside_ms")
        row[f"{side}_slowdown"] = beside / alone if alone and beside is not None else None
    alone = row.get("comm_alone_ms")
    row["comm_gbps"] = row["bytes"] / (alone * 1e-3) / 1e9 if alone else None
    return row


def write_report(out_dir: str | Path, report: dict) -> Path:
    path = Path(out_dir) / JSON_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------
# Timing (CUDA)
# ----------------------------------------------------------------------------------------------


def _events(count: int) -> list:
    return [torch.cuda.Event(enable_timing=True) for _ in range(count)]


def time_alone(op: Callable[[], None], stream, iters: int, warmup: int) -> float:
    """Median ms of `op` on `stream`, one op at a time back to back."""
    starts, ends = _events(iters), _events(iters)
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            op()
        for start, end in zip(starts, ends):
            start.record(stream)
            op()
            end.record(stream)
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


@dataclass
class Beside:
    """Both sides' medians while running together, and how busy the other side kept each."""

    compute_ms: Optional[float]
    comm_ms: Optional[float]
    computes_inside: int  # GEMMs beside a load for at least COVERED of their time
    loads_inside: int
    load_duty: float  # share of the GEMMs' span the load stream was busy
    compute_duty: float


def time_together(compute: Callable[[], None], load: Callable[[], None], plan: tuple[int, int, int],
                  compute_stream, comm_stream) -> Beside:
    """`plan` = (GEMMs, loads queued before them, loads in all): the first GEMM waits for the
    first load to finish; the remaining loads are queued behind the GEMMs (module docstring)."""
    gemms, lead, loads = plan
    origin, gate = torch.cuda.Event(enable_timing=True), torch.cuda.Event()
    load_marks, gemm_marks = (_events(loads), _events(loads)), (_events(gemms), _events(gemms))
    origin.record(comm_stream)

    def queue_loads(first: int, last: int) -> None:
        with torch.cuda.stream(comm_stream):
            for j in range(first, last):
                load_marks[0][j].record(comm_stream)
                load()
                load_marks[1][j].record(comm_stream)
                if j == 0:
                    gate.record(comm_stream)
    queue_loads(0, lead)
    with torch.cuda.stream(compute_stream):
        compute_stream.wait_event(gate)
        for i in range(gemms):
            gemm_marks[0][i].record(compute_stream)
            compute()
            gemm_marks[1][i].record(compute_stream)
    queue_loads(lead, loads)
    torch.cuda.synchronize()
    return _beside([_spans(origin, *load_marks), _spans(origin, *gemm_marks)])


def _spans(origin, starts, ends) -> list[tuple[float, float]]:
    return [(origin.elapsed_time(s), origin.elapsed_time(e)) for s, e in zip(starts, ends)]


def _beside(sides: list[list[tuple[float, float]]]) -> Beside:
    """Medians of the ops of each side that the other side's busy time covered (at least
    COVERED of the op's duration), and each side's duty in the other's span."""
    loads, gemms = sides
    load_busy, gemm_busy = union(loads), union(gemms)
    load_span, gemm_span = (loads[0][0], loads[-1][1]), (gemms[0][0], gemms[-1][1])

    def beside(items, busy):
        return [e - s for s, e in items if e > s and _covered(s, e, busy) >= COVERED * (e - s)]

    def duty(busy, span):
        return measure(intersect(busy, [span])) / max(span[1] - span[0], 1e-9)
    gemms_in, loads_in = beside(gemms, load_busy), beside(loads, gemm_busy)
    return Beside(statistics.median(gemms_in) if gemms_in else None,
                  statistics.median(loads_in) if loads_in else None, len(gemms_in),
                  len(loads_in), duty(load_busy, gemm_span), duty(gemm_busy, load_span))


def _covered(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    """How much of [start, end] the sorted, disjoint intervals `busy` cover."""
    total, index = 0.0, max(bisect.bisect_right(busy, (start, math.inf)) - 1, 0)
    while index < len(busy) and busy[index][0] < end:
        total += max(0.0, min(end, busy[index][1]) - max(start, busy[index][0]))
        index += 1
    return total


def together_plan(compute_ms: float, load_ms: float, iters: int,
                  gemms: Optional[int] = None) -> tuple[int, int, int]:
    """(GEMMs, loads queued ahead of them, loads in all): enough GEMMs that a few loads fit in
    their span (or `gemms`), enough loads ahead to cover the host's queueing of the GEMMs (~50
    us each) and enough in all to outlast the GEMMs at SLOWDOWN_MARGIN."""
    if gemms is None:
        gemms = max(iters, math.ceil(4 * load_ms / max(compute_ms, 1e-3)))
    gemms = min(gemms, MAX_GEMMS)
    lead = min(math.ceil((gemms * 0.05 + 1.0) / max(load_ms, 1e-3)) + 1, MAX_LOADS // 2)
    loads = lead + math.ceil(gemms * compute_ms * SLOWDOWN_MARGIN / max(load_ms, 1e-3)) + 2
    return gemms, lead, min(loads, MAX_LOADS)


def ran_as(op: Callable[[], None]) -> str:
    """What one call of `op` ran on the GPU, by the profiler's names: kernels (their short
    names) and/or memcpys ("Memcpy DtoD ..."); "unknown (...)" if the profiler fails here."""
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            op()
            torch.cuda.synchronize()
        names = sorted({_short(event.name) for event in prof.events()
                        if event.device_type == torch.autograd.DeviceType.CUDA})
    except Exception as error:  # a profiler that cannot run here must not stop the benchmark
        return f"unknown ({type(error).__name__})"
    return ", ".join(names) if names else "nothing on the GPU"


def _short(name: str) -> str:
    if name.startswith("Memcpy"):
        return name
    return name.split("(")[0].split("<")[0][:48]


# ----------------------------------------------------------------------------------------------
# The benchmark on a GPU
# ----------------------------------------------------------------------------------------------


def compute_ops(sizes: BenchSizes, device) -> dict[str, Callable[[], None]]:
    """The dense GEMM (into a preallocated output) and the experts' grouped GEMM (the model's
    own call, forward only)."""
    from epoverlap.model.linear import expert_offsets, grouped_gemm
    bf16 = dict(dtype=torch.bfloat16, device=device)
    x_TH = torch.randn(sizes.tokens, sizes.hidden, **bf16)
    w_HO = torch.randn(sizes.hidden, sizes.qkv_out, **bf16) * 0.02
    y_TO = torch.empty(sizes.tokens, sizes.qkv_out, **bf16)
    x_RH = torch.randn(sizes.rows, sizes.hidden, **bf16)
    w_LHF = torch.randn(sizes.local_experts, sizes.hidden, 2 * sizes.expert_ffn, **bf16) * 0.02
    per_expert = sizes.rows // sizes.local_experts
    counts = [per_expert] * sizes.local_experts
    offsets_L = expert_offsets(torch.tensor(counts, device=device))

    def gemm() -> None:
        torch.matmul(x_TH, w_HO, out=y_TO)

    def grouped() -> None:
        with torch.no_grad():
            grouped_gemm(x_RH, w_LHF, offsets_L, counts)
    return {"gemm": gemm, "grouped": grouped}


def _triton_copy_kernel():
    """A copy kernel whose CTA count is the launch grid (NCCL's kernels too run on a budget of
    CTAs, each looping over its share): program p copies blocks p, p + grid, p + 2 grid, ..."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_blocks(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
        # src_ptr, dst_ptr: flat bf16 buffers of numel elements; BLOCK elements per step
        first, step = tl.program_id(0) * BLOCK, tl.num_programs(0) * BLOCK
        for start in range(first, numel, step):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < numel
            tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)
    return copy_blocks


def triton_copy_load(ctas: int, sizes: BenchSizes, device) -> Callable[[], None]:
    """The all-to-all's bytes copied by `ctas` CTAs (one SM each at most)."""
    kernel = _triton_copy_kernel()
    src = torch.randn(sizes.rows * sizes.hidden, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return lambda: kernel[(ctas,)](src, dst, src.numel(), BLOCK=8192, num_warps=8)


def copy_load(kind: str, sizes: BenchSizes, device) -> Callable[[], None]:
    """One copy of the all-to-all's bytes, as `kind` (module docstring)."""
    rows, width = sizes.rows, sizes.hidden
    bf16 = dict(dtype=torch.bfloat16, device=device)
    if kind == "sm_copy":  # row-padded views: not contiguous, so ATen's copy kernel runs
        src = torch.randn(rows, width + 64, **bf16)[:, :width]
        dst = torch.empty(rows, width + 64, **bf16)[:, :width]
        return lambda: dst.copy_(src)
    if kind == "memcpy_d2d":
        src, dst = torch.randn(rows, width, **bf16), torch.empty(rows, width, **bf16)
        return lambda: dst.copy_(src)
    host = torch.empty(rows, width, dtype=torch.bfloat16, pin_memory=True)
    gpu = torch.randn(rows, width, **bf16)
    if kind == "d2h_pinned":
        return lambda: host.copy_(gpu, non_blocking=True)
    return lambda: gpu.copy_(host, non_blocking=True)


def host_transport_load(sizes: BenchSizes, device, slot_kib: int,
                        groups=None, kind: str = "host_memory") -> Callable[[], None]:
    """One exchange of a copy-engine transport (`kind`, module docstring): across the ranks of
    `groups.ep` (torchrun, one GPU each: each rank sends the all-to-all's bytes in equal
    splits, as the nccl load does), or, on one rank, of two ranks' transports sharing this GPU,
    each sending sizes.rows / 2 rows, half of them to each rank."""
    from epoverlap.parallel.host_memory import (CopyEngineTransport, HostSlots, Layout,
                                                SharedRegion, exchange_together,
                                                open_host_transport, region_path)
    from epoverlap.parallel.peer_memory import (PeerSlots, open_peer_transport,
                                                peer_slots_together)
    chunk = slot_kib * 1024
    if groups is not None and groups.ep_size > 1:
        opener = open_peer_transport if kind == "peer_memory" else open_host_transport
        transport = opener(groups.ep, groups.ep_rank, chunk, device, 600.0)
        send = torch.randn(sizes.rows, sizes.hidden, dtype=torch.bfloat16, device=device)
        recv = torch.empty_like(send)
        return lambda: transport.all_to_all(recv, send)
    layout = Layout(2, 2, chunk)
    peer = kind == "peer_memory"
    region = SharedRegion(region_path(f"bench-{os.getpid()}-{id(sizes)}"),
                          (PeerSlots if peer else HostSlots).region_bytes(layout), create=True)
    region.unlink()
    placements = peer_slots_together(layout, device) if peer else [None, None]
    ranks = [CopyEngineTransport(region, r, 2, chunk, device=device, placement=placements[r])
             for r in range(2)]
    half = sizes.rows // 2
    sends = [torch.randn(half, sizes.hidden, dtype=torch.bfloat16, device=device)
             for _ in ranks]
    recvs = [torch.empty_like(send) for send in sends]
    calls = [(transport, recv, send, None, None)
             for transport, send, recv in zip(ranks, sends, recvs)]
    return lambda: exchange_together(calls)


def nccl_load(groups, sizes: BenchSizes, device) -> Callable[[], None]:
    """all_to_all_single of the all-to-all's bytes (equal splits) over `groups.ep`."""
    send = torch.randn(sizes.rows, sizes.hidden, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)
    return lambda: groups.ep.all_to_all_single(recv, send)


def symm_vdev_load(groups, sizes: BenchSizes, device) -> Callable[[], None]:
    """`all_to_all_vdev` of the all-to-all's bytes in equal splits over `groups.ep`, the
    whole world (module docstring)."""
    import torch.distributed as dist
    from benchmarks.harness.bench_symm_a2a import Case, unavailable, use_nvshmem
    why = unavailable() or ("" if groups.ep_size > 1 and groups.ep_size == dist.get_world_size()
                            else f"needs the EP group to be the whole world of 2+ GPUs "
                                 f"(EP {groups.ep_size}, world {dist.get_world_size()})")
    if why:
        raise RuntimeError(f"bench_contention --loads symm_vdev: {why}")
    use_nvshmem()  # the bench's own loads allocate no symmetric memory before this
    pg = groups.ep.pg if groups.ep.pg is not None else dist.distributed_c10d._get_default_group()
    return Case(sizes.rows, 1.0, sizes.hidden, device, pg.group_name).symm_vdev


def _agreed(values: Sequence[int], device) -> tuple[int, ...]:
    """The largest of each value over the ranks: every rank issues as many NCCL calls."""
    import torch.distributed as dist
    counts = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return tuple(int(c) for c in counts.tolist())


def measure_pair(compute: Callable[[], None], load: Callable[[], None], streams, args,
                 device) -> dict:
    """Alone (each side), then beside. Retried (at most twice, every rank alike) with 3x the
    loads if fewer than half the GEMMs ran beside them, or with 4x the GEMMs if fewer than 3
    loads did (a load slowed down a lot)."""
    compute_stream, comm_stream = streams
    compute_ms = time_alone(compute, compute_stream, args.iters, args.warmup)
    load_ms = time_alone(load, comm_stream, args.iters, args.warmup)
    plan = _agreed(together_plan(compute_ms, load_ms, args.iters), device)
    for attempt in range(3):
        beside = time_together(compute, load, plan, compute_stream, comm_stream)
        short_loads, few_loads = _agreed([beside.computes_inside < plan[0] // 2,
                                          beside.loads_inside < 3], device)
        if attempt == 2 or not (short_loads or few_loads):
            break
        gemms, lead, loads = together_plan(compute_ms, load_ms, args.iters,
                                           plan[0] * 4 if few_loads else plan[0])
        plan = _agreed((gemms, lead, loads * 3 if short_loads else loads), device)
    return {"compute_alone_ms": compute_ms, "comm_alone_ms": load_ms,
            "compute_beside_ms": beside.compute_ms, "comm_beside_ms": beside.comm_ms,
            "computes_inside": beside.computes_inside, "loads_inside": beside.loads_inside,
            "load_duty": beside.load_duty, "compute_duty": beside.compute_duty,
            "plan": list(plan)}


@dataclass(frozen=True)
class Load:
    """One communication load: its kind and setting (an NCCL budget, a copy's CTA count)."""

    kind: str
    budget: Optional[NcclCtaBudget] = None
    ctas: Optional[int] = None
    slot_kib: int = 4096  # host_transport's and peer_transport's slots

    def label(self) -> str:
        if self.budget is not None:
            return self.budget.describe().removeprefix("CTAs ")
        return "-" if self.ctas is None else str(self.ctas)

    def make(self, sizes: BenchSizes, device, groups_of) -> Callable[[], None]:
        if self.kind == "nccl":
            return nccl_load(groups_of(self.budget), sizes, device)
        if self.kind == "triton_copy":
            return triton_copy_load(self.ctas, sizes, device)
        if self.kind == "symm_vdev":
            return symm_vdev_load(groups_of(NcclCtaBudget(None, None)), sizes, device)
        if self.kind in COPY_TRANSPORTS:
            return host_transport_load(sizes, device, self.slot_kib,
                                       groups_of(NcclCtaBudget(None, None)),
                                       COPY_TRANSPORTS[self.kind])
        return copy_load(self.kind, sizes, device)


def loads_of(args, sms: int) -> list[Load]:
    """The loads of --loads, nccl once per --max-ctas budget, triton_copy per --copy-ctas."""
    loads: list[Load] = []
    for kind in args.loads:
        if kind == "nccl":
            loads += [Load(kind, budget=budget) for budget in args.budgets]
        elif kind == "triton_copy":
            loads += [Load(kind, ctas=sms if c == "sms" else int(c)) for c in args.copy_ctas]
        elif kind in COPY_TRANSPORTS:
            loads.append(Load(kind, slot_kib=args.host_slot_kib))
        else:
            loads.append(Load(kind))
    return loads


def bench_shape(sizes: BenchSizes, groups_of: Callable[[NcclCtaBudget], object], streams, args,
                log, compute_sms: str = "all") -> list[dict]:
    """Every (compute, load) pair of one shape (`ran_as` is filled in later: see run), the
    GEMMs on `streams[0]` (a green context's stream of `compute_sms` SMs, or every SM)."""
    device = streams[0].device
    computes = compute_ops(sizes, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for spec in loads_of(args, sms):
        load = spec.make(sizes, device, groups_of)
        for name in args.computes:
            row = {"shape": sizes.shape, "compute": name, "load": spec.kind,
                   "ctas": spec.label(), "compute_sms": compute_sms,
                   "bytes": sizes.a2a_bytes, "ran_as": None,
                   "load_spec": spec, **measure_pair(computes[name], load, streams, args, device)}
            rows.append(finish_row(row))
            log(f"[bench_contention] {sizes.shape} {name} on {compute_sms} SMs beside "
                f"{spec.kind} ({spec.label()}): "
                f"compute x{_x(row['compute_slowdown'])}, comm x{_x(row['comm_slowdown'])}")
        del load
        torch.cuda.empty_cache()
    return rows


class ComputeSmsError(ValueError):
    """A --compute-sms value this GPU or this torch cannot give (one line, exit status 2)."""


def compute_stream_on(value: str, device: torch.device):
    """The GEMMs' stream: the current one for 'all', else the stream of a new green context of
    that many SMs (kept alive by the stream's owner, returned with it)."""
    sms, _ = split_compute_sms(value)
    if sms is None:
        return torch.cuda.current_stream(device), None
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if sms >= total:
        raise ComputeSmsError(f"--compute-sms {value}: this GPU has {total} SMs; give fewer, "
                              "or 'all'")
    from torch.cuda import green_contexts
    if not getattr(green_contexts, "SUPPORTED", False):
        raise ComputeSmsError(f"--compute-sms {value}: torch {torch.__version__} was built "
                              "without CUDA green contexts; use 'all'")
    context = green_contexts.GreenContext.create(num_sms=sms, device_id=device.index)
    return context.Stream(), context


def fill_ran_as(rows: list[dict], all_sizes: Sequence[BenchSizes], device, groups_of) -> None:
    """What each load ran as, asked of the profiler after every timing: a profiler session
    leaves CUPTI attached, which was seen to serialize later pinned-memory copies with
    kernels (on torch 2.11), so no timing may follow one."""
    by_shape = {sizes.shape: sizes for sizes in all_sizes}
    seen: dict[tuple, str] = {}
    for row in rows:
        spec = row.pop("load_spec")
        key = (row["shape"], spec)
        if key not in seen:
            load = spec.make(by_shape[row["shape"]], device, groups_of)
            seen[key] = ran_as(load)
            del load
            torch.cuda.empty_cache()
        row["ran_as"] = seen[key]


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _environment(world: int, args) -> dict:
    version = torch.cuda.nccl.version()
    nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {"device": torch.cuda.get_device_name(), "world": world, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl,
            "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "comm_stream_priority": args.comm_stream_priority, "iters": args.iters,
            "warmup": args.warmup, "scale": args.scale}


def run(args) -> int:
    """On the GPU: groups (one EP group per budget, made as the runtime makes them), streams,
    every shape; rank 0 prints the sizes, the table and writes the JSON."""
    from epoverlap.parallel.groups import (destroy_distributed, expert_parallel_groups,
                                           init_distributed)
    from epoverlap.schedule.executor import CudaStreamLanes
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep = args.ep or (world if world > 1 else 2)
    all_sizes = [bench_sizes(shape, ep, args.scale, world) for shape in args.shapes]
    groups = init_distributed(world, "cuda")
    made: dict[NcclCtaBudget, object] = {}

    def groups_of(budget: NcclCtaBudget):
        if budget not in made:
            made[budget] = groups if budget.is_default else expert_parallel_groups(
                world, groups.device, groups.local_rank, watch=groups.watch, ep_budget=budget)
        return made[budget]
    log = print if groups.rank == 0 else (lambda message: None)
    lanes = CudaStreamLanes(groups.device, args.comm_stream_priority == "high")
    rows = []
    try:
        total = torch.cuda.get_device_properties(groups.device).multi_processor_count
        for compute_sms in args.compute_sms:
            compute_stream, context = compute_stream_on(compute_sms, groups.device)
            sms, carve = split_compute_sms(compute_sms)
            torch._C._set_sm_carveout_experimental(total - sms if carve else None)
            try:
                for sizes in all_sizes:
                    log(f"[bench_contention] sizes: {sizes.describe()}")
                    rows += bench_shape(sizes, groups_of, (compute_stream, lanes.comm_stream),
                                        args, log, compute_sms)
            finally:
                torch._C._set_sm_carveout_experimental(None)
            torch.cuda.synchronize(groups.device)
            del compute_stream, context
        fill_ran_as(rows, all_sizes, groups.device, groups_of)
    finally:
        destroy_distributed(groups)
    if groups.rank == 0:
        report = {"environment": _environment(world, args),
                  "sizes": [{**asdict(s), "a2a_bytes": s.a2a_bytes} for s in all_sizes],
                  "rows": rows}
        path = write_report(args.out_dir, report)
        print(f"\nbench_contention: {report['environment']['device']}, world {world}, "
              f"torch {torch.__version__}, NCCL {report['environment']['nccl']}; wrote {path}")
        print(markdown_table(rows))
        if any(r["load"] == "nccl" and "Memcpy" in r["ran_as"] and "Kernel" not in r["ran_as"]
               for r in rows):
            print("note: NCCL ran the all-to-all as a cudaMemcpy, no NCCL kernel (one rank): "
                  "its CTA budget cannot act here; triton_copy at --copy-ctas is the one-GPU "
                  "stand-in for a copy kernel on a CTA budget")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_contention: needs a CUDA GPU (GEMMs beside NCCL all-to-alls and copies on "
              "CUDA streams); none is visible here", file=sys.stderr)
        return 2
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # as the overlapped training
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    try:
        return run(args)
    except ComputeSmsError as error:
        print(f"bench_contention: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
