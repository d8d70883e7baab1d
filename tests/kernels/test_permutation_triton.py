"""Triton row-id map, permute and unpermute against the torch reference: bit-exact copies, fp32
sums, grads, determinism, the num_out_tokens bound, empty experts, padding tokens, odd shapes.
Small T (the CPU interpreter pays per program and per op)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels import permutation_triton
from epoverlap.kernels.permutation import build_row_id_map, permute_torch, unpermute_torch
from epoverlap.kernels.permutation_triton import (_launch_permute, _launch_unpermute,
                                                  _launch_unpermute_bwd, build_row_id_map_triton,
                                                  permute_triton, unpermute_triton)
from epoverlap.kernels.triton_utils import CopyConfig, MapTiles, cdiv, map_tiles, next_pow2

from kernel_test_utils import (DTYPES, INTERPRETED, assert_bits_equal, assert_same_run,
                               close_tolerance, generator, random_like_rows, random_probs,
                               random_routing_map)

# (T, E, K, H, padding tokens, empty experts): non-power-of-two E and H, k = 1 and k >= 8
CASES = {
    "k2_e6_h40": (13, 6, 2, 40, 2, (3,)),
    "k1_e5_h33": (11, 5, 1, 33, 0, (0, 4)),
    "k8_e20_h24": (9, 20, 8, 24, 1, (7, 19)),
    "k3_e12_h300": (10, 12, 3, 300, 3, ()),
    "k5_e40_h24": (7, 40, 5, 24, 1, (2, 39)),  # > 32 experts: one token per permute program
}


def _case(name, dtype, device, seed=0):
    num_tokens, num_experts, topk, hidden, padding, empty = CASES[name]
    routing_map_TE = random_routing_map(num_tokens, num_experts, topk, seed, num_padding=padding,
                                        empty_experts=empty, device=device)
    tokens_TH = random_like_rows(num_tokens, hidden, dtype, seed + 1, device)
    probs_TE = random_probs(routing_map_TE, dtype, seed + 2)
    return tokens_TH, routing_map_TE, probs_TE, num_tokens * topk


@pytest.mark.parametrize("num_tokens,num_experts,topk,padding", [
    (13, 6, 2, 2), (40, 1030, 5, 3),  # one program; E above one BLOCK_E tile (two passes)
    (700, 3, 1, 0), (5, 9, 9, 5),     # one program, several rows; nothing routed at all
    (600, 256, 8, 7),                 # two passes: 38 token blocks, 3 prefix tiles
])
def test_row_id_map_matches_reference(triton_device, num_tokens, num_experts, topk, padding):
    routing_map_TE = random_routing_map(num_tokens, num_experts, topk, 4, num_padding=padding,
                                        device=triton_device)
    row_id_map_TE, counts_E, total_1 = build_row_id_map_triton(routing_map_TE)
    assert_bits_equal(row_id_map_TE, build_row_id_map(routing_map_TE), "row_id_map")
    assert_bits_equal(counts_E, routing_map_TE.sum(0), "tokens_per_expert")
    assert int(total_1[0]) == int(routing_map_TE.sum())


def _forced_tiles(num_tokens, sub_t, num_sub, block_e, block_b=1, count_t=1, single=False):
    return MapTiles(sub_t, num_sub, block_e, cdiv(num_tokens, sub_t * num_sub), block_b, 4,
                    single, count_t)


@pytest.mark.parametrize("tiles", [
    dict(sub_t=8, num_sub=2, block_e=16, block_b=4),  # 19 blocks, 5 prefix tiles
    dict(sub_t=16, num_sub=2, block_e=4, block_b=4),  # 3 expert blocks, 3 prefix tiles
    dict(sub_t=32, num_sub=3, block_e=16, count_t=64, single=True),  # 4 blocks, 5 count tiles
])
def test_row_id_map_every_tiling(triton_device, tiles):
    """Both map builds (one launch / two passes) at tilings the defaults do not pick here."""
    routing_map_TE = random_routing_map(300, 12, 3, 6, num_padding=4, empty_experts=(5,),
                                        device=triton_device)
    forced = _forced_tiles(300, **tiles)
    row_id_map_TE, counts_E, total_1 = build_row_id_map_triton(routing_map_TE, tiles=forced)
    assert_bits_equal(row_id_map_TE, build_row_id_map(routing_map_TE), "row_id_map")
    assert_bits_equal(counts_E, routing_map_TE.sum(0), "tokens_per_expert")
    assert int(total_1[0]) == int(routing_map_TE.sum())


def test_map_tiles_bounds():
    """One program only for small maps; the two-pass count matrix stays ~128 blocks."""
    mixtral, dsv3 = map_tiles(8192, 8), map_tiles(8192, 256)
    assert mixtral.single and mixtral.num_blocks == 16 and mixtral.count_t == 2048
    assert not dsv3.single and dsv3.num_blocks == 128 and dsv3.block_t == 64
    for num_tokens, num_experts in [(1, 1), (13, 6), (8192, 64), (65536, 256), (100, 3000)]:
        tiles = map_tiles(num_tokens, num_experts)
        assert tiles.block_e == min(next_pow2(num_experts), 1024)
        assert tiles.num_blocks == cdiv(num_tokens, tiles.block_t)
        if tiles.single:  # each program re-counts the whole map: keep it small
            assert num_experts <= tiles.block_e and num_tokens * tiles.block_e <= 65536
        else:
            assert tiles.num_blocks <= 256


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


@pytest.mark.parametrize("block_h,block_t", [(64, 1), (128, 4), (512, 2)])
def test_hidden_split_across_programs(triton_device, block_h, block_t):
    """Hidden sizes that are not a multiple of the block (several programs per row), and
    several tokens per program (the last program partly past T); rows past the routed count."""
    tokens_TH, routing_map_TE, probs_TE, num_out = _case("k3_e12_h300", torch.float16,
                                                        triton_device)
    num_out += 3  # rows past the routed count: zeroed by permute, zero grads by unpermute
    row_id_map_TE, _, total_1 = build_row_id_map_triton(routing_map_TE)
    config = CopyConfig(block_h, 1, block_t)
    out_NH, out_N = _launch_permute(tokens_TH, row_id_map_TE, total_1, num_out, probs_TE,
                                    config=config)
    ref = permute_torch(tokens_TH, routing_map_TE, probs_TE, num_out_tokens=num_out)
    assert_bits_equal(out_NH, ref[0], "permuted")
    assert_bits_equal(out_N, ref[1], "permuted probs")
    back_TH, _ = _launch_unpermute(out_NH, row_id_map_TE, config=config)
    want_TH = unpermute_torch(ref[0], ref[2])
    tol = close_tolerance(torch.float16, interpreted=INTERPRETED)
    torch.testing.assert_close(back_TH, want_TH, **tol)
    merge_TE = probs_TE * 0.5 + 0.25
    grad_TH = random_like_rows(tokens_TH.shape[0], 300, torch.float16, 12, triton_device)
    got = _launch_unpermute_bwd(grad_TH, ref[0], row_id_map_TE, merge_TE, config=config)
    rows_NH = ref[0].clone().requires_grad_()
    merge_ref_TE = merge_TE.clone().requires_grad_()
    unpermute_torch(rows_NH, ref[2], probs=merge_ref_TE).backward(grad_TH)
    assert_bits_equal(got[0], rows_NH.grad, "grad rows")  # grad_out x prob, one rounding
    torch.testing.assert_close(got[1], merge_ref_TE.grad, rtol=2 ** -8, atol=1e-3)


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


def test_unpermute_reads_the_routed_count_recorded_by_permute(triton_device, monkeypatch):
    """The map from permute_triton carries its routed count: the unpermute backward zeroes the
    rows past it without counting the map (no launch); after an in-place change of the map,
    or for a map built elsewhere, it counts (and matches the reference either way)."""
    tokens_TH, routing_map_TE, probs_TE, num_out = _case("k2_e6_h40", torch.float32,
                                                        triton_device)
    _, _, row_id_map_TE = permute_triton(tokens_TH, routing_map_TE, num_out_tokens=num_out + 4)
    counted = []
    original = permutation_triton._routed_count

    def spy(map_TE):
        counted.append(True)
        return original(map_TE)
    monkeypatch.setattr(permutation_triton, "_routed_count", spy)
    rows_NH = random_like_rows(num_out + 4, 40, torch.float32, 3, triton_device)
    grad_TH = random_like_rows(tokens_TH.shape[0], 40, torch.float32, 4, triton_device)
    grads = []
    for map_TE in (row_id_map_TE, build_row_id_map(routing_map_TE)):
        for merge in (None, probs_TE):
            r_NH = rows_NH.clone().requires_grad_()
            unpermute_triton(r_NH, map_TE, probs=merge).backward(grad_TH)
            ref_NH = rows_NH.clone().requires_grad_()
            unpermute_torch(ref_NH, map_TE, probs=merge).backward(grad_TH)
            assert_bits_equal(r_NH.grad, ref_NH.grad, "grad rows")
            assert not r_NH.grad[int(routing_map_TE.sum()):].any()
            grads.append(len(counted))
    assert grads == [0, 0, 1, 2]  # counted only for the map built elsewhere
    assert permutation_triton._recorded_routed_count(row_id_map_TE) is not None
    row_id_map_TE.add_(0)  # an in-place change: the recorded count no longer applies
    assert permutation_triton._recorded_routed_count(row_id_map_TE) is None


@pytest.mark.parametrize("block_t", [1, 2])
def test_unpermute_prefetch_variants_identical(triton_device, block_t):
    """The forward with the next row's load in flight sums in the same order: same bits."""
    tokens_TH, routing_map_TE, probs_TE, num_out = _case("k3_e12_h300", torch.float16,
                                                        triton_device)
    row_id_map_TE, _, total_1 = build_row_id_map_triton(routing_map_TE)
    rows_NH, _ = _launch_permute(tokens_TH, row_id_map_TE, total_1, num_out)
    outs = [_launch_unpermute(rows_NH, row_id_map_TE, probs_TE,
                              config=CopyConfig(128, 1, block_t, prefetch))[0]
            for prefetch in (False, True)]
    assert_bits_equal(outs[0], outs[1], "unpermute with and without prefetch")
    want_TH = unpermute_torch(rows_NH, row_id_map_TE, probs=probs_TE)
    torch.testing.assert_close(outs[0], want_TH,
                               **close_tolerance(torch.float16, interpreted=INTERPRETED))
