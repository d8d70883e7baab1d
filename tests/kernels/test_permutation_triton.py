"""Triton row-id map, permute and unpermute against the torch reference: bit-exact copies, fp32
sums, grads, determinism, the num_out_tokens bound, empty experts, padding tokens, odd shapes.
Small T (the CPU interpreter pays per program and per op)."""

import pytest
import torch

from epoverlap_kernels.permutation import build_row_id_map, permute_torch, unpermute_torch
from epoverlap_kernels.permutation_triton import (_launch_permute, _launch_unpermute,
                                                  build_row_id_map_triton, permute_triton,
                                                  unpermute_triton)
from epoverlap_kernels.triton_utils import CopyConfig

from kernel_test_utils import (DTYPES, INTERPRETED, assert_bits_equal, assert_same_run,
                               close_tolerance, generator, random_like_rows, random_probs,
                               random_routing_map)

# (T, E, K, H, padding tokens, empty experts): non-power-of-two E and H, k = 1 and k >= 8
CASES = {
    "k2_e6_h40": (13, 6, 2, 40, 2, (3,)),
    "k1_e5_h33": (11, 5, 1, 33, 0, (0, 4)),
    "k8_e20_h24": (9, 20, 8, 24, 1, (7, 19)),
    "k3_e12_h300": (10, 12, 3, 300, 3, ()),
}


def _case(name, dtype, device, seed=0):
    num_tokens, num_experts, topk, hidden, padding, empty = CASES[name]
    routing_map_TE = random_routing_map(num_tokens, num_experts, topk, seed, num_padding=padding,
                                        empty_experts=empty, device=device)
    tokens_TH = random_like_rows(num_tokens, hidden, dtype, seed + 1, device)
    probs_TE = random_probs(routing_map_TE, dtype, seed + 2)
    return tokens_TH, routing_map_TE, probs_TE, num_tokens * topk


@pytest.mark.parametrize("num_tokens,num_experts,topk,padding", [
    (13, 6, 2, 2), (40, 1030, 5, 3),  # E above one BLOCK_E tile; several token blocks
    (700, 3, 1, 0), (5, 9, 9, 5),     # several token blocks; nothing routed at all
])
def test_row_id_map_matches_reference(triton_device, num_tokens, num_experts, topk, padding):
    routing_map_TE = random_routing_map(num_tokens, num_experts, topk, 4, num_padding=padding,
                                        device=triton_device)
    row_id_map_TE, counts_E, total_1 = build_row_id_map_triton(routing_map_TE)
    assert_bits_equal(row_id_map_TE, build_row_id_map(routing_map_TE), "row_id_map")
    assert_bits_equal(counts_E, routing_map_TE.sum(0), "tokens_per_expert")
    assert int(total_1[0]) == int(routing_map_TE.sum())


