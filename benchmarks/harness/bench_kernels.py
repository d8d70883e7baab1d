"""Benchmark the Triton routing kernels against the torch reference and the copy bandwidth.

Run on one GPU:  python -m benchmarks.harness.bench_kernels [--out PATH] [--sweep] [--shapes dsv3,mixtral]
Without CUDA it prints why and exits 0 (the kernels' CPU tests run under pytest instead).

For each shape and op, forward and backward: correctness against the torch reference first,
then the median time (triton.testing.do_bench, L2 flushed between runs), the achieved GB/s
from the bytes formula below, that as a fraction of the device-to-device copy bandwidth
measured in the same run (one 1 GiB tensor copy, bytes read + written), and the speedup over
the torch reference. The eager time includes whatever host time the call spends past the
~60 us that do_bench's L2 flush gives it, so for the Triton ops two more columns tell host- from
GPU-bound: "graph ms" (the same call captured in a CUDA graph and replayed, L2 flushed: GPU time
only, launch gaps included) with its fraction of copy, a graphed device-to-device copy of the same bytes (the floor for
that much traffic at that size, launch latency included; in parentheses its share of the
graphed op's time), and "host us" (median wall time of one
call from an idle GPU, no sync: the Python + launch cost), once through the per-shape launch
cache (epoverlap.kernels.launch_cache, the default) and once through Triton's own launch path,
calls alternating. The last thing printed is a markdown
table (also written to --out). `--sweep` adds kernel-only times of the row kernels for other
(BLOCK_H, num_warps, BLOCK_T) tiles and of the row-map build's two variants.

Bytes formulas (T tokens, E experts, H hidden, K top-k, N = T*K rows, C chunks;
s / p / f = bytes per token element / prob / logit; the routing map is 1 byte per flag):
  router fwd      T*E*f (logits) + T*E*f (probs) + T*E (routing map) + 8*E (counts)
  router bwd      T*E*f (grad probs) + T*E*f (logits) + T*E (map) + T*E*f (grad logits)
  row map         T*E (routing map) + 4*T*E (int32 row-id map)
  permute fwd     T*E + 4*T*E (map build) + T*H*s + N*H*s (rows) + T*E*p + N*p (probs)
  permute bwd     N*H*s + T*H*s (rows) + 4*T*E (map) + N*p + T*E*p (probs)
  unpermute fwd   N*H*s + T*H*s (rows) + 4*T*E (map) + T*E*p (merging probs)
  unpermute bwd   T*H*s + 2*N*H*s (grad out; fwd rows for the probs grad; grad rows)
                  + 4*T*E (map) + 2*T*E*p (probs, grad probs)
  sort_chunks     2*N*H*s + 2*N*p (rows, probs; forward and backward alike)
"Permute fwd" is end to end from the routing map: the row-map build is included.
The formulas count compulsory DRAM traffic (each input read once, each output written once):
scratch (the map build's per-block counts) and L2 re-reads (each one-launch map program counts
the whole small map) are not counted. The unpermute benchmarks use the map built by the Triton
permute (bit-identical to the torch one, checked), as the runtime does: it carries its routed
count, which the unpermute backward needs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    hidden: int
    experts: int
    topk: int
    router: dict = field(default_factory=dict)
    ranks: int = 8  # chunk sort: chunks = ranks x local experts


SHAPES = {
    "dsv3": Shape("dsv3", 8192, 7168, 256, 8, dict(score_function="sigmoid", num_groups=8,
                                                   group_topk=4, scaling_factor=2.5, bias=True)),
    "mixtral": Shape("mixtral", 8192, 4096, 8, 2, dict(score_function="softmax"), ranks=4),
}


@dataclass
class Row:
    shape: str
    op: str
    direction: str
    triton_ms: float
    torch_ms: float
    nbytes: int
    graph_ms: Optional[float] = None  # the Triton call replayed from a CUDA graph
    # a device-to-device copy of the same bytes (nbytes / 2 read, nbytes / 2 written), replayed
    # from a CUDA graph: what a pure copy of this size costs, launch latency included
    same_copy_ms: Optional[float] = None
    # the Triton call's host time: through the launch cache, and through Triton's own path
    host_us: Optional[tuple[float, float]] = None

    def cells(self, copy_gbps: float) -> list[str]:
        gbps = self.nbytes / self.triton_ms / 1e6
        graph = ["n/a", "n/a"]
        if self.graph_ms:
            graph_gbps = self.nbytes / self.graph_ms / 1e6
            graph = [f"{self.graph_ms:.4f}", f"{100 * graph_gbps / copy_gbps:.0f}%"]
        host = "n/a" if self.host_us is None else "{:.0f} / {:.0f}".format(*self.host_us)
        same = "n/a"
        if self.graph_ms and self.same_copy_ms:
            same = f"{self.same_copy_ms:.4f} ({100 * self.same_copy_ms / self.graph_ms:.0f}%)"
        return [self.shape, self.op, self.direction, f"{self.triton_ms:.4f}", f"{gbps:.0f}",
                f"{100 * gbps / copy_gbps:.0f}%", *graph, same, host, f"{self.torch_ms:.4f}",
                f"{self.torch_ms / self.triton_ms:.1f}x"]


def bench(fn: Callable, rep_ms: int) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms,
                                   return_mode="median")


def graph_ms(setup: Callable[[], Callable], rep_ms: int) -> Optional[float]:
    """GPU-only time of a call: `setup()` runs on a side stream (a backward's forward must run
    there too, so its kernels land on the capturing stream) and returns the call, which is warmed
    up, captured in a CUDA graph and replayed under `bench` (L2 flushed before each replay).
    None, with the reason printed, if the capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn = setup()
            fn()
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
        torch.cuda.synchronize()
        return bench(graph.replay, max(10, rep_ms // 4))  # a replay varies little: short
    except Exception as err:  # report, keep benchmarking the rest
        torch.cuda.synchronize()
        print(f"  (graph capture failed: {type(err).__name__}: {str(err)[:300]})", flush=True)
        return None


def host_us(fn: Callable, calls: int = 40) -> tuple[float, float]:
    """Median wall time of one call of `fn` issued to an idle GPU (no sync inside the timing):
    what the call costs the host (Python, autograd, launches); (with the per-shape launch
    cache, with every launch through Triton's own `JITFunction.run`), calls alternating."""
    from epoverlap.kernels import set_launch_cache

    times: tuple[list, list] = ([], [])
    try:
        for i in range(2 * calls):
            set_launch_cache(i % 2 == 0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times[i % 2].append(time.perf_counter() - start)
    finally:
        set_launch_cache(True)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times[0]), 1e6 * statistics.median(times[1])


def same_bytes_copy_ms(nbytes: int, rep_ms: int) -> Optional[float]:
    """A graphed device-to-device copy moving `nbytes` in all (half read, half written): the
    floor of a kernel of that traffic, its launch latency included."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return graph_ms(lambda: (lambda: dst.copy_(src)), rep_ms)


def copy_bandwidth_gbps(rep_ms: int) -> float:
    """Device-to-device copy of 1 GiB: (read + written bytes) / median time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep_ms)
    return 2 * (1 << 30) / ms / 1e6


def _check(name: str, got, want, exact: bool) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g is None and w is None:
            continue
        if exact or g.dtype in (torch.bool, torch.int32, torch.int64):
            if not torch.equal(g, w):
                raise SystemExit(f"{name}: output {i} differs from the torch reference")
        else:
            torch.testing.assert_close(g.float(), w.float(), rtol=2 ** -7, atol=1e-4,
                                       msg=lambda m, i=i: f"{name}: output {i}: {m}")


def _grad_fn(outputs, inputs, grads):
    return lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True)


