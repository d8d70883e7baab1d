"""Communication the model makes: the all-to-alls of the MoE dispatcher (differentiable) and
the point-to-point transfers between pipeline stages.

Owns `ExpertComm` (the EP group, a `groups.Group`, plus the comm mode; `HostComms`, the
hierarchical dispatch's groups between and inside hosts), the autograd function whose forward
is an all_to_all_single and whose backward is the reverse all-to-all, `ContextComm` (the
context-parallel group's differentiable K/V exchanges: an all-gather and one step of a ring;
`model.context` uses them) and `PipelineComm` (send / receive one activation or grad to / from
another stage of this rank's pipeline, the PP `Group`). These calls run on whatever stream/thread the caller is on;
choosing that is the executor's business.

The split sizes of a dropless dispatch are exchanged early and read late (`SplitExchange`):
the exchange starts as soon as the router has counted (the end of the `attn` node), on its own
communicator (`counts_group`) and, on CUDA, its own stream, so it never queues behind an
all-to-all already in flight on the comm lane (another microbatch's combine, say); the
dispatch then reads the sizes on the host. Before, the exchange ran inside the dispatch on the
EP communicator, and the host read waited for every all-to-all queued ahead of it, stalling the
host (the bottleneck of an eager step) while it could have been issuing the other microbatch's
kernels. This stream is the one the executor does not own: it belongs to the exchange, like
the internal streams of a process group, and nothing but the exchange runs on it.

Transports (config `--moe-a2a-transport`): the all-to-alls go through the EP group's
`all_to_all_single` (NCCL, gloo), or, given a `host_memory.CopyEngineTransport`, on copy
engines through shared host memory or peer copies into the receivers' device memory (its
placement, `peer_memory`), tracked by the watch as the EP group's collective all the same;
`on_process_group` is a view of the same communicator on the group's own (the tuner times
both, each path with its own dispatcher). The split sizes the host reads are exchanged over the
process group either way; the counts kept on the device (`exchange_counts`, the budget
dispatch's) go with the data.

Comm modes (config `--comm-mode`, benchmarks only): `real`, or `local_copy`, which replaces
each all-to-all by a local copy of the same bytes, as if every rank received what it sent: the
compute-only baseline of the overlap benchmark (the split-size exchange still syncs the host).
By host, both stages' communicators carry the mode too (`HostComms`; the dispatch then sizes
its stages from its own counts, `model.dispatch.by_host.HostRoute.mirrored`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from epoverlap.parallel.groups import Group
from epoverlap.parallel.host_memory import CopyEngineTransport
from epoverlap.parallel.watch import host_list


class SplitExchange:
    """One dispatch's exchange of per-expert counts, started early (`ExpertComm.
    start_split_exchange`) and read by the dispatch (`read`).

    `recv_RL` [R, L] (device): rows each source rank sends to each local expert. `read()`
    returns (rows sent to each rank, rows received from each rank, rows per local expert) as host
    lists, summed on the host from the sent and received counts; on CUDA it waits for their
    pinned copies (the GIL released, as `watch.host_list`) and orders the caller's stream after
    the exchange. With `rank_rows` the exchanged counts carry one more column, the rows sent to
    each rank counted apart (a dispatch that sends a token once per rank, not once per expert):
    the rows per rank are read from it, not summed."""

    def __init__(self, recv_RL: Optional[torch.Tensor], counts: Optional[torch.Tensor] = None,
                 ready: Optional[torch.cuda.Event] = None, pending=None, keep: tuple = (),
                 watched=None, rank_rows: bool = False):
        self._recv, self.rank_rows = recv_RL, rank_rows
        self._counts = counts  # [2, R, L(+1)]: sent, received (pinned on CUDA; None: read them)
        self._ready, self._pending, self._keep, self._watched = ready, pending, keep, watched
        self._read: Optional[tuple[list[int], list[int], list[int]]] = None
        self._pairs: Optional[tuple[list, list]] = None

    def read_pairs(self) -> tuple[list, list]:
        """`read`'s counts before summing: host [R][L] lists of the rows sent to each (rank,
        its local expert) and received from each (source rank, local expert) (the
        dispatch in waves splits by groups of experts, `model.waves`)."""
        self.read()
        return self._pairs

    @property
    def recv_RL(self) -> Optional[torch.Tensor]:
        """[R, L] device: rows received per (source rank, local expert)."""
        if self._recv is None or not self.rank_rows:
            return self._recv
        return self._recv[:, :-1]

    def read(self) -> tuple[list[int], list[int], list[int]]:
        if self._read is None:
            with self._watched() if self._watched else contextlib.nullcontext():
                if self._pending is not None:  # gloo: the asynchronous all-to-all
                    self._pending.wait()
                if self._ready is not None:  # CUDA: the pinned copies of the counts
                    self._ready.synchronize()
            if self._ready is not None:
                stream = torch.cuda.current_stream(self._recv.device)
                stream.wait_event(self._ready)
                self._recv.record_stream(stream)
            if self._counts is not None:
                sent_RL, recv_RL = self._counts.tolist()
            else:
                sent_RL, recv_RL = self._keep[0].tolist(), self._recv.tolist()
            self._pairs = (sent_RL, recv_RL)
            self._read = split_sizes(sent_RL, recv_RL, self.rank_rows)
            self._keep = ()  # the exchange has read its input: the memory may go
        return self._read


class _ExchangeAtRead(SplitExchange):
    """Without a second communicator: the exchange runs when the dispatch reads it, on the EP
    communicator and the dispatch's stream (an exchange on another stream of the same NCCL
    communicator could interleave with its all-to-alls differently on two ranks)."""

    def __init__(self, comm: "ExpertComm", send_RL: torch.Tensor, rank_rows: bool):
        super().__init__(None, rank_rows=rank_rows)
        self._comm, self._send_RL = comm, send_RL

    def read(self) -> tuple[list[int], list[int], list[int]]:
        if self._read is None:
            self._recv = self._comm.exchange_counts(self._send_RL.reshape(-1))
            self._pairs = tuple(host_list(torch.stack([self._send_RL, self._recv])))
            self._read = split_sizes(*self._pairs, self.rank_rows)
            self._send_RL = None
        return self._read


def split_sizes(sent_RL: list, recv_RL: list, rank_rows: bool = False
                ) -> tuple[list[int], list[int], list[int]]:
    """Host lists of the counts sent to each (rank, its local expert) and received from each
    (source rank, local expert) -> (rows sent to each rank, rows received from each rank, rows
    per local expert). `rank_rows`: each row's last entry is the rows sent to (received from)
    that rank, the others the (rank, expert) pairs."""
    if rank_rows:
        return ([row[-1] for row in sent_RL], [row[-1] for row in recv_RL],
                [sum(column) for column in zip(*(row[:-1] for row in recv_RL))])
    return ([sum(row) for row in sent_RL], [sum(row) for row in recv_RL],
            [sum(column) for column in zip(*recv_RL)])


class ExpertComm:
    """All-to-all over the expert-parallel group (None when size is 1); `counts_group` (the
    same ranks, another communicator) carries the early split-size exchange. `by_host`: the
    hierarchical dispatch's two stages (`HostComms`), where it is on. `transport`: the
    copy-engine all-to-all (--moe-a2a-transport host_memory or peer_memory), used while
    `copy_engine` is True."""

    def __init__(self, group: Optional[Group], size: int, mode: str = "real",
                 counts_group: Optional[Group] = None, by_host: Optional["HostComms"] = None,
                 transport: Optional[CopyEngineTransport] = None):
        self.group = group
        self.size = size
        self.mode = mode
        self.counts_group = counts_group
        self.by_host = by_host
        self.transport = transport
        self.copy_engine = transport is not None
        self.trace: Optional[list] = None  # set to [] to record every all-to-all's shape
        self._exchange_stream: Optional[torch.cuda.Stream] = None

    def _record(self, output_splits, input_splits, row_shape, dtype, rows: int = 0) -> None:
        if self.trace is not None:  # splits None: equal chunks of `rows`, recorded as counts
            equal = [rows // self.size] * self.size
            self.trace.append((list(output_splits or equal), list(input_splits or equal),
                               tuple(row_shape), dtype))

    def all_to_all(self, input_NH: torch.Tensor, output_splits: Optional[list[int]],
                   input_splits: Optional[list[int]]) -> torch.Tensor:
        """Rows input_splits[r] go to rank r; rows output_splits[r] arrive from rank r. Splits
        None: equal chunks of N / ranks rows both ways (the output has N rows).

        Syncs no host; blocks the calling stream (GPU) or thread (CPU) until done.
        """
        self._record(output_splits, input_splits, input_NH.shape[1:], input_NH.dtype,
                     input_NH.shape[0])
        if self.size == 1 or self.mode == "local_copy":
            return input_NH.clone()
        input_NH = input_NH.contiguous()
        rows = input_NH.shape[0] if output_splits is None else sum(output_splits)
        output = input_NH.new_empty((rows,) + tuple(input_NH.shape[1:]))
        self._carry(output, input_NH, output_splits, input_splits)
        return output

    def _carry(self, output: torch.Tensor, input: torch.Tensor,
               output_splits: Optional[list[int]], input_splits: Optional[list[int]]) -> None:
        """One all-to-all, on copy engines while `copy_engine` is on, else the group's."""
        if self.copy_engine:
            with self.group.watched(f"all_to_all over {self.transport.medium}"):
                self.transport.all_to_all(output, input, output_splits, input_splits)
        else:
            self.group.all_to_all_single(output, input, output_splits, input_splits)

    def on_process_group(self) -> "ExpertComm":
        """This communicator with its all-to-alls on the process group's own, never the copy
        engines: a view over the same groups (the tuner's `+group` path); closing stays this
        one's."""
        view = copy.copy(self)
        view.copy_engine = False
        return view

    def close(self) -> None:
        """Release the copy-engine transport (its data slots and region), if any."""
        if self.transport is not None:
            self.transport.close()
            self.transport, self.copy_engine = None, False

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Per-expert send counts [E] -> counts received [ep, E_local] (row = source rank).
        Kept on the device (the budget dispatch's counts), so through host memory while it
        carries the data: a graph over the budget dispatch then holds no process-group call."""
        send_RL = counts_E.view(self.size, -1).contiguous()
        ones = [send_RL.shape[1]] * self.size
        self._record(ones, ones, (), send_RL.dtype)
        if self.size == 1 or self.mode == "local_copy":
            return send_RL.clone()
        recv_RL = torch.empty_like(send_RL)
        self._carry(recv_RL, send_RL, None, None)
        return recv_RL

    def start_split_exchange(self, counts_E: torch.Tensor,
                             rows_R: Optional[torch.Tensor] = None) -> SplitExchange:
        """Start exchanging the per-expert send counts [E] of one dispatch (and, given, the
        rows sent to each rank [R], where they are not the sum of its experts' counts); the
        dispatch reads the split sizes with `SplitExchange.read()` (module docstring)."""
        send_RL = counts_E.view(self.size, -1)
        rank_rows = rows_R is not None
        if rank_rows:
            send_RL = torch.cat([send_RL, rows_R.view(self.size, 1).to(send_RL.dtype)], dim=1)
        return self._start_exchange(send_RL.contiguous(), rank_rows)

    def start_table_exchange(self, counts_V: torch.Tensor) -> SplitExchange:
        """Start sending every rank of the group this rank's counts [V] (an all-gather, as
        the split-size exchange runs it): the hierarchical dispatch's sizes depend on other
        ranks' routing. `SplitExchange.read_pairs()[1]` is then the table [R][V], row = rank;
        `recv_RL` the same on the device."""
        return self._start_exchange(counts_V.view(1, -1).expand(self.size, -1).contiguous(),
                                    rank_rows=False)

    def _start_exchange(self, send_RL: torch.Tensor, rank_rows: bool) -> SplitExchange:
        """Row r of `send_RL` goes to rank r, on the counts communicator and its stream."""
        local = self.size == 1 or self.mode == "local_copy"
        if not local and self.counts_group is None:
            return _ExchangeAtRead(self, send_RL, rank_rows)  # `exchange_counts` at the read
        ones = [send_RL.shape[1]] * self.size
        self._record(ones, ones, (), send_RL.dtype)
        if not send_RL.is_cuda:
            if local:
                return SplitExchange(send_RL.clone(), keep=(send_RL,), rank_rows=rank_rows)
            recv_RL = torch.empty_like(send_RL)
            pending = self.counts_group.all_to_all_single_async(recv_RL, send_RL)
            return SplitExchange(recv_RL, pending=pending, keep=(send_RL,),
                                 watched=lambda: self.counts_group.watched(
                                     "all_to_all of the split sizes"), rank_rows=rank_rows)
        stream = self._stream(send_RL.device)
        stream.wait_stream(torch.cuda.current_stream(send_RL.device))
        with torch.cuda.stream(stream):
            if local:
                recv_RL = send_RL.clone()
            else:
                recv_RL = torch.empty_like(send_RL)
                self.counts_group.all_to_all_single(recv_RL, send_RL)
            counts = torch.empty((2,) + tuple(send_RL.shape), dtype=send_RL.dtype,
                                 pin_memory=True)
            counts[0].copy_(send_RL, non_blocking=True)  # two copies, no kernel: the sums
            counts[1].copy_(recv_RL, non_blocking=True)  # are the host's (`split_sizes`)
            ready = torch.cuda.Event()
            ready.record(stream)
        # send_RL stays referenced until read() has waited for `ready`, which comes after the
        # exchange read it: its memory cannot be handed out while the exchange still needs it.
        # The exchange itself is the watched collective (its event is on this stream), so a
        # read blocked by a dead peer is reported as that exchange.
        return SplitExchange(recv_RL, counts, ready, keep=(send_RL,), rank_rows=rank_rows)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._exchange_stream is None:
            self._exchange_stream = torch.cuda.Stream(
                device=device, priority=torch.cuda.Stream.priority_range()[1])
        return self._exchange_stream


@dataclass
class HostComms:
    """The hierarchical dispatch's communicators (--moe-dispatch-hierarchy node): `between`
    links this rank to the rank of its index in every host of the EP group (a rail), `within`
    to its host's ranks. The EP group's ranks are host-major: EP rank = host x per_host +
    index."""

    between: ExpertComm
    within: ExpertComm
    ep_rank: int

    @property
    def hosts(self) -> int:
        return self.between.size

    @property
    def per_host(self) -> int:
        return self.within.size


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


class ContextComm:
    """The context-parallel (CP) group's differentiable exchanges (`model.context`):
    `gather` (every rank's tensor, stacked in rank order) and `shift` (one step of a ring: my
    tensor to the next rank, the previous rank's to me). Both block the caller until done.
    `lane`: a second communicator of the same ranks for the K/V gather of the comm lane, so
    its collectives never interleave with those the compute lane issues meanwhile on `group`
    (the ring, the aux loss's counts) in a different order on different ranks. `sizes`:
    under dynamic CP the communicators of my smaller groups by their size (`sizes` also holds
    this one, at its own size)."""

    def __init__(self, group: Group, lane: Optional[Group] = None,
                 sizes: Optional[dict] = None):
        self.group, self.size = group, group.size
        self.rank = group.ranks.index(dist.get_rank())
        self.lane = ContextComm(lane) if lane is not None else None
        self.sizes = {**(sizes or {}), self.size: self}

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] -> [CP, ...]. Backward: each rank's slice of the grads goes to its owner,
        which sums them in rank order (an all-to-all, then a sum: the same bits on any run)."""
        return _Gather.apply(self, x)

    def shift(self, x: torch.Tensor, step: int = 1) -> torch.Tensor:
        """The tensor of the rank `step` places before me in the ring (mine goes `step` places
        on). Backward: the grad goes the other way round."""
        return _Shift.apply(self, x, step)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the CP group (not differentiable: counts)."""
        total = x.detach().clone()
        self.group.all_reduce(total)
        return total

    def _peer(self, offset: int) -> int:
        return self.group.ranks[(self.rank + offset) % self.size]

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
        self.group.all_gather_into(out, x.contiguous())
        return out.view((self.size,) + tuple(x.shape))

    def _scatter_sum(self, grads: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(grads)
        self.group.all_to_all_single(received, grads.contiguous())
        total = received[0]
        for grad in received[1:]:
            total = total + grad
        return total

    def _shift(self, x: torch.Tensor, step: int) -> torch.Tensor:
        out = torch.empty_like(x)
        self.group.exchange(out, x.contiguous(), self._peer(step), self._peer(-step))
        return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: ContextComm, x):
        ctx.comm = comm
        return comm._gather(x)

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.comm._scatter_sum(grad)


class _Shift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: ContextComm, x, step: int):
        ctx.comm, ctx.step = comm, step
        return comm._shift(x, step)

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.comm._shift(grad, -ctx.step), None


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