def test_row_id_map_all_on_one_expert(triton_device):
    routing_map_TE = torch.zeros(37, 7, dtype=torch.bool, device=triton_device)
    routing_map_TE[:, 4] = True
    row_id_map_TE, counts_E, _ = build_row_id_map_triton(routing_map_TE)
    assert row_id_map_TE[:, 4].tolist() == list(range(37))
    assert int((row_id_map_TE >= 0).sum()) == 37 and counts_E.tolist() == [0] * 4 + [37, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_permute_bit_exact(triton_device, case, dtype):
    tokens_TH, routing_map_TE, probs_TE, num_out = _case(case, dtype, triton_device)
    ref = permute_torch(tokens_TH, routing_map_TE, probs_TE, num_out_tokens=num_out)
    out = permute_triton(tokens_TH, routing_map_TE, probs_TE, num_out_tokens=num_out)
    for got, want, what in zip(out, ref, ("permuted", "permuted_probs", "row_id_map"), strict=True):
        assert_bits_equal(got, want, what)


def test_permute_rows_past_routed_count_are_zero(triton_device):
    tokens_TH, routing_map_TE, probs_TE, num_out = _case("k2_e6_h40", torch.float32,
                                                        triton_device)
    num_routed = int(routing_map_TE.sum())
    out = permute_triton(tokens_TH, routing_map_TE, probs_TE, num_out_tokens=num_out + 5)
    assert out[0].shape == (num_out + 5, 40) and out[1].shape == (num_out + 5,)
    assert not out[0][num_routed:].any() and not out[1][num_routed:].any()
    ref = permute_torch(tokens_TH, routing_map_TE, probs_TE, num_out_tokens=num_out + 5)
    assert_bits_equal(out[0], ref[0], "permuted")


def test_permute_without_num_out_tokens(triton_device):
    tokens_TH, routing_map_TE, _, _ = _case("k1_e5_h33", torch.bfloat16, triton_device)
    permuted_NH, probs_N, _ = permute_triton(tokens_TH, routing_map_TE)
    assert probs_N is None and permuted_NH.shape[0] == int(routing_map_TE.sum())
    assert_bits_equal(permuted_NH, permute_torch(tokens_TH, routing_map_TE)[0], "permuted")


@pytest.mark.skipif(not INTERPRETED, reason="CPU path: on CUDA this is a device assert "
                    "(tested in a subprocess by test_gpu.py)")
def test_permute_refuses_too_small_num_out_tokens(triton_device):
    tokens_TH, routing_map_TE, probs_TE, num_out = _case("k2_e6_h40", torch.float32,
                                                        triton_device)
    too_few = int(routing_map_TE.sum()) - 3
    with pytest.raises(ValueError, match=f"num_out_tokens={too_few}"):
        permute_triton(tokens_TH, routing_map_TE, probs_TE, num_out_tokens=too_few)


def test_permute_kernel_never_writes_past_n(triton_device):
    """The kernel alone (the host check bypassed): rows >= N are skipped, never written."""
    tokens_TH, routing_map_TE, probs_TE, num_out = _case("k3_e12_h300", torch.float32,
                                                        triton_device)
    row_id_map_TE, _, total_1 = build_row_id_map_triton(routing_map_TE)
    limit = int(routing_map_TE.sum()) - 5
    guard_NH = torch.full((num_out + 8, 300), 7.0, device=triton_device)
    probs_guard_N = torch.full((num_out + 8,), 7.0, device=triton_device)
    out_NH, out_probs_N = _launch_permute(tokens_TH, row_id_map_TE, total_1, limit, probs_TE,
                                          out_NH=guard_NH[:limit],
                                          out_probs_N=probs_guard_N[:limit])
    assert bool((guard_NH[limit:] == 7.0).all()) and bool((probs_guard_N[limit:] == 7.0).all())
    ref = permute_torch(tokens_TH, routing_map_TE, probs_TE, num_out_tokens=num_out)
    assert_bits_equal(out_NH, ref[0][:limit], "rows below N")
    assert_bits_equal(out_probs_N, ref[1][:limit], "probs below N")


def test_unpermute_ignores_rows_past_n(triton_device):
    tokens_TH, routing_map_TE, probs_TE, num_out = _case("k2_e6_h40", torch.float32,
                                                        triton_device)
    permuted_NH, _, row_id_map_TE = permute_torch(tokens_TH, routing_map_TE,
                                                  num_out_tokens=num_out)
    limit = num_out - 4
    clipped_TE = torch.where(row_id_map_TE < limit, row_id_map_TE, -1)
    out_TH = unpermute_triton(permuted_NH[:limit], row_id_map_TE, probs=probs_TE)
    want_TH = unpermute_torch(permuted_NH[:limit], clipped_TE, probs=probs_TE)
    if INTERPRETED:
        assert_bits_equal(out_TH, want_TH, "unpermute with rows past N")
    else:  # the multiply-add may be fused on the GPU
        torch.testing.assert_close(out_TH, want_TH, **close_tolerance(torch.float32,
                                                                      interpreted=False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("merge", [False, True])
def test_unpermute_matches_reference(triton_device, case, dtype, merge):
    tokens_TH, routing_map_TE, probs_TE, num_out = _case(case, dtype, triton_device)
    permuted_NH, _, row_id_map_TE = permute_torch(tokens_TH, routing_map_TE,
                                                  num_out_tokens=num_out)
    probs = probs_TE if merge else None
    out_TH = unpermute_triton(permuted_NH, row_id_map_TE, tokens_TH.shape, probs=probs)
    want_TH = unpermute_torch(permuted_NH, row_id_map_TE, tokens_TH.shape, probs=probs)
    if dtype == torch.bfloat16 or not INTERPRETED:
        # same fp32 sum in the same order; bf16: the interpreter's fp32->bf16 cast truncates;
        # GPU: the multiply-add may be fused (one rounding instead of two)
        torch.testing.assert_close(out_TH, want_TH, **close_tolerance(dtype,
                                                                      interpreted=INTERPRETED))
    else:
        assert_bits_equal(out_TH, want_TH, "unpermuted")


def _permute_unpermute_grads(permute, unpermute, tokens_TH, routing_map_TE, probs_TE, num_out):
    tokens_TH = tokens_TH.detach().clone().requires_grad_()
    probs_TE = probs_TE.detach().clone().requires_grad_()
    merge_TE = (probs_TE.detach() * 0.5 + 0.25).requires_grad_()
    permuted_NH, permuted_probs_N, row_id_map_TE = permute(tokens_TH, routing_map_TE, probs_TE,
                                                           num_out_tokens=num_out)
    rows_NH = permuted_NH * permuted_probs_N[:, None].to(permuted_NH.dtype)
    out_TH = unpermute(rows_NH, row_id_map_TE, probs=merge_TE)
    weight_TH = torch.randn(out_TH.shape, generator=generator(9)).to(out_TH)
    (out_TH.float() * weight_TH.float()).sum().backward()
    return out_TH.detach(), tokens_TH.grad, probs_TE.grad, merge_TE.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["k2_e6_h40", "k8_e20_h24", "k1_e5_h33"])
def test_grads_match_reference(triton_device, case, dtype):
    inputs = _case(case, dtype, triton_device)
    ref = _permute_unpermute_grads(permute_torch, unpermute_torch, *inputs)
    out = _permute_unpermute_grads(permute_triton, unpermute_triton, *inputs)
    names = ("out", "grad tokens", "grad probs", "grad merge")
    for got, want, what in zip(out, ref, names, strict=True):
        scale = max(1.0, float(want.abs().max()))
        if dtype == torch.float32:
            # probs grads are H-long fp32 dot products summed in another order
            tol = dict(rtol=1e-5, atol=1e-6 * scale)
        else:
            # bf16 chains: our rows differ from torch's by the interpreter's truncating cast
            # (1 ulp), then torch's bf16 mul-backward sums H such terms in bf16 for the probs
            tol = dict(rtol=2 ** -5, atol=2 ** -5 * scale)
        torch.testing.assert_close(got, want, **tol, msg=lambda m, what=what: f"{what}: {m}")


def test_grads_bit_exact_copies(triton_device):
    """Copies and fp32 sums in a fixed order: permute's grads equal the reference's bits."""
    tokens_TH, routing_map_TE, probs_TE, num_out = _case("k3_e12_h300", torch.float32,
                                                        triton_device)
    grads = []
    for permute in (permute_torch, permute_triton):
        x_TH = tokens_TH.clone().requires_grad_()
        p_TE = probs_TE.clone().requires_grad_()
        permuted_NH, permuted_probs_N, _ = permute(x_TH, routing_map_TE, p_TE, num_out)
        gen = generator(11)
        grad_NH = torch.randn(permuted_NH.shape, generator=gen).to(permuted_NH)
        grad_N = torch.randn(permuted_probs_N.shape, generator=gen).to(permuted_probs_N)
        torch.autograd.backward([permuted_NH, permuted_probs_N], [grad_NH, grad_N])
        grads.append((x_TH.grad, p_TE.grad))
    if INTERPRETED:
        assert_same_run(grads[1], grads[0], "permute grads vs reference")
    else:
        torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("block_h", [32, 128])
def test_hidden_split_across_programs(triton_device, block_h):
    """Hidden sizes that are not a multiple of the block: several programs per row."""
    tokens_TH, routing_map_TE, probs_TE, num_out = _case("k3_e12_h300", torch.float16,
                                                        triton_device)
    row_id_map_TE, _, total_1 = build_row_id_map_triton(routing_map_TE)
    config = CopyConfig(block_h, 1)
    out_NH, out_N = _launch_permute(tokens_TH, row_id_map_TE, total_1, num_out, probs_TE,
                                    config=config)
    ref = permute_torch(tokens_TH, routing_map_TE, probs_TE, num_out_tokens=num_out)
    assert_bits_equal(out_NH, ref[0], "permuted")
    back_TH, _ = _launch_unpermute(out_NH, row_id_map_TE, config=config)
    want_TH = unpermute_torch(ref[0], ref[2])
    torch.testing.assert_close(back_TH, want_TH, **close_tolerance(torch.float16,
                                                                   interpreted=INTERPRETED))


def test_deterministic(triton_device):
    inputs = _case("k8_e20_h24", torch.bfloat16, triton_device)
    first = _permute_unpermute_grads(permute_triton, unpermute_triton, *inputs)
    second = _permute_unpermute_grads(permute_triton, unpermute_triton, *inputs)
    assert_same_run(first, second, "permute/unpermute run")


def test_no_tokens(triton_device):
    tokens_TH = torch.zeros(0, 8, device=triton_device)
    routing_map_TE = torch.zeros(0, 4, dtype=torch.bool, device=triton_device)
    permuted_NH, _, row_id_map_TE = permute_triton(tokens_TH, routing_map_TE, num_out_tokens=3)
    assert permuted_NH.shape == (3, 8) and not permuted_NH.any()
    assert unpermute_triton(permuted_NH, row_id_map_TE).shape == (0, 8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="routing_map has 3 tokens"):
        permute_triton(torch.zeros(4, 8), torch.zeros(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="restore_shape"):
        unpermute_triton(torch.zeros(4, 8), torch.zeros(3, 2, dtype=torch.int32), (5, 8))
