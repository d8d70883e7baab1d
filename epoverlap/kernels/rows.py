"""Row copies around fixed-size buffers with empty rows: torch references `gather_rows_torch`
and `zero_rows_from_torch`.

  gather_rows(src, index) -> out[y] = src[index[y]], a zero row where index[y] < 0: the budget
    dispatch's moves between the permuted rows and its fixed blocks (`model.dispatch.rows.
    move_rows`, its autograd form: a one-to-one index, so the backward is the inverse gather).
  zero_rows_from(x, end) -> x with every row from `end` on zeroed: the experts' padding rows
    past the last expert's end, which the grouped GEMM leaves unwritten (`model.moe`).

Shape legend: X source rows, Y output rows, M rows, H row width (any trailing dims: [X] and
[X, K] probs are rows too).

Indices and ends live on the device and nothing here reads them on the host, so both run inside
CUDA graphs. Pure copies (and zeros): deterministic, and the Triton kernels
(`rows_triton.py`) give the same bits.
"""

from __future__ import annotations

import torch


def _rows_mask(mask_Y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[Y] -> [Y, 1, ...] to broadcast over `like`'s trailing dims."""
    return mask_Y.view(-1, *([1] * (like.dim() - 1)))


def gather_rows_torch(src_X: torch.Tensor, index_Y: torch.Tensor) -> torch.Tensor:
    """src [X, ...], index [Y] int (device; < 0: an empty row) -> [Y, ...], a zero row where
    index < 0. A plain function of index_select and where (differentiable through autograd,
    the backward a scatter-add); `model.dispatch.rows.move_rows` is the form the model uses."""
    picked_Y = src_X.index_select(0, index_Y.clamp(min=0))
    return torch.where(_rows_mask(index_Y >= 0, picked_Y), picked_Y, picked_Y.new_zeros(()))


def zero_rows_from_torch(x_M: torch.Tensor, end_1: torch.Tensor) -> torch.Tensor:
    """x [M, ...], end [1] int (device) -> x with rows >= end zeroed, out of place;
    differentiable (the grad's rows >= end zeroed)."""
    row_M = torch.arange(x_M.shape[0], device=x_M.device)
    return torch.where(_rows_mask(row_M < end_1, x_M), x_M, x_M.new_zeros(()))
