"""Backend selection, graph safety (no host reads, static shapes) of the Triton ops, and an
offline sm_90 compile of every kernel."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

import epoverlap.kernels
from epoverlap.kernels import make_moe_ops, triton_unavailable_reason, triton_utils

from kernel_test_utils import (INTERPRETED, assert_same_run, distinct_logits, forbid_host_reads,
                               generator, random_like_rows)

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, env_update: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_update)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def test_backends_share_the_interface():
    torch_ops = make_moe_ops("torch")
    assert torch_ops.backend == "torch"
    with pytest.raises(ValueError, match="kernel backend 'cuda'"):
        make_moe_ops("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_triton_unavailable_without_interpreter():
    code = ("import epoverlap.kernels as k; print(k.triton_unavailable_reason())\n"
            "try:\n    k.make_moe_ops('triton')\nexcept ValueError as e:\n    print('VE', e)")
    out = _python(code, {}).stdout
    assert "no CUDA device and TRITON_INTERPRET is not set: use --kernel-backend torch" in out
    assert "VE kernel backend 'triton': no CUDA device" in out
    assert _python(code, {"TRITON_INTERPRET": "1"}).stdout.startswith("None")


def _all_ops(ops, device, seed=0):
    """Every op forward and backward, num_out_tokens given. -> outputs and grads."""
    num_tokens, num_experts, topk, hidden = 12, 6, 2, 40
    logits_TE = distinct_logits(num_tokens, num_experts, torch.float32, seed, device)
    logits_TE.requires_grad_()
    probs_TE, routing_map_TE, counts_E = ops.router_topk_with_counts(
        logits_TE, topk, score_function="sigmoid", expert_bias=torch.zeros(num_experts,
                                                                            device=device))
    tokens_TH = random_like_rows(num_tokens, hidden, torch.float32, seed, device)
    tokens_TH.requires_grad_()
    permuted_NH, permuted_probs_N, row_id_map_TE = ops.permute(
        tokens_TH, routing_map_TE, probs_TE, num_out_tokens=num_tokens * topk)
    sorted_NH, sorted_probs_N = ops.sort_chunks_by_idxs(  # chunk = expert, pairs swapped
        permuted_NH, counts_E, torch.tensor([1, 0, 3, 2, 5, 4], device=device), permuted_probs_N)
    out_TH = ops.unpermute(sorted_NH * sorted_probs_N[:, None], row_id_map_TE,
                           tokens_TH.shape, probs=probs_TE)
    weight_TH = torch.randn(out_TH.shape, generator=generator(seed + 1)).to(out_TH)
    (out_TH * weight_TH).sum().backward()
    return [probs_TE, routing_map_TE, counts_E, permuted_NH, row_id_map_TE, sorted_NH, out_TH,
            logits_TE.grad, tokens_TH.grad]


def test_triton_ops_do_not_read_device_data_on_the_host(triton_device, monkeypatch):
    """No .item()/.tolist()/int()/bool()/nonzero/masked_select anywhere in forward or backward
    (the CPU stand-in for torch.cuda.set_sync_debug_mode('error'), which test_gpu.py uses), and
    static output shapes. The only host read, the CPU num_out_tokens check, is swapped for its
    CUDA form (a device assert)."""
    ops = make_moe_ops("triton")

    def device_check(count_1, limit, message):
        torch._assert_async(count_1[0] <= limit, message)
    monkeypatch.setattr(triton_utils, "check_count_fits", device_check)
    with forbid_host_reads() as violations:
        outputs = _all_ops(ops, triton_device)
    assert violations == []
    shapes = [tuple(t.shape) for t in outputs]
    assert shapes == [(12, 6), (12, 6), (6,), (24, 40), (12, 6), (24, 40), (12, 40), (12, 6),
                      (12, 40)]


# aten ops that launch no kernel on CUDA (allocation, views, autograd bookkeeping)
_NO_KERNEL_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view",
                  "detach", "alias", "as_strided", "t", "transpose", "reshape", "select",
                  "slice", "unsqueeze", "squeeze", "expand", "lift_fresh"}


def _launches(fn) -> tuple[list, list]:
    """(Triton kernels launched, torch ops that launch a kernel) while `fn` runs (interpreter)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    kernels, torch_ops = [], []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _NO_KERNEL_OPS:
                torch_ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        kernels.append(self.fn.__name__)
        with _disable_current_modes():  # the interpreter's own host copies are not launches
            return original(self, *args, **kwargs)
    InterpretedFunction.run = run
    try:
        with Recorder():
            fn()
    finally:
        InterpretedFunction.run = original
    return kernels, torch_ops


