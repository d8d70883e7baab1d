"""The row gather and the padding-row zeroing (`rows.py` / `rows_triton.py`) against the torch
references: bit-identical outputs on bf16 and fp32 ([X], [X, K] and [X, H] rows, mixed valid and
-1 indices, an empty index, H not a multiple of the tile), identical grads through
`model.dispatch.rows.move_rows` with either op, the zeroing in place forward and out of place
backward; on a GPU (marker `gpu`) the same with no host sync and inside a CUDA graph."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the [triton] or [test] extra)")

from epoverlap.kernels.rows import gather_rows_torch, zero_rows_from_torch
from epoverlap.kernels.rows_triton import gather_rows_triton, zero_rows_from_triton
from epoverlap.kernels.triton_utils import row_tile_config
from epoverlap.model.dispatch.rows import move_rows

from kernel_test_utils import (INTERPRETED, assert_bits_equal, eager_then_graph_replay,
                               generator, sync_is_an_error)

DTYPES = (torch.bfloat16, torch.float32)
SHAPES = [(40,), (40, 3), (40, 8), (40, 33), (40, 300), (40, 2, 5)]  # 300: two H tiles in bf16


def _rows(shape, dtype, seed, device):
    return torch.randn(shape, generator=generator(seed)).to(dtype).to(device)


def _index(num_out, num_src, seed, device, dtype=torch.int64):
    """A one-to-one index into num_src rows with about a third of the slots empty (-1), and
    its inverse (source row -> slot, -1 where no slot takes it)."""
    gen = generator(seed)
    slots = torch.randperm(num_out, generator=gen)[:min(num_src, num_out * 2 // 3)]
    index = torch.full((num_out,), -1, dtype=torch.int64)
    index[slots] = torch.randperm(num_src, generator=gen)[:slots.numel()]
    inverse = torch.full((num_src,), -1, dtype=torch.int64)
    inverse[index[slots]] = slots
    return index.to(dtype).to(device), inverse.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gather_bit_identical(triton_device, dtype, shape):
    src = _rows(shape, dtype, 1, triton_device)
    index, _ = _index(57, shape[0], 2, triton_device)
    got = gather_rows_triton(src, index)
    assert_bits_equal(got, gather_rows_torch(src, index), f"gather {shape}")
    assert bool((got[index < 0] == 0).all()) and bool((index < 0).any())


def test_gather_int32_index_and_many_row_tiles(triton_device):
    """int32 indices; [X] probs over several 1024-row programs."""
    src = _rows((3000,), torch.float32, 3, triton_device)
    index, _ = _index(2500, 3000, 4, triton_device, torch.int32)
    assert row_tile_config(1, 4).block_t == 1024
    assert_bits_equal(gather_rows_triton(src, index), gather_rows_torch(src, index.long()),
                      "int32 index")


@pytest.mark.parametrize("shape", [(6, 4), (6,)])
def test_gather_empty_index_and_empty_source(triton_device, shape):
    src = _rows(shape, torch.bfloat16, 5, triton_device)
    empty = torch.zeros(0, dtype=torch.int64, device=triton_device)
    assert_bits_equal(gather_rows_triton(src, empty), gather_rows_torch(src, empty), "empty")
    none_valid = torch.full((3,), -1, device=triton_device)
    got = gather_rows_triton(src[:0], none_valid)
    assert got.shape == (3, *shape[1:]) and not bool(got.any())


def test_gather_never_reads_past_the_source(triton_device):
    """An index >= X (a caller's bug) is not read: a zero row where the reference raises."""
    src = _rows((4, 16), torch.float32, 6, triton_device)
    index = torch.tensor([3, 4, 100, -1, 0], device=triton_device)
    got = gather_rows_triton(src, index)
    assert_bits_equal(got[[0, 4]], src[[3, 0]], "valid rows")
    assert not bool(got[1:4].any())


def test_gather_refuses_a_grad():
    src = torch.zeros(3, 2, requires_grad=True)
    with pytest.raises(ValueError, match="not differentiable; use model.dispatch.rows.move_rows"):
        gather_rows_triton(src, torch.tensor([0, 1]))


def _grad(shape, like, seed):
    return torch.randn(shape, generator=generator(seed)).to(like)


def _moved(gather, src, index, inverse, grad):
    src = src.detach().clone().requires_grad_()
    out = move_rows(src, index, inverse, gather)
    out.backward(grad)
    return out.detach(), src.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(40,), (40, 8), (40, 300)])
@pytest.mark.parametrize("num_out", [57, 25])  # slots > rows (the send), < rows (rows cut)
def test_move_rows_grads_identical(triton_device, dtype, shape, num_out):
    src = _rows(shape, dtype, 8, triton_device)
    index, inverse = _index(num_out, shape[0], 9, triton_device)
    grad = _grad((num_out, *shape[1:]), src, 7)
    ref = _moved(gather_rows_torch, src, index, inverse, grad)
    out = _moved(gather_rows_triton, src, index, inverse, grad)
    assert_bits_equal(out[0], ref[0], "moved rows")
    assert_bits_equal(out[1], ref[1], "grad")
    cut = inverse < 0  # rows that no slot takes (cut) get no grad
    assert bool(cut.any()) and not bool(out[1][cut].any())


