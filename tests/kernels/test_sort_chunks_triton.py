"""Triton chunk sort against the torch reference: bit-exact rows and probs both ways, empty
chunks, rows past the split total, many chunks (several C tiles), the split-total bound."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels.sort_chunks import chunk_sort_source_rows, sort_chunks_by_idxs_torch
from epoverlap.kernels.sort_chunks_triton import (_launch_move_rows, chunk_src_rows_triton,
                                                  sort_chunks_by_idxs_triton)

from kernel_test_utils import (DTYPES, INTERPRETED, assert_bits_equal, assert_same_run,
                               generator, random_like_rows)


def _chunks(num_chunks, max_size, extra_rows, seed, device):
    gen = generator(seed)
    sizes_C = torch.randint(0, max_size + 1, (num_chunks,), generator=gen)
    sizes_C[num_chunks // 2] = 0  # an empty chunk
    order_C = torch.randperm(num_chunks, generator=gen)
    return sizes_C.to(device), order_C.to(device), int(sizes_C.sum()) + extra_rows


def _run(fn, input_NH, sizes_C, order_C, probs_N, seed=5):
    input_NH = input_NH.detach().clone().requires_grad_()
    probs_N = probs_N.detach().clone().requires_grad_()
    out_NH, out_probs_N = fn(input_NH, sizes_C, order_C, probs_N)
    gen = generator(seed)
    grad_NH = torch.randn(out_NH.shape, generator=gen).to(out_NH)
    grad_N = torch.randn(out_probs_N.shape, generator=gen).to(out_probs_N)
    torch.autograd.backward([out_NH, out_probs_N], [grad_NH, grad_N])
    return out_NH.detach(), out_probs_N.detach(), input_NH.grad, probs_N.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_chunks,max_size,extra_rows,hidden", [
    (8, 5, 0, 40),     # 2 ranks x 4 local experts
    (6, 4, 3, 33),     # rows past the total stay in place
    (130, 1, 2, 16),   # more chunks than one BLOCK_C tile
    (1, 7, 0, 300),
])
def test_sort_chunks_bit_exact(triton_device, dtype, num_chunks, max_size, extra_rows, hidden):
    sizes_C, order_C, num_rows = _chunks(num_chunks, max_size, extra_rows, 1, triton_device)
    input_NH = random_like_rows(num_rows, hidden, dtype, 2, triton_device)
    probs_N = torch.rand(num_rows, generator=generator(3)).to(dtype).to(triton_device)
    ref = _run(sort_chunks_by_idxs_torch, input_NH, sizes_C, order_C, probs_N)
    out = _run(sort_chunks_by_idxs_triton, input_NH, sizes_C, order_C, probs_N)
    for got, want, what in zip(out, ref, ("rows", "probs", "grad rows", "grad probs"), strict=True):
        assert_bits_equal(got, want, what)


def test_source_rows_match_reference(triton_device):
    sizes_C, order_C, num_rows = _chunks(300, 2, 4, 4, triton_device)
    src_rows_N, total_1 = chunk_src_rows_triton(sizes_C, order_C, num_rows)
    want_N = chunk_sort_source_rows(sizes_C, order_C, num_rows)
    assert_bits_equal(src_rows_N.long(), want_N, "source rows")
    assert int(total_1[0]) == int(sizes_C.sum())


def test_round_trip_and_no_probs(triton_device):
    """Expert-major then back to rank-major (the dispatcher's two sorts) is the identity."""
    ranks, local = 3, 4
    counts_RL = torch.randint(0, 4, (ranks, local), generator=generator(6)).to(triton_device)
    to_expert = torch.tensor([r * local + e for e in range(local) for r in range(ranks)],
                             device=triton_device)
    to_rank = torch.tensor([e * ranks + r for r in range(ranks) for e in range(local)],
                           device=triton_device)
    rows_NH = random_like_rows(int(counts_RL.sum()), 24, torch.bfloat16, 7, triton_device)
    sorted_NH, probs = sort_chunks_by_idxs_triton(rows_NH, counts_RL.reshape(-1), to_expert)
    assert probs is None
    back_NH, _ = sort_chunks_by_idxs_triton(sorted_NH, counts_RL.t().reshape(-1), to_rank)
    assert_bits_equal(back_NH, rows_NH, "round trip")


def test_deterministic(triton_device):
    sizes_C, order_C, num_rows = _chunks(8, 5, 1, 8, triton_device)
    input_NH = random_like_rows(num_rows, 20, torch.float16, 9, triton_device)
    probs_N = torch.rand(num_rows, generator=generator(3)).to(triton_device)
    first = _run(sort_chunks_by_idxs_triton, input_NH, sizes_C, order_C, probs_N)
    second = _run(sort_chunks_by_idxs_triton, input_NH, sizes_C, order_C, probs_N)
    assert_same_run(first, second, "sort_chunks")


@pytest.mark.skipif(not INTERPRETED, reason="CPU path: on CUDA this is a device assert")
def test_split_total_above_rows_is_refused(triton_device):
    sizes_C = torch.tensor([3, 4, 5], device=triton_device)
    with pytest.raises(ValueError, match="split_sizes sum to more than the input's 10 rows"):
        sort_chunks_by_idxs_triton(torch.zeros(10, 4, device=triton_device), sizes_C,
                                   torch.tensor([2, 0, 1], device=triton_device))


def test_move_rows_never_touches_rows_past_n(triton_device):
    """A corrupt map (ids >= N) is skipped by the copy kernel, never read or written."""
    src_rows_N = torch.tensor([2, 0, 9, 1], dtype=torch.int32, device=triton_device)
    input_NH = torch.arange(12.0, device=triton_device).reshape(4, 3)
    out_NH, _ = _launch_move_rows(input_NH, src_rows_N, None, scatter=True)
    assert_bits_equal(out_NH[[2, 0, 1]], input_NH[[0, 1, 3]], "scattered rows")


def test_bad_arguments():
    with pytest.raises(ValueError, match="split_sizes has 2 chunks but sorted_idxs has 3"):
        sort_chunks_by_idxs_triton(torch.zeros(4, 2), torch.tensor([1, 3]), torch.arange(3))