def _randn(shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=gen).to(dtype)


def _router_logits(shape: Shape, gen: torch.Generator):
    """Tie-free logits (distinct per row, groups in disjoint value ranges) and settings.

    With ties or near-ties the two backends may legitimately pick different experts; these
    inputs keep the routing maps comparable bit for bit (speed does not depend on values).
    """
    settings = dict(shape.router)
    t, e = shape.tokens, shape.experts
    groups = settings.get("num_groups") or 1
    per = e // groups
    group_rank = torch.rand(t, groups, device="cuda", generator=gen).argsort(dim=1)
    inner = torch.rand(t, groups, per, device="cuda", generator=gen).argsort(dim=2)
    rank = (group_rank[:, :, None] * per + inner).reshape(t, e)
    if settings.pop("bias", False):  # constant per group, steps of 2: no near-ties either
        group = torch.arange(e, device="cuda") // per
        settings["expert_bias"] = 2.0 * (group % 3 - 1).float()
    return (rank.float() - e / 2) / 32, settings


def _routing_inputs(shape: Shape):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits, settings = _router_logits(shape, gen)
    scores = torch.rand(shape.tokens, shape.experts, device="cuda", generator=gen)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(
        1, scores.topk(shape.topk, dim=1).indices, True)
    tokens = torch.randn(shape.tokens, shape.hidden, device="cuda", generator=gen).bfloat16()
    probs = (torch.rand(scores.shape, device="cuda", generator=gen) * routing_map).bfloat16()
    return settings, logits, routing_map, tokens, probs