def _zeroed(fn, x, end_1, grad):
    leaf = x.detach().clone().requires_grad_()
    made = leaf * 1  # a non-leaf, like the GEMM's output
    out = fn(made, end_1)
    out.backward(grad)
    return out.detach(), leaf.grad, made, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,end", [((40, 33), 13), ((40, 300), 0), ((40, 8), 40),
                                       ((40,), 21), ((7, 2, 5), 3)])
def test_zero_rows_from_bit_identical(triton_device, dtype, shape, end):
    x = _rows(shape, dtype, 11, triton_device)
    x[end:] = float("nan")  # padding the GEMM left unwritten: anything
    end_1 = torch.tensor([end], dtype=torch.int32, device=triton_device)
    grad_in = _grad(shape, x, 10)
    ref_out, ref_grad, _, _ = _zeroed(zero_rows_from_torch, x, end_1, grad_in)
    out, grad, made, returned = _zeroed(zero_rows_from_triton, x, end_1, grad_in)
    assert_bits_equal(out, ref_out, "zeroed rows")
    assert_bits_equal(grad, ref_grad, "grad")
    assert returned.data_ptr() == made.data_ptr()  # written in place
    assert not bool(grad[end:].any()) and not bool(out[end:].any())


def test_zero_rows_from_touches_no_row_below_the_end(triton_device):
    """The in-place form stores only into rows >= end (rows below keep their very bits, NaN
    included) and leaves a non-contiguous input alone (a copy)."""
    x = torch.full((20, 16), float("nan"), device=triton_device)
    end_1 = torch.tensor([9], device=triton_device)
    out = zero_rows_from_triton(x, end_1)
    assert out is x and bool(x[:9].isnan().all()) and not bool(x[9:].any())
    wide = _rows((16, 20), torch.float32, 12, triton_device)
    got = zero_rows_from_triton(wide.t(), end_1)
    assert_bits_equal(got, zero_rows_from_torch(wide.t(), end_1), "non-contiguous")
    assert bool(wide.ne(0).all())  # untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET is set: kernels are not compiled")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_against_reference_and_in_a_cuda_graph(dtype):
    """The Qwen3 proxy's widths (H 2048 rows, [X] probs), an odd width; no host sync; a CUDA
    graph's replay gives the eager bits."""
    device = "cuda"
    for shape in [(8192, 2048), (8192,), (1000, 1000)]:
        src = _rows(shape, dtype, 13, device)
        index, inverse = _index(9000, shape[0], 14, device)
        x = _rows(shape, dtype, 15, device)
        end_1 = torch.tensor([shape[0] // 3], dtype=torch.int32, device=device)
        grad_moved, grad_x = _grad((9000, *shape[1:]), x, 16), _grad(shape, x, 17)

        def step(src=src, index=index, inverse=inverse, x=x, end_1=end_1, grads=(grad_moved,
                                                                                  grad_x)):
            moved, grad = _moved(gather_rows_triton, src, index, inverse, grads[0])
            zeroed, zero_grad, _, _ = _zeroed(zero_rows_from_triton, x, end_1, grads[1])
            return moved, grad, zeroed, zero_grad

        with sync_is_an_error():
            ref = (*_moved(gather_rows_torch, src, index, inverse, grad_moved),
                   *_zeroed(zero_rows_from_torch, x, end_1, grad_x)[:2])
        eager, replayed = eager_then_graph_replay(step)
        for got, want, what in zip(eager, ref, ("rows", "grad", "zeroed", "zero grad")):
            assert_bits_equal(got, want, f"{shape} {what}")
        for got, want, what in zip(replayed, eager, ("rows", "grad", "zeroed", "zero grad")):
            assert_bits_equal(got, want, f"{shape} graph {what}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_padding_rows_identical_on_both_backends(triton_device, dtype):
    """The experts under the budget dispatch (device-only counts, padding rows after the last
    expert's): the Triton zeroing, in place on the GEMM's output, gives the reference's output,
    input grad and weight grads (the tables differ in that op alone)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from epoverlap.kernels import make_moe_ops
    from epoverlap.model.moe import GroupedSwiGLUExperts

    reference = make_moe_ops("torch")
    tables = (reference, replace(reference, zero_rows_from=zero_rows_from_triton))

    counts_L = torch.tensor([5, 0, 7, 4], device=triton_device)  # 16 rows, then 8 of padding
    x_MH = _rows((24, 32), dtype, 18, triton_device)
    probs_M = torch.rand(24, generator=generator(19)).to(triton_device)
    grad_MH = _grad((24, 32), x_MH, 20)
    results = []
    for ops in tables:
        experts = GroupedSwiGLUExperts(
            SimpleNamespace(num_experts=4), 32, 16, 0, 0, 1, seed=3, std=0.1, out_std=0.1,
            dtype=dtype, device=triton_device, ops=ops)
        x = x_MH.clone().requires_grad_()
        out_MH = experts(x, probs_M, counts_L, None)
        out_MH.backward(grad_MH)
        # (the input grad's padding rows are left unwritten by the grouped GEMM, as before:
        # the dispatch's row move drops them)
        results.append((out_MH.detach(), x.grad[:16], experts.fc1.grad, experts.fc2.grad))
    assert not bool(results[1][0][16:].any())
    for got, want, what in zip(results[1], results[0], ("out", "grad x", "grad fc1", "grad fc2")):
        assert_bits_equal(got, want, what)
