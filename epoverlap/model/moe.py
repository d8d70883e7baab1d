"""The MoE layer's pieces: router, all-to-all dispatcher, grouped SwiGLU experts.

Owns `Router` (gate, score function, top-k, aux losses, capacity, expert bias and its per-step
update), `DispatchMode` (how the all-to-alls are sized, from the config), `DispatchBudget` (the
sync-free dropless mode's buffer size and overflow record), `AllToAllDispatcher` (preprocess,
dispatch, sort-by-expert, unsort, combine: the steps the scheduler runs as separate nodes),
`GroupedSwiGLUExperts` and `SwiGLU` (dense / shared MLP). The routing ops come from an `MoEOps`
table chosen once by config (torch or Triton).

Dispatch modes (`DispatchMode.name`), and whether the host reads the device in the dispatch:
  dropless         each rank sends what it routed; split sizes read on the host before the
                   all-to-all (one sync per layer and microbatch), from an exchange started
                   when the router has counted (`start_split_exchange`, at the end of the
                   `attn` node), so the read waits for that exchange alone.
  capacity         Megatron-core's --moe-expert-capacity-factor: the router drops routed
                   (token, expert) pairs beyond an expert's capacity (counted, `step_dropped`);
                   the split sizes are still data dependent: read on the host.
  capacity_padded  + --moe-pad-expert-input-to-capacity: every expert gets exactly `capacity`
                   rows from every rank (unrouted tokens with prob 0 fill the gap), so every
                   split size is known from shapes: no host read.
  budget           --moe-dispatch-budget: dropless, but every rank sends every rank one chunk of
                   a fixed size (`DispatchBudget`): equal splits, counts kept on the device; a
                   dispatch whose rows for one rank exceed the chunk is recorded on the device
                   (`DispatchBudget.demand_rows`) and the trainer reruns the step at a larger
                   budget: no token is ever silently dropped, no host read inside the step.
With --moe-dispatch-once-per-rank (dropless, capacity, budget) the preprocess sends each
token once to every rank holding one of its experts (`permute` over a [T, R] "to rank" map),
each row with the probs of that rank's L experts (-1 where the expert was not chosen); the
receiving rank copies the row to those experts (`sort_by_expert`, a second permute) and sums
their outputs (`unsort`, its unpermute) before the combine returns one row per (token, rank).
The experts see the same rows in the same order as without it ((local expert, source rank,
token)); the combine sums per rank first. Split sizes: rows per rank counted apart and
exchanged with the expert counts; with the budget nothing is exchanged: a rank's chunk holds
its rows for that rank (at most one per token), and each received row's probs say which local
experts it goes to (an empty slot's: none), so the receiver counts its experts' rows itself.
Those (row, expert) pairs are budgeted too (`DispatchBudget.expert_rows`: the budget times a
rank's balanced share, tokens x topk, not the chunks' rows times min(topk, L), 2-2.5x more at
top-4 to top-8 on 2 ranks); pairs past it are cut and recorded, and the step reruns.
The preprocess never reads the host in any mode (its row count is static: tokens x topk, or
experts x capacity padded); only the torch reference permute does (`preprocess_syncs_host`).

Probabilities are applied inside the expert activation (h = silu(gate) * up * prob, in fp32),
so the combine's unpermute sums rows without merging probs.

Shape legend: T local tokens, H hidden, E global experts, L local experts (E / ep), R EP ranks,
N = T * topk permuted rows, M rows received by this rank, F expert FFN width.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from epoverlap.kernels import MoEOps
from epoverlap.kernels.capacity import apply_router_token_dropping, dropped_pairs
from epoverlap.kernels.router_topk import (SwitchAuxLoss, attach_aux_loss, aux_loss_scores,
                                          expert_token_counts, plain_topk_counts,
                                          switch_aux_loss)

from epoverlap.parallel.comm import ExpertComm, SplitExchange, all_to_all
from epoverlap.config import MoEConfig
from epoverlap.config.dispatch import DispatchMode, budget_chunk_rows, budget_levels, padded_rows
from epoverlap.model.linear import expert_offsets, grouped_gemm, linear


def seeded_normal_(tensor: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """Fill from a generator of its own, so init is independent of order, device count, EP.
    A meta tensor (a shape-only model, e.g. the simulator's) has no values to fill."""
    if tensor.device.type == "meta":
        return tensor
    generator = torch.Generator(device=tensor.device)
    generator.manual_seed(seed % (2**63))
    with torch.no_grad():
        return tensor.normal_(0.0, std, generator=generator)


def param_seed(base_seed: int, *names: object) -> int:
    return base_seed * 1_000_003 + zlib.crc32("/".join(str(n) for n in names).encode())


class DispatchBudget:
    """The buffer size of the sync-free dropless dispatch, shared by every MoE layer of a model.

    Each rank sends every EP rank one chunk of `chunk_rows` rows: ceil(factor x N / ranks), at
    most N, where N = tokens x topk of a microbatch (factor 1.0 = the balanced share). A
    dispatch that routes more than a chunk's rows to one rank sends only the first chunk of them
    and raises `demand_rows` (a device scalar: the most rows any dispatch of the step wanted to
    send to one rank); after the step the trainer all-reduces it and, if it exceeds the chunk,
    reruns the step at `rerun_level(demand)`, the smallest of `levels` whose chunk holds it.

    Once per rank a received row goes to up to min(topk, L) local experts, so the experts' rows
    are budgeted apart (`pairs_per_dispatch` = tokens x topk, the balanced share of (token,
    expert) pairs a rank's experts get; `pairs_per_row` = min(topk, L)): `expert_rows`, with its
    own demand (`demand_expert_rows`, the most pairs any dispatch brought one rank's experts).
    Without `pairs_per_dispatch` the rows are the pairs already: nothing apart to budget. The
    experts' demand is counted where the rows arrive, so a step whose sends overflowed counts
    only the pairs of the rows that were sent: its rerun, whose chunks hold every row, may still
    overflow the experts' budget and run once more (never with k >= EP at a budget >= 1, whose
    chunks hold one row per token).
    """

    def __init__(self, factor: float, ranks: int, rows_per_dispatch: int,
                 device: torch.device, pairs_per_dispatch: Optional[int] = None,
                 pairs_per_row: int = 1):
        self.ranks, self.rows = ranks, rows_per_dispatch
        self.pairs, self.pairs_per_row = pairs_per_dispatch, pairs_per_row
        self.levels = budget_levels(factor, ranks)
        self.level = 0
        self.demand_rows = torch.zeros((), dtype=torch.int64, device=device)
        self.demand_expert_rows = torch.zeros((), dtype=torch.int64, device=device)

    @classmethod
    def for_dispatch(cls, factor: float, ranks: int, tokens: int, topk: int, num_experts: int,
                     once_per_rank: bool, device: torch.device) -> "DispatchBudget":
        """The budget of a dispatch of `tokens` tokens a microbatch: rows are (token, expert)
        pairs, or once per rank (EP > 1) (token, rank) pairs, at most min(topk, ranks) a token,
        each going to at most min(topk, L) local experts, whose rows are budgeted apart."""
        if once_per_rank and ranks > 1:
            return cls(factor, ranks, tokens * min(topk, ranks), device,
                       pairs_per_dispatch=tokens * topk,
                       pairs_per_row=min(topk, num_experts // ranks))
        return cls(factor, ranks, tokens * topk, device)

    @property
    def factor(self) -> float:
        return self.levels[self.level]

    def chunk_rows_at(self, level: int) -> int:
        return budget_chunk_rows(self.levels[level], self.rows, self.ranks)

    @property
    def chunk_rows(self) -> int:
        return self.chunk_rows_at(self.level)

    def expert_rows_at(self, level: int) -> Optional[int]:
        """Rows the local experts get at `level` (once per rank), else None: the budget times
        the balanced share of pairs, at most every received row times `pairs_per_row` (at the
        top level, `ranks` x the pairs: every pair of every rank, so it never overflows)."""
        if self.pairs is None:
            return None
        received = self.ranks * self.chunk_rows_at(level) * self.pairs_per_row
        return min(received, math.ceil(self.levels[level] * self.pairs))

    @property
    def expert_rows(self) -> Optional[int]:
        return self.expert_rows_at(self.level)

    def note(self, send_R: torch.Tensor) -> None:
        """Record on the device the most rows this dispatch routes to one rank (no sync)."""
        torch.maximum(self.demand_rows, send_R.max(), out=self.demand_rows)

    def note_expert_rows(self, pairs: torch.Tensor) -> None:
        """Record on the device the pairs this dispatch brought the local experts (no sync)."""
        torch.maximum(self.demand_expert_rows, pairs, out=self.demand_expert_rows)

    def reset_demand(self) -> None:
        self.demand_rows.zero_()
        self.demand_expert_rows.zero_()

    def demand(self) -> torch.Tensor:
        """[rows to one rank, pairs on one rank's experts] of the step, on the device."""
        return torch.stack([self.demand_rows, self.demand_expert_rows])

    def fits(self, level: int, demand: Sequence[int]) -> bool:
        experts = self.expert_rows_at(level)
        return self.chunk_rows_at(level) >= demand[0] and (experts is None
                                                           or experts >= demand[1])

    def rerun_level(self, demand: Sequence[int]) -> Optional[int]:
        """None when the level in use holds `demand` (`demand()`, max over ranks), else the
        smallest level that does."""
        if self.fits(self.level, demand):
            return None
        return next(level for level in range(len(self.levels)) if self.fits(level, demand))


class Router(nn.Module):
    """Gate linear + score function + top-k, with Switch aux loss, z-loss and expert bias.

    The gate's weight grad is computed inline, never deferred: the gate is tiny (E x H) and
    its grad also carries the aux-loss terms, so deferring it would move no real work.

    State a checkpoint keeps: `expert_bias` and `balancing_rng` (the generator of
    --moe-router-force-load-balancing). `step_counts` / `step_aux_loss` / `step_dropped` are
    per-step scratch.

    Benchmark seam (no flag): `aux_loss_in_op` False computes the Switch aux loss with separate
    autograd ops even where the router op could fuse it (the in-process A/B of
    benchmarks/harness/bench_host.py --fusion-ab).

    Test seam (no flag): `logit_bias`, when set, is called with the gate logits [T, E] and
    returns a bias [T, E] added to them; the routing fuzz test forces adversarial routings with
    it (all tokens to one expert, one EP rank receiving everything, ...). Grads still flow
    through the gate.
    """

    def __init__(self, moe: MoEConfig, hidden: int, layer: int, ops: MoEOps, *, seed: int,
                 std: float, dtype: torch.dtype, device: torch.device, aux_loss_scale: float):
        super().__init__()
        num_experts = moe.num_experts
        self.mode = DispatchMode.of(moe)
        gate_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(moe.moe_router_dtype,
                                                                         dtype)
        self.moe, self.ops, self.layer = moe, ops, layer
        self.aux_loss_scale = aux_loss_scale
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=gate_dtype,
                                               device=device))
        seeded_normal_(self.weight, std, param_seed(seed, "router", layer))
        bias = torch.zeros(num_experts, device=device) if moe.moe_router_enable_expert_bias \
            else None
        self.register_buffer("expert_bias", bias)
        self.register_buffer("step_counts", torch.zeros(num_experts, dtype=torch.int64,
                                                        device=device))
        self.register_buffer("step_aux_loss", torch.zeros((), device=device))
        self.register_buffer("step_dropped", torch.zeros((), dtype=torch.int64, device=device))
        self.balancing_rng: Optional[torch.Generator] = None
        if moe.moe_router_force_load_balancing and torch.device(device).type != "meta":
            self.balancing_rng = torch.Generator(device=device)
            self.balancing_rng.manual_seed(param_seed(seed, "balance", layer) % (2**63))
        self.logit_bias: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.aux_loss_in_op = True

    def _logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        logits_TE = linear(x_TH.to(self.weight.dtype), self.weight)
        if self.balancing_rng is not None:  # benchmark mode: routing independent of the data
            noise = torch.randn(logits_TE.shape, device=logits_TE.device,
                                generator=self.balancing_rng, dtype=logits_TE.dtype)
            logits_TE = logits_TE * 0 + noise
        if self.logit_bias is not None:  # test seam: a forced routing
            logits_TE = logits_TE + self.logit_bias(logits_TE.detach())
        z_coeff = self.moe.moe_z_loss_coeff
        if z_coeff:
            z_loss = torch.mean(torch.square(torch.logsumexp(logits_TE.float(), dim=-1))) * z_coeff
            logits_TE = attach_aux_loss(logits_TE, z_loss, self.aux_loss_scale)
            self.step_aux_loss += z_loss.detach()
        return logits_TE

    def forward(self, x_TH: torch.Tensor):
        """x [T, H] -> probs [T, E], routing_map [T, E] bool, counts [E] int64 (after the
        capacity, if one is set; the aux loss sees the routing before it, as Megatron-core's)."""
        moe = self.moe
        logits_TE = self._logits(x_TH)
        aux_in_router = (moe.moe_aux_loss_coeff > 0 and self.aux_loss_in_op
                         and self._aux_counts_are_routing_counts())
        probs_TE, routing_map_TE, counts_E = self.ops.router_topk_with_counts(
            logits_TE, moe.moe_router_topk, score_function=moe.moe_router_score_function,
            use_pre_softmax=moe.moe_router_pre_softmax, num_groups=moe.moe_router_num_groups,
            group_topk=moe.moe_router_group_topk,
            scaling_factor=moe.moe_router_topk_scaling_factor, expert_bias=self.expert_bias,
            aux_loss=SwitchAuxLoss(moe.moe_aux_loss_coeff, self.aux_loss_scale,
                                   self.step_aux_loss) if aux_in_router else None)
        aux = None
        if moe.moe_aux_loss_coeff > 0 and not aux_in_router:
            scores_TE = aux_loss_scores(logits_TE, moe.moe_router_score_function)
            aux_counts_E = (counts_E if self._aux_counts_are_routing_counts()
                            else plain_topk_counts(scores_TE, moe.moe_router_topk))
            aux = switch_aux_loss(scores_TE, aux_counts_E, moe.moe_router_topk,
                                  moe.moe_aux_loss_coeff)
        if self.mode.drops_tokens:
            probs_TE, routing_map_TE, counts_E = self._apply_capacity(probs_TE, routing_map_TE)
        if aux is not None:
            probs_TE = attach_aux_loss(probs_TE, aux, self.aux_loss_scale)
            self.step_aux_loss += aux.detach()
        self.step_counts += counts_E
        return probs_TE, routing_map_TE, counts_E

    def _aux_counts_are_routing_counts(self) -> bool:
        """Whether the Switch aux loss's tokens per expert are the routing's own counts, so the
        router op can compute the loss itself (`SwitchAuxLoss`). Megatron-core counts them by a
        plain top-k of the aux scores; without group-limited routing or an expert bias that is
        the routing's own top-k (softmax and sigmoid keep the logits' order)."""
        return not self.moe.moe_router_num_groups and self.expert_bias is None

    def _apply_capacity(self, probs_TE, routing_map_TE):
        """Megatron-core's token dropping (and padding); counts the dropped pairs on device."""
        mode = self.mode
        final_probs_TE, final_map_TE = apply_router_token_dropping(
            probs_TE, routing_map_TE, self.moe.moe_router_topk, mode.capacity_factor,
            drop_policy=mode.drop_policy, pad_to_capacity=mode.pad_to_capacity)
        self.step_dropped += dropped_pairs(routing_map_TE, final_map_TE)
        return final_probs_TE, final_map_TE, expert_token_counts(final_map_TE)

    @torch.no_grad()
    def update_expert_bias(self, global_counts_E: torch.Tensor) -> None:
        """Aux-loss-free balancing, once per step: bias += rate * sign(mean - count)."""
        if self.expert_bias is None:
            return
        counts = global_counts_E.float()
        self.expert_bias += self.moe.moe_router_bias_update_rate * torch.sign(
            counts.mean() - counts)

    def reset_step_stats(self) -> None:
        self.step_counts.zero_()
        self.step_aux_loss.zero_()
        self.step_dropped.zero_()


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (dense layers and shared experts): down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn: int, *, seed: int, name: str, std: float,
                 out_std: float, dtype, device, ops: MoEOps, queue=None):
        super().__init__()
        self.queue, self.ops = queue, ops
        self.fc1 = nn.Parameter(torch.empty(2 * ffn, hidden, dtype=dtype, device=device))
        self.fc2 = nn.Parameter(torch.empty(hidden, ffn, dtype=dtype, device=device))
        seeded_normal_(self.fc1, std, param_seed(seed, name, "fc1"))
        seeded_normal_(self.fc2, out_std, param_seed(seed, name, "fc2"))

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        act_TF = self.ops.swiglu(linear(x_TH, self.fc1, self.queue))
        return linear(act_TF, self.fc2, self.queue)


