"""GPU tests of the Triton kernels (compiled, not interpreted): both benchmark shapes and a few
odd ones, every dtype, forward and backward against the torch reference, determinism, no host
sync (torch.cuda.set_sync_debug_mode("error")), CUDA-graph capture, the num_out_tokens and
split-size bounds (kernel-level sentinel check, and the in-kernel device asserts in a
subprocess), offsets past 2^31.

Run on a GPU machine: python -m pytest tests/kernels -m gpu -q
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels import make_moe_ops
from epoverlap.kernels.permutation_triton import _launch_permute, build_row_id_map_triton

from kernel_test_utils import (INTERPRETED, assert_bits_equal, assert_same_run,
                               close_tolerance, distinct_logits, generator, grouped_logits,
                               random_like_rows, random_probs, random_routing_map,
                               sync_is_an_error)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET is set: kernels are not compiled"),
]

# name: (T, H, E, K, router settings)
SHAPES = {
    "dsv3": (8192, 7168, 256, 8, dict(score_function="sigmoid", num_groups=8, group_topk=4,
                                      scaling_factor=2.5, bias=True)),
    "mixtral": (8192, 4096, 8, 2, dict(score_function="softmax")),
    "e128_h2048": (4096, 2048, 128, 8, dict(score_function="softmax", use_pre_softmax=True)),
    "odd": (1000, 1000, 12, 3, dict(score_function="sigmoid")),  # H not a multiple of 16
}
GRID = [("dsv3", torch.bfloat16), ("mixtral", torch.bfloat16), ("mixtral", torch.float16),
        ("e128_h2048", torch.bfloat16), ("e128_h2048", torch.float32), ("odd", torch.bfloat16),
        ("odd", torch.float16), ("odd", torch.float32)]
DEVICE = "cuda"


def _router_inputs(name, dtype):
    num_tokens, _, num_experts, _, settings = SHAPES[name]
    settings = dict(settings)
    if settings.pop("bias", False):
        # constant per group, steps of 2 > any sigmoid gap: biased scores never near-tie, so
        # an ulp of difference between torch's and Triton's sigmoid cannot flip a choice
        group = torch.arange(num_experts) // (num_experts // settings["num_groups"])
        settings["expert_bias"] = (2.0 * (group % 3 - 1)).float().to(DEVICE)
    if settings.get("num_groups"):
        logits_TE = grouped_logits(num_tokens, num_experts, settings["num_groups"], dtype, 0,
                                   DEVICE)
    else:
        logits_TE = distinct_logits(num_tokens, num_experts, dtype, 0, DEVICE)
    return logits_TE, settings


def _route(ops, logits_TE, topk, settings):
    logits_TE = logits_TE.detach().clone().requires_grad_()
    probs_TE, map_TE, counts_E = ops.router_topk_with_counts(logits_TE, topk, **settings)
    grad_TE = torch.randn(probs_TE.shape, generator=generator(3)).to(probs_TE)
    (probs_TE.float() * grad_TE.float()).sum().backward()
    return probs_TE.detach(), map_TE, counts_E, logits_TE.grad


@pytest.mark.parametrize("name,dtype", GRID)
def test_router(name, dtype):
    logits_TE, settings = _router_inputs(name, dtype)
    topk = SHAPES[name][3]
    ref = _route(make_moe_ops("torch"), logits_TE, topk, settings)
    out = _route(make_moe_ops("triton"), logits_TE, topk, settings)
    assert_bits_equal(out[1], ref[1], "routing map")
    assert_bits_equal(out[2], ref[2], "tokens per expert")
    tol = close_tolerance(dtype, interpreted=False)
    torch.testing.assert_close(out[0], ref[0], **tol)  # summation order, exp implementation
    torch.testing.assert_close(out[3], ref[3], rtol=tol["rtol"] * 4, atol=tol["atol"] * 4)


def _dispatch_inputs(name, dtype, seed=0):
    num_tokens, hidden, num_experts, topk, _ = SHAPES[name]
    routing_map_TE = random_routing_map(num_tokens, num_experts, topk, seed, num_padding=3,
                                        empty_experts=(1,), device=DEVICE)
    tokens_TH = random_like_rows(num_tokens, hidden, dtype, seed + 1, DEVICE)
    probs_TE = random_probs(routing_map_TE, dtype, seed + 2)
    return tokens_TH, routing_map_TE, probs_TE, num_tokens * topk


def _permute_run(ops, tokens_TH, routing_map_TE, probs_TE, num_out):
    x_TH = tokens_TH.clone().requires_grad_()
    p_TE = probs_TE.clone().requires_grad_()
    permuted_NH, permuted_N, row_id_map_TE = ops.permute(x_TH, routing_map_TE, p_TE,
                                                         num_out_tokens=num_out)
    gen = generator(4)
    grad_NH = torch.randn(permuted_NH.shape, generator=gen).to(permuted_NH)
    grad_N = torch.randn(permuted_N.shape, generator=gen).to(permuted_N)
    torch.autograd.backward([permuted_NH, permuted_N], [grad_NH, grad_N])
    return permuted_NH.detach(), permuted_N.detach(), row_id_map_TE, x_TH.grad, p_TE.grad


@pytest.mark.parametrize("name,dtype", GRID)
def test_permute_bit_exact(name, dtype):
    inputs = _dispatch_inputs(name, dtype)
    ref = _permute_run(make_moe_ops("torch"), *inputs)
    out = _permute_run(make_moe_ops("triton"), *inputs)
    names = ("rows", "probs", "row map", "grad x", "grad probs")
    for got, want, what in zip(out, ref, names, strict=True):
        assert_bits_equal(got, want, what)  # copies, and fp32 sums added in the same order


def _unpermute_run(ops, rows_NH, row_id_map_TE, merge_TE):
    r_NH = rows_NH.clone().requires_grad_()
    m_TE = merge_TE.clone().requires_grad_()
    out_TH = ops.unpermute(r_NH, row_id_map_TE, probs=m_TE)
    grad_TH = torch.randn(out_TH.shape, generator=generator(5)).to(out_TH)
    out_TH.backward(grad_TH)
    return out_TH.detach(), r_NH.grad, m_TE.grad


@pytest.mark.parametrize("name,dtype", GRID)
def test_unpermute(name, dtype):
    tokens_TH, routing_map_TE, probs_TE, num_out = _dispatch_inputs(name, dtype)
    rows_NH, _, row_id_map_TE = make_moe_ops("torch").permute(tokens_TH, routing_map_TE,
                                                             num_out_tokens=num_out)
    ref = _unpermute_run(make_moe_ops("torch"), rows_NH, row_id_map_TE, probs_TE)
    out = _unpermute_run(make_moe_ops("triton"), rows_NH, row_id_map_TE, probs_TE)
    tol = close_tolerance(dtype, interpreted=False)
    torch.testing.assert_close(out[0], ref[0], **tol)  # the multiply-add may be fused
    assert_bits_equal(out[1], ref[1], "grad rows")     # grad_out x prob, one rounding
    scale = max(1.0, float(ref[2].abs().max()))          # H-long dots, other order
    torch.testing.assert_close(out[2], ref[2], rtol=tol["rtol"] * 4, atol=1e-5 * scale)


def _chunk_inputs(name, dtype):
    _, hidden, num_experts, topk, _ = SHAPES[name]
    num_rows = SHAPES[name][0] * topk
    ranks = 8
    local = max(1, num_experts // ranks)
    counts = torch.randint(0, 2 * num_rows // (ranks * local), (ranks * local,),
                           generator=generator(6))
    counts = (counts * num_rows // max(int(counts.sum()), 1)).clamp(min=0)
    order = torch.randperm(ranks * local, generator=generator(11))
    rows_NH = random_like_rows(num_rows, hidden, dtype, 8, DEVICE)
    probs_N = torch.rand(num_rows, generator=generator(9)).to(dtype).to(DEVICE)
    return rows_NH, counts.to(DEVICE), order.to(DEVICE), probs_N


def _sort_run(ops, rows_NH, counts_C, order_C, probs_N):
    r_NH, p_N = rows_NH.clone().requires_grad_(), probs_N.clone().requires_grad_()
    out_NH, out_N = ops.sort_chunks_by_idxs(r_NH, counts_C, order_C, p_N)
    gen = generator(10)
    grads = [torch.randn(out_NH.shape, generator=gen).to(out_NH),
             torch.randn(out_N.shape, generator=gen).to(out_N)]
    torch.autograd.backward([out_NH, out_N], grads)
    return out_NH.detach(), out_N.detach(), r_NH.grad, p_N.grad


@pytest.mark.parametrize("name,dtype", GRID)
def test_sort_chunks_bit_exact(name, dtype):
    inputs = _chunk_inputs(name, dtype)
    ref = _sort_run(make_moe_ops("torch"), *inputs)
    out = _sort_run(make_moe_ops("triton"), *inputs)
    for got, want, what in zip(out, ref, ("rows", "probs", "grad rows", "grad probs"), strict=True):
        assert_bits_equal(got, want, what)


def _all_ops(ops, name, dtype):
    logits_TE, settings = _router_inputs(name, dtype)
    topk = SHAPES[name][3]
    return (_route(ops, logits_TE, topk, settings),
            _permute_run(ops, *_dispatch_inputs(name, dtype)),
            _sort_run(ops, *_chunk_inputs(name, dtype)))


@pytest.mark.parametrize("name", ["dsv3", "mixtral"])
def test_deterministic(name):
    ops = make_moe_ops("triton")
    first = _all_ops(ops, name, torch.bfloat16)
    tokens_TH, routing_map_TE, probs_TE, num_out = _dispatch_inputs(name, torch.bfloat16)
    rows_NH, _, row_id_map_TE = ops.permute(tokens_TH, routing_map_TE, num_out_tokens=num_out)
    unpermuted = [_unpermute_run(ops, rows_NH, row_id_map_TE, probs_TE) for _ in range(2)]
    assert_same_run(first, _all_ops(ops, name, torch.bfloat16), "router/permute/sort")
    assert_same_run(unpermuted[0], unpermuted[1], "unpermute")


def _pipeline(ops, logits_TE, tokens_TH, settings, topk, order_C):
    """Router -> permute -> chunk sort -> unpermute, forward and backward, num_out given."""
    probs_TE, map_TE, counts_E = ops.router_topk_with_counts(logits_TE, topk, **settings)
    permuted_NH, permuted_N, row_id_map_TE = ops.permute(
        tokens_TH, map_TE, probs_TE, num_out_tokens=tokens_TH.shape[0] * topk)
    sorted_NH, sorted_N = ops.sort_chunks_by_idxs(permuted_NH, counts_E, order_C, permuted_N)
    out_TH = ops.unpermute(sorted_NH * sorted_N[:, None], row_id_map_TE, probs=probs_TE)
    out_TH.float().square().sum().backward()
    return out_TH, map_TE, counts_E


@pytest.mark.parametrize("name", ["dsv3", "mixtral"])
def test_no_host_sync_and_static_shapes(name):
    ops = make_moe_ops("triton")
    num_tokens, hidden, num_experts, topk, _ = SHAPES[name]
    logits_TE, settings = _router_inputs(name, torch.bfloat16)
    logits_TE.requires_grad_()
    tokens_TH = random_like_rows(num_tokens, hidden, torch.bfloat16, 1, DEVICE).requires_grad_()
    order_C = torch.randperm(num_experts, generator=generator(2)).to(DEVICE)
    _pipeline(ops, logits_TE, tokens_TH, settings, topk, order_C)  # compile outside the guard
    torch.cuda.synchronize()
    with sync_is_an_error():
        out_TH, map_TE, counts_E = _pipeline(ops, logits_TE, tokens_TH, settings, topk, order_C)
    torch.cuda.synchronize()
    assert out_TH.shape == (num_tokens, hidden) and counts_E.shape == (num_experts,)
    assert int(map_TE.sum()) == num_tokens * topk


def _elementwise_run(ops, rows, hidden, seed=7):
    """RMSNorm, rotary and SwiGLU forward and backward (outputs and input grads)."""
    gen = generator(seed)
    x_TH = torch.randn(rows, hidden, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    w_H = torch.rand(hidden, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    q_BNSD = torch.randn(2, 4, rows // 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    q_BNSD.requires_grad_()
    angles_SD2 = torch.rand(rows // 8, 32, generator=gen).to(DEVICE) * 6.0
    h_M2F = torch.randn(rows, 2 * hidden, generator=gen).to(DEVICE, torch.bfloat16)
    h_M2F.requires_grad_()
    probs_M = torch.rand(rows, generator=gen).to(DEVICE).requires_grad_()
    outs = (ops.rms_norm(x_TH, w_H, 1e-6), ops.rotary(q_BNSD, angles_SD2.cos(), angles_SD2.sin()),
            ops.swiglu(h_M2F, probs_M))
    torch.autograd.backward([out.float().square().sum() for out in outs])
    return [out.detach() for out in outs] + [x_TH.grad, w_H.grad, q_BNSD.grad, h_M2F.grad,
                                             probs_M.grad]


def _every_op(ops, name):
    tokens_TH, routing_map_TE, probs_TE, num_out = _dispatch_inputs(name, torch.bfloat16)
    rows_NH, _, row_id_map_TE = ops.permute(tokens_TH, routing_map_TE, num_out_tokens=num_out)
    return (_all_ops(ops, name, torch.bfloat16),
            _unpermute_run(ops, rows_NH, row_id_map_TE, probs_TE),
            _elementwise_run(ops, 1024, SHAPES[name][1] // 8 * 8))


@pytest.mark.parametrize("name", ["dsv3", "odd"])
def test_launch_cache_is_bitwise_tritons_path(name):
    """Every op through the launch cache (after a first call filled it) gives the bits of the
    same ops through Triton's own `JITFunction.run`, and the cache served the second run."""
    from epoverlap.kernels import launch_cache_stats, set_launch_cache

    ops = make_moe_ops("triton")
    _every_op(ops, name)  # compiles and fills the caches
    before = launch_cache_stats()
    cached = _every_op(ops, name)
    after = launch_cache_stats()
    set_launch_cache(False)
    try:
        uncached = _every_op(ops, name)
        assert launch_cache_stats() == after, "a disabled cache served or looked up a launch"
    finally:
        set_launch_cache(True)
    # the kernels the ops launched (looked up in the cache: served or missed); the other
    # kernels loaded in this process (the loss's, the aux loss's) are not the ops'
    launched = [kernel for kernel in after if after[kernel] != before.get(kernel, (0, 0))]
    unserved = [kernel for kernel in launched
                if after[kernel][0] == before.get(kernel, (0, 0))[0]]
    # every kernel the ops launch was served from the cache on the second run (the map build
    # runs one of its two variants per shape, so one of those may miss once)
    assert len(launched) >= 5, (before, after)
    assert len(unserved) <= 2 and all("map" in kernel for kernel in unserved), (before, after)
    assert_same_run(cached, uncached, f"{name}: launch cache vs Triton's path")