def bench_router(shape: Shape, ops: dict, rep_ms: int) -> list[Row]:
    settings, logits, *_ = _routing_inputs(shape)
    t, e, f = shape.tokens, shape.experts, logits.element_size()
    grad = _randn(logits.shape, logits.dtype, 2)
    results = {}
    for backend, impl in ops.items():
        x = logits.clone().requires_grad_()
        out = impl.router_topk_with_counts(x, shape.topk, **settings)
        fwd = bench(lambda impl=impl: impl.router_topk_with_counts(logits, shape.topk,
                                                                **settings), rep_ms)
        grad_fn = _grad_fn(out[0], x, grad)
        results[backend] = (list(out) + list(grad_fn()), fwd, bench(grad_fn, rep_ms))
    tri, ref = results["triton"], results["torch"]
    _check(f"{shape.name} router", tri[0], ref[0], exact=False)
    impl = ops["triton"]

    def fwd():
        return lambda: impl.router_topk_with_counts(logits, shape.topk, **settings)

    def bwd():
        x = logits.clone().requires_grad_()
        return _grad_fn(impl.router_topk_with_counts(x, shape.topk, **settings)[0], x, grad)
    return [Row(shape.name, "router_topk", "fwd", tri[1], ref[1], 2 * t * e * f + t * e + 8 * e,
                graph_ms(fwd, rep_ms), host_us(fwd())),
            Row(shape.name, "router_topk", "bwd", tri[2], ref[2], 3 * t * e * f + t * e,
                graph_ms(bwd, rep_ms), host_us(bwd()))]


def bench_row_map(shape: Shape, ops: dict, rep_ms: int) -> list[Row]:
    from epoverlap.kernels.permutation import build_row_id_map
    from epoverlap.kernels.permutation_triton import build_row_id_map_triton
    _, _, routing_map, _, _ = _routing_inputs(shape)
    _check(f"{shape.name} row map", [build_row_id_map_triton(routing_map)[0]],
           [build_row_id_map(routing_map)], exact=True)
    tri = bench(lambda: build_row_id_map_triton(routing_map), rep_ms)
    ref = bench(lambda: build_row_id_map(routing_map), rep_ms)

    def fwd():
        return lambda: build_row_id_map_triton(routing_map)
    return [Row(shape.name, "row_id_map", "fwd", tri, ref, 5 * shape.tokens * shape.experts,
                graph_ms(fwd, rep_ms), host_us(fwd()))]


def bench_permute(shape: Shape, ops: dict, rep_ms: int) -> list[Row]:
    _, _, routing_map, tokens, probs = _routing_inputs(shape)
    t, e, h, n = shape.tokens, shape.experts, shape.hidden, shape.tokens * shape.topk
    s, p = tokens.element_size(), probs.element_size()
    results = {}
    for backend, impl in ops.items():
        x, pr = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        out = impl.permute(x, routing_map, pr, num_out_tokens=n)
        fwd = bench(lambda impl=impl: impl.permute(tokens, routing_map, probs, num_out_tokens=n),
                    rep_ms)
        grads = [_randn(out[0].shape, out[0].dtype, 3), _randn(out[1].shape, out[1].dtype, 4)]
        grad_fn = _grad_fn(out[:2], [x, pr], grads)
        results[backend] = (out, grad_fn(), fwd, bench(grad_fn, rep_ms))
    tri, ref = results["triton"], results["torch"]
    _check(f"{shape.name} permute", list(tri[0]) + list(tri[1]), list(ref[0]) + list(ref[1]),
           exact=True)
    impl = ops["triton"]
    grads = [_randn((n, h), tokens.dtype, 3), _randn((n,), probs.dtype, 4)]

    def fwd():
        return lambda: impl.permute(tokens, routing_map, probs, num_out_tokens=n)

    def bwd():
        x, pr = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        out = impl.permute(x, routing_map, pr, num_out_tokens=n)
        return _grad_fn(out[:2], [x, pr], grads)
    return [Row(shape.name, "permute", "fwd", tri[2], ref[2],
                5 * t * e + (t + n) * h * s + t * e * p + n * p,
                graph_ms(fwd, rep_ms), host_us(fwd())),
            Row(shape.name, "permute", "bwd", tri[3], ref[3],
                (n + t) * h * s + 4 * t * e + n * p + t * e * p,
                graph_ms(bwd, rep_ms), host_us(bwd()))]