class GroupedSwiGLUExperts(nn.Module):
    """This rank's L experts as grouped GEMMs; weights [L, H, 2F] and [L, F, H]."""

    def __init__(self, moe: MoEConfig, hidden: int, ffn: int, layer: int, ep_rank: int,
                 ep_size: int, *, seed: int, std: float, out_std: float, dtype, device,
                 ops: MoEOps, queue=None, sm_carveout: Optional[int] = None):
        super().__init__()
        local = moe.num_experts // ep_size
        self.queue, self.ops, self.sm_carveout = queue, ops, sm_carveout
        self.fc1 = nn.Parameter(torch.empty(local, hidden, 2 * ffn, dtype=dtype, device=device))
        self.fc2 = nn.Parameter(torch.empty(local, ffn, hidden, dtype=dtype, device=device))
        for e in range(local):  # seeded by the *global* expert index: same model for any EP
            global_e = ep_rank * local + e
            seeded_normal_(self.fc1.data[e], std, param_seed(seed, "expert", layer, global_e, 1))
            seeded_normal_(self.fc2.data[e], out_std,
                           param_seed(seed, "expert", layer, global_e, 2))
        for p in (self.fc1, self.fc2):
            p.is_expert = True

    def forward(self, x_MH, probs_M, counts_L: torch.Tensor,
                counts_host: Optional[list[int]]):
        """Rows sorted by local expert, counts_L [L] on the device. `counts_host` None: only the
        device knows the counts, and rows past the last expert's are padding (the budget
        dispatch): the GEMMs leave them unwritten, so they come out as zeros."""
        offsets_L = expert_offsets(counts_L)
        h_M2F = grouped_gemm(x_MH, self.fc1, offsets_L, counts_host, self.queue,
                             self.sm_carveout)
        act_MF = self.ops.swiglu(h_M2F, probs_M)  # probs applied here, in fp32
        out_MH = grouped_gemm(act_MF, self.fc2, offsets_L, counts_host, self.queue,
                              self.sm_carveout)
        if counts_host is None:
            row_M1 = torch.arange(out_MH.shape[0], device=out_MH.device).unsqueeze(1)
            out_MH = torch.where(row_M1 < offsets_L[-1:], out_MH, out_MH.new_zeros(()))
        return out_MH