def test_cuda_graph_capture_and_replay():
    """The forward pipeline captured in a CUDA graph replays with new inputs = eager."""
    ops = make_moe_ops("triton")
    num_tokens, hidden, num_experts, topk, settings = 2048, 4096, 64, 6, {}
    order_C = torch.randperm(num_experts, generator=generator(2)).to(DEVICE)

    def forward(logits_TE, tokens_TH):
        probs_TE, map_TE, counts_E = ops.router_topk_with_counts(logits_TE, topk, **settings)
        permuted_NH, permuted_N, row_id_map_TE = ops.permute(tokens_TH, map_TE, probs_TE,
                                                             num_out_tokens=num_tokens * topk)
        sorted_NH, sorted_N = ops.sort_chunks_by_idxs(permuted_NH, counts_E, order_C, permuted_N)
        return ops.unpermute(sorted_NH, row_id_map_TE, probs=probs_TE)

    static_logits = distinct_logits(num_tokens, num_experts, torch.float32, 0, DEVICE)
    static_tokens = random_like_rows(num_tokens, hidden, torch.bfloat16, 1, DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(static_logits, static_tokens)  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = forward(static_logits, static_tokens)
    static_logits.copy_(distinct_logits(num_tokens, num_experts, torch.float32, 5, DEVICE))
    static_tokens.copy_(random_like_rows(num_tokens, hidden, torch.bfloat16, 6, DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert_bits_equal(static_out, forward(static_logits, static_tokens), "graph replay")
    del graph


def test_permute_kernel_never_writes_past_n():
    tokens_TH, routing_map_TE, probs_TE, num_out = _dispatch_inputs("mixtral", torch.bfloat16)
    row_id_map_TE, _, total_1 = build_row_id_map_triton(routing_map_TE)
    limit = int(routing_map_TE.sum()) - 1000
    guard_NH = torch.full((num_out + 64, tokens_TH.shape[1]), 7.0, dtype=torch.bfloat16,
                          device=DEVICE)
    guard_N = torch.full((num_out + 64,), 7.0, dtype=torch.bfloat16, device=DEVICE)
    _launch_permute(tokens_TH, row_id_map_TE, total_1, limit, probs_TE,
                    out_NH=guard_NH[:limit], out_probs_N=guard_N[:limit])
    torch.cuda.synchronize()
    assert bool((guard_NH[limit:] == 7.0).all()) and bool((guard_N[limit:] == 7.0).all())
    ref_NH = make_moe_ops("torch").permute(tokens_TH, routing_map_TE, num_out_tokens=num_out)[0]
    assert_bits_equal(guard_NH[:limit], ref_NH[:limit], "rows below N")


_OVERFLOW_SCRIPT = """
import torch
from epoverlap.kernels import make_moe_ops
ops = make_moe_ops("triton")
routing_map = torch.zeros(64, 8, dtype=torch.bool, device="cuda")
routing_map[:, :2] = True
tokens = torch.randn(64, 256, device="cuda")
ops.permute(tokens, routing_map, num_out_tokens=100)  # routes 128 rows
torch.cuda.synchronize()
print("NO ERROR")
"""


_OVERFLOW_SORT_SCRIPT = """
import torch
from epoverlap.kernels import make_moe_ops
ops = make_moe_ops("triton")
rows = torch.randn(10, 256, device="cuda")
ops.sort_chunks_by_idxs(rows, torch.tensor([3, 4, 5], device="cuda"),
                        torch.tensor([2, 0, 1], device="cuda"))  # splits sum to 12 > 10 rows
torch.cuda.synchronize()
print("NO ERROR")
"""


@pytest.mark.parametrize("script,what", [
    (_OVERFLOW_SCRIPT, "num_out_tokens"),       # asserted in the row-id map kernel
    (_OVERFLOW_SORT_SCRIPT, "split_sizes"),     # asserted in the chunk-map kernel
])
def test_out_of_bounds_is_a_device_assert(script, what):
    """The bound checks are Triton device asserts inside the kernels that compute the counts
    (no extra launch). A device-side assert poisons the CUDA context: own process."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEBUG")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, env=env, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode != 0 and "NO ERROR" not in proc.stdout
    output = proc.stderr + proc.stdout
    assert "assert" in output.lower(), output[-2000:]
    if "Assertion" in output:  # the device printed the kernel's message: it names the bound
        assert what in output, output[-2000:]


def test_offsets_past_int32():
    """N * H > 2^31 elements: row offsets must be 64-bit (4.6 GB of bf16 rows)."""
    ops = make_moe_ops("triton")
    num_tokens, topk, num_experts, hidden = 4096, 8, 16, 69632
    routing_map_TE = random_routing_map(num_tokens, num_experts, topk, 0, device=DEVICE)
    tokens_TH = random_like_rows(num_tokens, hidden, torch.bfloat16, 1, DEVICE)
    permuted_NH, _, row_id_map_TE = ops.permute(tokens_TH, routing_map_TE,
                                                num_out_tokens=num_tokens * topk)
    assert permuted_NH.numel() > 2**31
    last_rows = row_id_map_TE[:, -1]
    routed = last_rows >= 0
    assert_bits_equal(permuted_NH[last_rows[routed].long()], tokens_TH[routed], "last expert")
    back_TH = ops.unpermute(permuted_NH, row_id_map_TE)
    torch.testing.assert_close(back_TH, tokens_TH * topk, rtol=2 ** -8, atol=0)
    counts_C = routing_map_TE.sum(0)
    sorted_NH, _ = ops.sort_chunks_by_idxs(permuted_NH, counts_C,
                                           torch.arange(num_experts - 1, -1, -1, device=DEVICE))
    tail = int(counts_C[-1])
    assert_bits_equal(sorted_NH[:tail], permuted_NH[-tail:], "last chunk moved first")