def bench_unpermute(shape: Shape, ops: dict, rep_ms: int) -> list[Row]:
    _, _, routing_map, tokens, probs = _routing_inputs(shape)
    t, e, h, n = shape.tokens, shape.experts, shape.hidden, shape.tokens * shape.topk
    rows, _, row_map = ops["triton"].permute(tokens, routing_map, num_out_tokens=n)
    _check(f"{shape.name} unpermute's row map", [row_map],
           [ops["torch"].permute(tokens, routing_map, num_out_tokens=n)[2]], exact=True)
    s, p = rows.element_size(), probs.element_size()
    results = {}
    for backend, impl in ops.items():
        r, m = rows.clone().requires_grad_(), probs.clone().requires_grad_()
        out = impl.unpermute(r, row_map, probs=m)
        fwd = bench(lambda impl=impl: impl.unpermute(rows, row_map, probs=probs), rep_ms)
        grad_fn = _grad_fn(out, [r, m], _randn(out.shape, out.dtype, 5))
        results[backend] = ([out], grad_fn(), fwd, bench(grad_fn, rep_ms))
    tri, ref = results["triton"], results["torch"]
    _check(f"{shape.name} unpermute", tri[0] + list(tri[1]), ref[0] + list(ref[1]), exact=False)
    impl = ops["triton"]
    grad = _randn((t, h), rows.dtype, 5)

    def fwd():
        return lambda: impl.unpermute(rows, row_map, probs=probs)

    def bwd():
        r, m = rows.clone().requires_grad_(), probs.clone().requires_grad_()
        return _grad_fn(impl.unpermute(r, row_map, probs=m), [r, m], grad)
    return [Row(shape.name, "unpermute+probs", "fwd", tri[2], ref[2],
                (n + t) * h * s + 4 * t * e + t * e * p, graph_ms(fwd, rep_ms), host_us(fwd())),
            Row(shape.name, "unpermute+probs", "bwd", tri[3], ref[3],
                (t + 2 * n) * h * s + 4 * t * e + 2 * t * e * p, graph_ms(bwd, rep_ms),
                host_us(bwd()))]