@dataclass
class DispatchMeta:
    """What the steps after the dispatch need. Split sizes are host lists where the mode reads
    them on the host (dropless, capacity) or knows them from shapes (capacity_padded), None for
    equal chunks; `recv_counts_RL` is always on the device."""

    input_splits: Optional[list[int]]  # rows sent to each EP rank
    output_splits: Optional[list[int]]  # rows received from each EP rank
    recv_counts_RL: torch.Tensor  # [R, L] device: rows received per (source rank, local expert)
    tokens_per_local_expert: Optional[list[int]]  # host, summed over source ranks; None: device
    capacity: Optional[int] = None  # capacity_padded: rows per (rank, expert)
    chunk_rows: Optional[int] = None  # budget: rows per (source rank) chunk
    send_index: Optional[torch.Tensor] = None  # budget [R*C]: chunk slot -> permuted row or -1
    return_index: Optional[torch.Tensor] = None  # budget [N]: permuted row -> chunk slot or -1
    expert_rows: Optional[int] = None  # budget once per rank: the local experts' rows (static)


def _pick_rows(src_XH: torch.Tensor, index_Y: torch.Tensor) -> torch.Tensor:
    """out[y] = src[index[y]], a zero row where index[y] < 0."""
    picked_YH = src_XH.index_select(0, index_Y.clamp(min=0))
    return torch.where((index_Y >= 0).unsqueeze(1), picked_YH, picked_YH.new_zeros(()))