@pytest.mark.skipif(not INTERPRETED, reason="counts interpreted launches")
def test_launch_counts(triton_device, monkeypatch):
    """Launches per op on the CUDA path (bound checks inside the kernels, num_out_tokens given):
    each one costs ~20 us of host time in a launch-bound step."""
    monkeypatch.setattr(triton_utils, "device_asserts", lambda tensor: True)
    ops = make_moe_ops("triton")
    num_tokens, num_experts, topk, hidden = 12, 6, 2, 40
    logits_TE = distinct_logits(num_tokens, num_experts, torch.float32, 0, triton_device)
    logits_TE.requires_grad_()
    route = lambda: ops.router_topk_with_counts(logits_TE, topk)  # noqa: E731
    probs_TE, routing_map_TE, counts_E = route()
    tokens_TH = random_like_rows(num_tokens, hidden, torch.float32, 1, triton_device)
    tokens_TH.requires_grad_()
    num_out = num_tokens * topk
    permute = lambda: ops.permute(tokens_TH, routing_map_TE, probs_TE,  # noqa: E731
                                  num_out_tokens=num_out)
    permuted_NH, permuted_N, row_id_map_TE = permute()
    order_C = torch.tensor([1, 0, 3, 2, 5, 4], device=triton_device)
    sort = lambda: ops.sort_chunks_by_idxs(permuted_NH, counts_E, order_C,  # noqa: E731
                                           permuted_N)
    sorted_NH, sorted_N = sort()
    rows_NH = sorted_NH.detach().requires_grad_()
    merge_TE = probs_TE.detach().requires_grad_()
    unpermute = lambda: ops.unpermute(rows_NH, row_id_map_TE, probs=merge_TE)  # noqa: E731
    out_TH = unpermute()
    plain_TH = ops.unpermute(rows_NH, row_id_map_TE)
    grad_TH = torch.ones_like(out_TH)

    def grad(outputs, inputs):
        grads = [torch.ones_like(o) for o in outputs]
        return lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True)

    expected = {
        "router fwd": (route, ["_router_fwd_kernel"], ["zeros"]),  # counts: atomics target
        "router bwd": (grad([probs_TE], [logits_TE]), ["_router_bwd_kernel"], []),
        "permute fwd": (permute, ["_map_small_kernel", "_permute_kernel"], []),
        "permute bwd": (grad([permuted_NH, permuted_N], [tokens_TH, probs_TE]),
                        ["_unpermute_kernel"], []),
        "sort fwd": (sort, ["_chunk_src_rows_kernel", "_move_rows_kernel"], []),
        "sort bwd": (grad([sorted_NH, sorted_N], [permuted_NH, permuted_N]),
                     ["_move_rows_kernel"], []),
        "unpermute fwd": (unpermute, ["_unpermute_kernel"], []),
        "unpermute bwd": (lambda: torch.autograd.grad(out_TH, [rows_NH, merge_TE], grad_TH,
                                                      retain_graph=True),
                          ["_unpermute_bwd_kernel"], []),
        "unpermute bwd, no probs": (lambda: torch.autograd.grad(plain_TH, [rows_NH], grad_TH,
                                                                retain_graph=True),
                                    ["_permute_kernel"], []),
    }
    for name, (fn, kernels, torch_ops) in expected.items():
        assert _launches(fn) == (kernels, torch_ops), name
    big_map_TE = torch.zeros(4, 1030, dtype=torch.bool, device=triton_device)  # > 1024 experts
    big_map_TE[:, :2] = True
    big_TH = torch.zeros(4, 8, device=triton_device)
    assert _launches(lambda: ops.permute(big_TH, big_map_TE, num_out_tokens=8)) == (
        ["_map_count_kernel", "_map_write_kernel", "_permute_kernel"], [])


def test_host_read_guard_catches_reads():
    with forbid_host_reads() as violations:
        with pytest.raises(AssertionError, match="host read"):
            torch.ones(3).sum().item()
    assert violations == ["item"]
    assert torch.ones(2).sum().item() == 2.0  # restored