def _chunk_inputs(shape: Shape):
    gen = torch.Generator(device="cuda").manual_seed(1)
    n = shape.tokens * shape.topk
    local = max(1, shape.experts // shape.ranks)
    weights = torch.rand(shape.ranks * local, device="cuda", generator=gen) + 0.5
    counts = (weights / weights.sum() * n).long()
    counts[0] += n - counts.sum()  # splits sum to N exactly
    order = torch.tensor([r * local + e for e in range(local) for r in range(shape.ranks)],
                         device="cuda")
    rows = torch.randn(n, shape.hidden, device="cuda", generator=gen).bfloat16()
    probs = torch.rand(n, device="cuda", generator=gen).bfloat16()
    return rows, counts, order, probs


def bench_sort_chunks(shape: Shape, ops: dict, rep_ms: int) -> list[Row]:
    rows, counts, order, probs = _chunk_inputs(shape)
    nbytes = 2 * rows.numel() * rows.element_size() + 2 * probs.numel() * probs.element_size()
    results = {}
    for backend, impl in ops.items():
        r, pr = rows.clone().requires_grad_(), probs.clone().requires_grad_()
        out = impl.sort_chunks_by_idxs(r, counts, order, pr)
        fwd = bench(lambda impl=impl: impl.sort_chunks_by_idxs(rows, counts, order, probs),
                    rep_ms)
        grads = [_randn(out[0].shape, out[0].dtype, 6), _randn(out[1].shape, out[1].dtype, 7)]
        grad_fn = _grad_fn(out, [r, pr], grads)
        results[backend] = (list(out), list(grad_fn()), fwd, bench(grad_fn, rep_ms))
    tri, ref = results["triton"], results["torch"]
    _check(f"{shape.name} sort_chunks", tri[0] + tri[1], ref[0] + ref[1], exact=True)
    impl = ops["triton"]
    grads = [_randn(rows.shape, rows.dtype, 6), _randn(probs.shape, probs.dtype, 7)]

    def fwd():
        return lambda: impl.sort_chunks_by_idxs(rows, counts, order, probs)

    def bwd():
        r, pr = rows.clone().requires_grad_(), probs.clone().requires_grad_()
        return _grad_fn(impl.sort_chunks_by_idxs(r, counts, order, pr), [r, pr], grads)
    return [Row(shape.name, "sort_chunks", "fwd", tri[2], ref[2], nbytes, graph_ms(fwd, rep_ms),
                host_us(fwd())),
            Row(shape.name, "sort_chunks", "bwd", tri[3], ref[3], nbytes, graph_ms(bwd, rep_ms),
                host_us(bwd()))]


SWEEP_OPS = ("permute", "permute bwd", "unpermute+probs", "unpermute bwd", "sort_chunks",
             "sort_chunks bwd", "row map")
PREFETCH_OPS = ("permute bwd", "unpermute+probs")  # the kernels with a `prefetch` variant


def sweep_tiles(shape: Shape, rep_ms: int, ops: tuple = SWEEP_OPS) -> list[str]:
    """Kernel-only times of the row kernels for other tiles, and of both row-map builds (to
    tune triton_utils)."""
    from epoverlap.kernels import permutation_triton as pt
    from epoverlap.kernels import sort_chunks_triton as st
    from epoverlap.kernels.triton_utils import (CopyConfig, MapTiles, cdiv, copy_config,
                                                map_tiles, next_pow2, permute_config,
                                                unpermute_config)
    _, _, routing_map, tokens, probs = _routing_inputs(shape)
    n, t, e, h = shape.tokens * shape.topk, shape.tokens, shape.experts, shape.hidden
    row_map, _, total = pt.build_row_id_map_triton(routing_map)
    rows = pt._launch_permute(tokens, row_map, total, n)[0]
    src_rows, _ = st.chunk_src_rows_triton(*_chunk_inputs(shape)[1:3], n)
    row_vals = rows[:, 0].contiguous()  # stands in for the permuted probs' grad
    kernels = {
        "permute": (lambda c: pt._launch_permute(tokens, row_map, total, n, probs, config=c),
                    permute_config(h, 2, e), True),
        "permute bwd": (lambda c: pt._launch_unpermute(rows, row_map, row_vals_N=row_vals,
                                                       config=c),
                        unpermute_config(h, 2, e, "permute_backward"), True),
        "unpermute+probs": (lambda c: pt._launch_unpermute(rows, row_map, probs, config=c),
                            unpermute_config(h, 2, e, "forward"), True),
        "unpermute bwd": (lambda c: pt._launch_unpermute_bwd(tokens, rows, row_map, probs,
                                                             config=c, total_1=total),
                          unpermute_config(h, 2, e, "backward"), True),
        "sort_chunks": (lambda c: st._launch_move_rows(rows, src_rows, None, False, config=c),
                        copy_config(h, 2), False),
        "sort_chunks bwd": (lambda c: st._launch_move_rows(rows, src_rows, None, True, config=c),
                            copy_config(h, 2), False)}
    lines = []
    for name, (launch, chosen, multi_token) in kernels.items():
        if name not in ops:
            continue
        for block_h in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                for block_t in ((1, 2, 4) if multi_token else (1,)):
                    if block_t * block_h * 2 > 32768 or block_h > 2 * next_pow2(h):
                        continue
                    for prefetch in ((False, True) if name in PREFETCH_OPS else (False,)):
                        config = CopyConfig(block_h, warps, block_t, prefetch)
                        ms = bench(lambda launch=launch, config=config: launch(config), rep_ms)
                        mark = " (default)" if config == chosen else ""
                        label = name + (" prefetch" if prefetch else "")
                        lines.append(f"| {shape.name} | {label} | {block_h} | {warps} | "
                                     f"{block_t} | {ms:.4f}{mark} |")
    if "row map" not in ops:
        return lines
    default = map_tiles(t, e)
    variants = {"default": default}
    if default.single:  # the two-pass build at the same token blocks
        variants["two-pass"] = MapTiles(default.sub_t, default.num_sub, default.block_e,
                                        default.num_blocks, min(next_pow2(default.num_blocks),
                                                                4096 // default.block_e),
                                        default.num_warps)
    elif t * min(next_pow2(e), 1024) <= 262144 and e <= 1024:  # one launch, bigger re-count
        block_e = next_pow2(e)
        sub_t = max(1, min(512, 4096 // block_e))
        variants["one-launch"] = MapTiles(sub_t, 1, block_e, cdiv(t, sub_t), 1, 8, True,
                                          max(1, 16384 // block_e))
    for name, tiles in variants.items():
        ms = bench(lambda tiles=tiles: pt.build_row_id_map_triton(routing_map, tiles=tiles),
                   rep_ms)
        lines.append(f"| {shape.name} | row map {name} | {tiles} | | | {ms:.4f} |")
    return lines


def table(rows: list[Row], copy_gbps: float) -> str:
    head = ["shape", "op", "dir", "triton ms", "GB/s", "of copy", "graph ms", "graph of copy",
            "same-bytes copy ms (of graph ms)", "host us (cache / Triton path)", "torch ms",
            "speedup"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.cells(copy_gbps)) + " |" for r in rows]
    return "\n".join(lines)


def run(args) -> str:
    import triton
    from epoverlap.kernels import make_moe_ops
    ops = {"triton": make_moe_ops("triton"), "torch": make_moe_ops("torch")}
    copy_gbps = copy_bandwidth_gbps(args.rep_ms)
    header = (f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
              f"{triton.__version__} | copy bandwidth {copy_gbps:.0f} GB/s (read + written)")
    print(header, flush=True)
    rows: list[Row] = []
    for name in ([] if args.skip_table else args.shapes.split(",")):
        for step in (bench_router, bench_row_map, bench_permute, bench_unpermute,
                     bench_sort_chunks):
            new = step(SHAPES[name], ops, args.rep_ms)
            for row in new:
                row.same_copy_ms = same_bytes_copy_ms(row.nbytes, args.rep_ms)
            rows += new
            print("\n".join(table(new, copy_gbps).splitlines()[2:]), flush=True)
            torch.cuda.empty_cache()
    text = f"{header}\n\n{table(rows, copy_gbps)}\n"
    if args.sweep:
        sweep = ["| shape | kernel | BLOCK_H | num_warps | BLOCK_T | ms |",
                 "|---|---|---|---|---|---|"]
        for name in args.shapes.split(","):
            sweep += sweep_tiles(SHAPES[name], args.rep_ms, args.sweep_ops)
        text += "\nTile sweep (kernel only):\n\n" + "\n".join(sweep) + "\n"
    return text


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--shapes", default="dsv3,mixtral", help=f"from {sorted(SHAPES)}")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench time per measurement")
    parser.add_argument("--sweep", action="store_true", help="also time other row-kernel tiles")
    parser.add_argument("--sweep-ops", default=",".join(SWEEP_OPS),
                        help=f"comma list of the kernels to sweep, from {', '.join(SWEEP_OPS)}")
    parser.add_argument("--skip-table", action="store_true",
                        help="only the sweep (with --sweep): skip the per-op table")
    args = parser.parse_args(argv)
    args.sweep_ops = tuple(op for op in args.sweep_ops.split(",") if op)
    bad_ops = set(args.sweep_ops) - set(SWEEP_OPS)
    if bad_ops:
        parser.error(f"--sweep-ops: unknown {sorted(bad_ops)}; allowed {', '.join(SWEEP_OPS)}")
    if args.skip_table and not args.sweep:
        parser.error("--skip-table: only with --sweep (there would be nothing to run)")
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"--shapes {args.shapes!r}: unknown {sorted(unknown)}; "
                     f"allowed {sorted(SHAPES)}")
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here, nothing to benchmark (run it on a GPU "
              "machine; the kernels' CPU tests are `python -m pytest tests/kernels`)")
        return 0
    text = run(args)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