class _MoveRows(torch.autograd.Function):
    """Rows moved by an index whose valid entries are one-to-one (`inverse` maps back): the
    backward is the inverse move, a gather, so every grad is copied, never summed."""

    @staticmethod
    def forward(ctx, src_XH, index_Y, inverse_X):
        ctx.save_for_backward(inverse_X)
        return _pick_rows(src_XH, index_Y)

    @staticmethod
    def backward(ctx, grad_YH):
        (inverse_X,) = ctx.saved_tensors
        return _pick_rows(grad_YH, inverse_X), None, None


def move_rows(src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """`_MoveRows` for [X, H] rows or [X] values."""
    if src.dim() == 1:
        return _MoveRows.apply(src.unsqueeze(1), index, inverse).squeeze(1)
    return _MoveRows.apply(src, index, inverse)


def rows_per_rank(row_id_map_TR: torch.Tensor) -> torch.Tensor:
    """Once per rank: the rows sent to each rank, from the preprocess's [T, R] row-id map. [R]."""
    return (row_id_map_TR >= 0).sum(dim=0)


def rows_by_pair(row_id_map_TR: torch.Tensor, num_rows: int) -> torch.Tensor:
    """For each of `num_rows` permuted rows, the flat (t * R + r) entry of the row-id map that
    names it, -1 past the routed rows. [N] device, no host read: the map's row ids are distinct,
    so a stable sort of them lists the entries in row order."""
    unrouted = row_id_map_TR.numel()
    keys_X = torch.where(row_id_map_TR >= 0, row_id_map_TR, unrouted).reshape(-1)
    sorted_X, entry_X = torch.sort(keys_X, stable=True)
    return torch.where(sorted_X[:num_rows] < unrouted, entry_X[:num_rows], -1)


def budget_indices(send_R: torch.Tensor, chunk_rows: int, num_rows: int):
    """Permuted rows (expert-major, so rank r's rows are one run) <-> fixed chunks of
    `chunk_rows` slots per rank. -> (send_index [R*C]: slot -> row or -1 (empty),
    return_index [N]: row -> slot or -1 (cut: the rank's rows overflow the chunk))."""
    ranks, device = send_R.numel(), send_R.device
    end_R = torch.cumsum(send_R, 0)
    start_R = end_R - send_R
    slot_C = torch.arange(chunk_rows, device=device)
    send_RC = torch.where(slot_C < send_R.unsqueeze(1), start_R.unsqueeze(1) + slot_C, -1)
    row_N = torch.arange(num_rows, device=device)
    rank_N = torch.searchsorted(end_R, row_N, right=True)
    owned_N = rank_N < ranks
    rank_N = rank_N.clamp(max=ranks - 1)
    offset_N = row_N - start_R.index_select(0, rank_N)
    return_N = torch.where(owned_N & (offset_N < chunk_rows), rank_N * chunk_rows + offset_N, -1)
    return send_RC.reshape(-1), return_N


def kept_counts(recv_RL: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Rows of each (source rank, local expert) that fit the source's chunk (its first
    `chunk_rows` rows, in expert order). [R, L] device."""
    end_RL = torch.cumsum(recv_RL, 1)
    return end_RL.clamp(max=chunk_rows) - (end_RL - recv_RL).clamp(max=chunk_rows)


class AllToAllDispatcher:
    """All-to-all token dispatcher in one of the `DispatchMode`s, in the steps the scheduler
    runs as nodes."""

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device, mode: DispatchMode = DispatchMode(),
                 budget: Optional[DispatchBudget] = None):
        if (mode.name == "budget") != (budget is not None):
            raise ValueError(f"dispatch mode {mode.name} with budget {budget}")
        if mode.once_per_rank and mode.name == "capacity_padded":
            raise ValueError("dispatch once per rank with a padded capacity: its rows per rank "
                             "are not a fixed capacity")
        self.comm, self.ops, self.topk, self.mode, self.budget = comm, ops, topk, mode, budget
        # one rank: nothing to send once instead of several times
        self.once_per_rank = mode.once_per_rank and comm.size > 1
        if self.once_per_rank and budget is not None and budget.pairs is None:
            raise ValueError("dispatch once per rank with a budget that does not budget the "
                             "experts' rows (DispatchBudget pairs_per_dispatch)")
        self.num_experts = num_experts
        self.num_local = num_experts // comm.size
        ranks, local = comm.size, self.num_local
        # chunk order (rank, expert) -> (expert, rank), and back
        self._to_expert_major = _index([r * local + e for e in range(local)
                                        for r in range(ranks)], device)
        self._to_rank_major = _index([e * ranks + r for r in range(ranks)
                                      for e in range(local)], device)
        # budget: chunks (rank, expert or padding) -> experts' chunks, then padding; and back
        with_pad = local + 1
        self._budget_to_expert_major = _index(
            [r * with_pad + e for e in range(local) for r in range(ranks)]
            + [r * with_pad + local for r in range(ranks)], device)
        self._budget_to_rank_major = _index(
            [(e * ranks + r) if e < local else local * ranks + r
             for r in range(ranks) for e in range(with_pad)], device)

    @property
    def dispatch_syncs_host(self) -> bool:
        return self.mode.dispatch_syncs_host

    def permuted_rows(self, num_tokens: int) -> int:
        """Rows of the permuted tokens: experts x capacity padded, else tokens x topk (static:
        dropped pairs leave rows past the routed count at zero)."""
        if self.mode.pad_to_capacity:
            return padded_rows(num_tokens, self.topk, self.num_experts, self.mode.capacity_factor)
        if self.once_per_rank:  # a token reaches at most min(topk, R) ranks
            return num_tokens * min(self.topk, self.comm.size)
        return num_tokens * self.topk

    def preprocess(self, hidden_TH, probs_TE, routing_map_TE):
        """Permute token copies into expert-major rows, or once per rank into rank-major rows
        (a static row count). -> (rows [N, H], their probs [N] (or [N, L] once per rank, -1
        where not chosen), row-id map [T, E] (or [T, R]))."""
        num_out = self.permuted_rows(hidden_TH.shape[0])
        if self.once_per_rank:
            return self._preprocess_once_per_rank(hidden_TH, probs_TE, routing_map_TE, num_out)
        return self.ops.permute(hidden_TH, routing_map_TE, probs_TE, num_out_tokens=num_out,
                                drop_and_pad=self.mode.pad_to_capacity)

    def _preprocess_once_per_rank(self, hidden_TH, probs_TE, routing_map_TE, num_out: int):
        tokens, ranks = hidden_TH.shape[0], self.comm.size
        routing_map_TRL = routing_map_TE.view(tokens, ranks, self.num_local)
        to_rank_TR = routing_map_TRL.any(dim=2)
        permuted_NH, _, row_id_map_TR = self.ops.permute(hidden_TH, to_rank_TR, None,
                                                         num_out_tokens=num_out)
        chosen_probs_XL = torch.where(routing_map_TE, probs_TE, -1.0).view(
            tokens * ranks, self.num_local)  # X = (token, rank) pairs
        source_N = rows_by_pair(row_id_map_TR, num_out)
        permuted_probs_NL = move_rows(chosen_probs_XL, source_N, row_id_map_TR.reshape(-1))
        return permuted_NH, permuted_probs_NL, row_id_map_TR

    def start_split_exchange(self, counts_E, row_id_map=None) -> Optional[SplitExchange]:
        """Start the exchange of the split sizes a host-split dispatch reads (None for the
        modes that read none): called when the router has counted, so the exchange runs while
        other work is issued, and handed to `dispatch` (parallel.comm, `SplitExchange`). Once
        per rank, the preprocess's [T, R] `row_id_map` gives the rows per rank."""
        if not self.dispatch_syncs_host:
            return None
        rows_R = rows_per_rank(row_id_map) if self.once_per_rank else None
        return self.comm.start_split_exchange(counts_E, rows_R)

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E=None,
                 exchange: Optional[SplitExchange] = None, row_id_map=None):
        """All-to-all of tokens and probs: (recv_MH, recv_probs_M, DispatchMeta). A
        host-split mode takes the `exchange` started earlier, or starts it here from
        `counts_E`; the budget once per rank takes the preprocess's [T, R] `row_id_map`."""
        if self.mode.name == "capacity_padded":
            return self._dispatch_padded(permuted_NH, permuted_probs_N)
        if self.mode.name == "budget":
            return self._dispatch_budget(permuted_NH, permuted_probs_N, counts_E, row_id_map)
        if exchange is None:
            if self.once_per_rank:  # the rows per rank come from the preprocess's map
                raise ValueError("dispatch once per rank: pass the exchange that "
                                 "`start_split_exchange(counts_E, row_id_map)` started")
            exchange = self.comm.start_split_exchange(counts_E)
        return self._dispatch_host_splits(permuted_NH, permuted_probs_N, exchange)

    def _dispatch_host_splits(self, permuted_NH, permuted_probs_N, exchange: SplitExchange):
        """Read the exchanged split sizes on the host (the one host sync), then send."""
        send_R, recv_R, recv_L = exchange.read()
        meta = DispatchMeta(input_splits=send_R, output_splits=recv_R,
                            recv_counts_RL=exchange.recv_RL, tokens_per_local_expert=recv_L)
        routed = sum(meta.input_splits)
        if routed != permuted_NH.shape[0]:  # capacity: the dropped pairs' rows are not sent
            permuted_NH, permuted_probs_N = permuted_NH[:routed], permuted_probs_N[:routed]
        recv_MH = all_to_all(self.comm, permuted_NH, meta.output_splits, meta.input_splits)
        recv_probs_M = all_to_all(self.comm, permuted_probs_N, meta.output_splits,
                                  meta.input_splits)
        return recv_MH, recv_probs_M, meta

    def _dispatch_padded(self, permuted_NH, permuted_probs_N):
        """Every (rank, expert) pair holds `capacity` rows: sizes from shapes, no host read."""
        ranks, local = self.comm.size, self.num_local
        capacity = permuted_NH.shape[0] // self.num_experts
        splits = [local * capacity] * ranks
        meta = DispatchMeta(input_splits=splits, output_splits=splits,
                            recv_counts_RL=torch.full((ranks, local), capacity,
                                                      dtype=torch.int64,
                                                      device=permuted_NH.device),
                            tokens_per_local_expert=[ranks * capacity] * local,
                            capacity=capacity)
        recv_MH = all_to_all(self.comm, permuted_NH, splits, splits)
        recv_probs_M = all_to_all(self.comm, permuted_probs_N, splits, splits)
        return recv_MH, recv_probs_M, meta

    def _dispatch_budget(self, permuted_NH, permuted_probs_N, counts_E, row_id_map=None):
        """Fixed chunks of `chunk_rows` rows per rank; counts exchanged and kept on the device;
        a rank's rows past its chunk are cut and recorded (`DispatchBudget.note`). Once per
        rank the rows per rank come from the [T, R] `row_id_map`, no counts are exchanged:
        each received row's probs say which local experts it goes to (an empty slot: none)."""
        budget, num_rows = self.budget, permuted_NH.shape[0]
        if num_rows != budget.rows:
            raise RuntimeError(f"budget dispatch of {num_rows} rows, sized for {budget.rows}")
        chunk = budget.chunk_rows
        if self.once_per_rank:
            send_R = rows_per_rank(row_id_map)
        else:
            recv_RL = self.comm.exchange_counts(counts_E)  # equal splits: no host read
            send_R = counts_E.view(self.comm.size, self.num_local).sum(dim=1)
        budget.note(send_R)
        send_index, return_index = budget_indices(send_R, chunk, num_rows)
        send_XH = move_rows(permuted_NH, send_index, return_index)
        send_probs_X = move_rows(permuted_probs_N, send_index, return_index)
        if self.once_per_rank:  # an empty slot chooses no expert
            send_probs_X = torch.where((send_index >= 0).unsqueeze(1), send_probs_X, -1.0)
        recv_MH = all_to_all(self.comm, send_XH, None, None)
        recv_probs_M = all_to_all(self.comm, send_probs_X, None, None)
        expert_rows = None
        if self.once_per_rank:  # the pairs past the experts' budget are cut (and recorded)
            expert_rows = budget.expert_rows
            recv_probs_M = self._cut_expert_pairs(recv_probs_M, expert_rows)
            recv_counts_RL = (recv_probs_M >= 0).sum(dim=0, keepdim=True)
        else:
            recv_counts_RL = kept_counts(recv_RL, chunk)
        meta = DispatchMeta(input_splits=None, output_splits=None,
                            recv_counts_RL=recv_counts_RL, tokens_per_local_expert=None,
                            chunk_rows=chunk, send_index=send_index, return_index=return_index,
                            expert_rows=expert_rows)
        return recv_MH, recv_probs_M, meta

    def _cut_expert_pairs(self, probs_ML: torch.Tensor, expert_rows: int) -> torch.Tensor:
        """Once per rank under the budget: the (received row, local expert) pairs in the order
        the second permute gives them rows (expert-major), those past `expert_rows` unchosen
        (probs -1); their count is recorded for the rerun."""
        chosen_ML = probs_ML >= 0
        self.budget.note_expert_rows(chosen_ML.sum())
        if expert_rows >= probs_ML.shape[0] * min(self.topk, self.num_local):
            return probs_ML  # every pair fits: nothing to cut
        row_LM = torch.cumsum(chosen_ML.t().reshape(-1), 0).view(chosen_ML.shape[1], -1) - 1
        return torch.where(chosen_ML & (row_LM.t() < expert_rows), probs_ML, -1.0)

    def sort_by_expert(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        """Rows arrive (source rank, local expert); the experts want (local expert, rank).
        -> (rows, their probs, what `unsort` needs: the row-id map of the copy to the local
        experts once per rank, else None)."""
        if self.once_per_rank:
            chosen_ML = recv_probs_M >= 0
            rows = (meta.expert_rows if meta.tokens_per_local_expert is None  # the budget's
                    else sum(meta.tokens_per_local_expert))
            return self.ops.permute(recv_MH, chosen_ML,
                                    torch.where(chosen_ML, recv_probs_M, 0.0),
                                    num_out_tokens=rows)
        return self._sort_chunks(recv_MH, recv_probs_M, meta) + (None,)

    def _sort_chunks(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        if self.comm.size == 1:
            return recv_MH, recv_probs_M
        if meta.capacity is not None:  # equal blocks: a transpose (Megatron-core's)
            shape = (self.comm.size, self.num_local, meta.capacity)
            return _swap_blocks(recv_MH, shape), _swap_blocks(recv_probs_M, shape)
        if meta.chunk_rows is not None:
            return self.ops.sort_chunks_by_idxs(recv_MH, self._budget_chunks(meta).reshape(-1),
                                                self._budget_to_expert_major, recv_probs_M)
        return self.ops.sort_chunks_by_idxs(recv_MH, meta.recv_counts_RL.reshape(-1),
                                            self._to_expert_major, recv_probs_M)

    def unsort(self, expert_out_MH, meta: DispatchMeta, local_row_id_map=None):
        """Back to the order rows arrived in; once per rank, each received row sums its local
        experts' outputs (`local_row_id_map` from `sort_by_expert`)."""
        if self.once_per_rank:
            return self.ops.unpermute(expert_out_MH, local_row_id_map)
        if self.comm.size == 1:
            return expert_out_MH
        if meta.capacity is not None:
            return _swap_blocks(expert_out_MH, (self.num_local, self.comm.size, meta.capacity))
        if meta.chunk_rows is not None:
            sizes = self._budget_chunks(meta).reshape(-1).index_select(
                0, self._budget_to_expert_major)
            return self.ops.sort_chunks_by_idxs(expert_out_MH, sizes,
                                                self._budget_to_rank_major)[0]
        splits_LR = meta.recv_counts_RL.t().reshape(-1)
        return self.ops.sort_chunks_by_idxs(expert_out_MH, splits_LR, self._to_rank_major)[0]

    @staticmethod
    def _budget_chunks(meta: DispatchMeta) -> torch.Tensor:
        """[R, L + 1] rows of each received chunk: per local expert, then padding."""
        kept_RL = meta.recv_counts_RL
        pad_R1 = meta.chunk_rows - kept_RL.sum(dim=1, keepdim=True)
        return torch.cat([kept_RL, pad_R1], dim=1)

    def combine(self, expert_out_MH, meta: DispatchMeta, row_id_map_TE):
        """All-to-all back, then each token sums its rows (probs were applied by the experts)."""
        returned_NH = all_to_all(self.comm, expert_out_MH, meta.input_splits,
                                 meta.output_splits)
        if meta.chunk_rows is not None:
            returned_NH = move_rows(returned_NH, meta.return_index, meta.send_index)
        return self.ops.unpermute(returned_NH, row_id_map_TE)


def _swap_blocks(rows: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Rows as blocks [A, B, C] -> [B, A, C] (a transpose of the two outer block indices)."""
    blocks = rows.view(*shape, *rows.shape[1:]).transpose(0, 1)
    return blocks.reshape(rows.shape)


def _index(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