def test_backends_agree(triton_device):
    """Switching the backend by config alone: same outputs and grads (to fp32 rounding)."""
    reference = _all_ops(make_moe_ops("torch"), triton_device)
    triton = _all_ops(make_moe_ops("triton"), triton_device)
    for got, want in zip(triton, reference, strict=True):
        if got.dtype in (torch.bool, torch.int32, torch.int64):
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_ops_deterministic(triton_device):
    ops = make_moe_ops("triton")
    assert_same_run(_all_ops(ops, triton_device), _all_ops(ops, triton_device), "ops")


def test_triton_ops_exports():
    ops = make_moe_ops("triton") if triton_unavailable_reason() is None else None
    if ops is None:
        pytest.skip(triton_unavailable_reason())
    from epoverlap.kernels import triton_ops
    # the routing ops (other Triton ops may be exported beside them)
    assert set(triton_ops.__all__) >= {"router_topk", "router_topk_with_counts", "permute",
                                       "unpermute", "sort_chunks_by_idxs"}
    assert epoverlap.kernels.MoEOps.__dataclass_fields__.keys() >= {"permute", "unpermute"}


@pytest.mark.skipif(not INTERPRETED, reason="a GPU compiles the kernels for real")
def test_every_kernel_compiles_for_sm90():
    """Each kernel, at the benchmark shapes' launch configs, compiles to sm_90 (ptxas): no
    spills, and the bf16 row copies use 16-byte vector loads and stores."""
    proc = subprocess.run([sys.executable, str(REPO / "tests/kernels/sm90_compile.py"),
                           "--json"], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {r["kernel"] for r in records}
    assert names == {"_router_fwd_kernel", "_router_bwd_kernel", "_map_small_kernel",
                     "_map_count_kernel", "_map_write_kernel", "_permute_kernel",
                     "_unpermute_kernel", "_unpermute_bwd_kernel", "_chunk_src_rows_kernel",
                     "_move_rows_kernel", "_gather_rows_kernel", "_zero_rows_kernel"}
    assert all(r["local_bytes"] == 0 for r in records), [r for r in records if r["local_bytes"]]
    benchmark_shapes = [r for r in records if r["shape"].startswith(("H7168", "H4096"))]
    # (Triton 3.9 gives the H=1000 scatter copy a 96-byte stack frame; 3.6 none)
    assert all(r["stack_bytes"] == 0 for r in benchmark_shapes), \
        [r for r in benchmark_shapes if r["stack_bytes"]]
    copies = [r for r in records if r["kernel"] in ("_permute_kernel", "_unpermute_kernel",
                                                    "_unpermute_bwd_kernel", "_move_rows_kernel")
              and r["shape"].startswith(("H7168", "H4096")) and r["shape"].endswith("bfloat16")]
    assert len(copies) >= 8 and all(r["v4_loads"] and r["v4_stores"] for r in copies), copies
    row_ops = [r for r in records if r["kernel"] in ("_gather_rows_kernel", "_zero_rows_kernel")
               and r["shape"].startswith(("H7168", "H4096")) and "H" in r["signature"]]
    assert len(row_ops) >= 6 and all(r["v4_stores"] for r in row_ops), row_ops  # rows, not probs
    reads = [r for r in row_ops if r["kernel"] == "_gather_rows_kernel"
             or r["constants"]["(7,)"] is True]  # the zeroing reads only as a copy (COPY)
    assert len(reads) >= 4 and all(r["v4_loads"] for r in reads), reads


def _variant_counts(tokens: int, received: list[int]) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "tests/kernels/specialization_keys.py"),
                           str(tokens), *map(str, received)], capture_output=True, text=True,
                          cwd=REPO / "tests/kernels", timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_changing_row_counts_never_needs_a_new_kernel_variant():
    """Dropless routing changes the rows an expert rank receives every step. Every kernel must
    launch the same compiled variants for 1, 16 (divisible), 17, 48 ... rows as for one count:
    a new variant is a compile stall of a large fraction of a second mid-run (issue 22)."""
    one = _variant_counts(64, [64])
    many = _variant_counts(64, [1, 16, 17, 48, 64, 100, 333, 1024])
    assert {"_swiglu_fwd_kernel", "_swiglu_bwd_kernel", "_move_rows_kernel",
            "_gather_rows_kernel", "_zero_rows_kernel",
            "_chunk_src_rows_kernel", "_permute_kernel", "_unpermute_kernel",
            "_router_fwd_kernel", "_rms_norm_fwd_kernel"} <= set(one)
    assert many == one
