"""Communication the model makes: the all-to-alls of the MoE dispatcher (differentiable) and
the point-to-point transfers between pipeline stages.

Owns `ExpertComm` (the EP group, a `groups.Group`, plus the comm mode), the autograd function
whose forward is an all_to_all_single and whose backward is the reverse all-to-all, and
`PipelineComm` (send / receive one activation or grad to / from another stage of this rank's
pipeline, the PP `Group`). These calls run on whatever stream/thread the caller is on;
choosing that is the executor's business.

Comm modes (config `--comm-mode`, benchmarks only): `real`, or `local_copy`, which replaces
each all-to-all by a local copy of the same bytes, as if every rank received what it sent: the
compute-only baseline of the overlap benchmark (the split-size exchange still syncs the host).
"""

from __future__ import annotations

from typing import Optional

import torch

from epoverlap.parallel.groups import Group


class ExpertComm:
    """All-to-all over the expert-parallel group (None when size is 1)."""

    def __init__(self, group: Optional[Group], size: int, mode: str = "real"):
        self.group = group
        self.size = size
        self.mode = mode
        self.trace: Optional[list] = None  # set to [] to record every all-to-all's shape

    def _record(self, output_splits, input_splits, row_shape, dtype) -> None:
        if self.trace is not None:
            equal = [None] * self.size
            self.trace.append((list(output_splits or equal), list(input_splits or equal),
                               tuple(row_shape), dtype))

    def all_to_all(self, input_NH: torch.Tensor, output_splits: Optional[list[int]],
                   input_splits: Optional[list[int]]) -> torch.Tensor:
        """Rows input_splits[r] go to rank r; rows output_splits[r] arrive from rank r. Splits
        None: equal chunks of N / ranks rows both ways (the output has N rows).

        Syncs no host; blocks the calling stream (GPU) or thread (CPU) until done.
        """
        self._record(output_splits, input_splits, input_NH.shape[1:], input_NH.dtype)
        if self.size == 1 or self.mode == "local_copy":
            return input_NH.clone()
        input_NH = input_NH.contiguous()
        rows = input_NH.shape[0] if output_splits is None else sum(output_splits)
        output = input_NH.new_empty((rows,) + tuple(input_NH.shape[1:]))
        self.group.all_to_all_single(output, input_NH, output_splits, input_splits)
        return output

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Per-expert send counts [E] -> counts received [ep, E_local] (row = source rank)."""
        send_RL = counts_E.view(self.size, -1).contiguous()
        ones = [send_RL.shape[1]] * self.size
        self._record(ones, ones, (), send_RL.dtype)
        if self.size == 1 or self.mode == "local_copy":
            return send_RL.clone()
        recv_RL = torch.empty_like(send_RL)
        self.group.all_to_all_single(recv_RL, send_RL)
        return recv_RL


class AllToAll(torch.autograd.Function):
    """Differentiable all_to_all_single: backward sends grads back along the reverse splits."""

    @staticmethod
    def forward(ctx, comm: ExpertComm, input_NH: torch.Tensor,
                output_splits: Optional[list[int]],
                input_splits: Optional[list[int]]) -> torch.Tensor:
        ctx.comm, ctx.output_splits, ctx.input_splits = comm, output_splits, input_splits
        return comm.all_to_all(input_NH, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input = ctx.comm.all_to_all(grad_output, ctx.input_splits, ctx.output_splits)
        return None, grad_input, None, None


def all_to_all(comm: ExpertComm, input_NH: torch.Tensor, output_splits: Optional[list[int]],
               input_splits: Optional[list[int]]) -> torch.Tensor:
    return AllToAll.apply(comm, input_NH, output_splits, input_splits)


class PipelineComm:
    """Blocking send / receive of [T, H] activations and their grads between the stages of one
    pipeline (the PP group; `ranks[s]` is stage s's global rank). A transfer waits for its peer
    (NCCL: on the caller's stream; gloo: on the caller's thread), so both ends of a link must
    issue their transfers in the same order: the plan sees to that (`schedule.pipeline`)."""

    def __init__(self, group: Group, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device):
        self.group, self.ranks = group, group.ranks
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def send(self, tensor_TH: torch.Tensor, stage: int) -> None:
        if tuple(tensor_TH.shape) != self.shape:
            raise RuntimeError(f"pipeline send of shape {tuple(tensor_TH.shape)}, expected "
                               f"{self.shape}")
        self.group.send(tensor_TH.detach().contiguous(), self.ranks[stage])

    def recv(self, stage: int) -> torch.Tensor:
        buffer_TH = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.group.recv(buffer_TH, self.ranks[stage])
        return buffer_TH
