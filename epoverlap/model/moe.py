"""The MoE layer's pieces: router, dropless all-to-all dispatcher, grouped SwiGLU experts.

Owns `Router` (gate, score function, top-k, aux losses, expert bias and its per-step update),
`AllToAllDispatcher` (preprocess, dispatch, sort-by-expert, unsort, combine: the steps the
scheduler runs as separate nodes), `GroupedSwiGLUExperts` and `SwiGLU` (dense / shared MLP).
The routing ops come from an `MoEOps` table chosen once by config (torch or Triton).

Probabilities are applied inside the expert activation (h = silu(gate) * up * prob, in fp32),
so the combine's unpermute sums rows without merging probs.

Shape legend: T local tokens, H hidden, E global experts, L local experts (E / ep), R EP ranks,
N = T * topk permuted rows, M rows received by this rank, F expert FFN width.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from epoverlap_kernels import MoEOps
from epoverlap_kernels.router_topk import aux_loss_scores

from epoverlap.parallel.comm import ExpertComm, all_to_all
from epoverlap.config import MoEConfig
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


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `x`; its backward also starts the aux loss's backward with grad `scale`."""

    @staticmethod
    def forward(ctx, x, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad_x):
        (aux_loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(aux_loss, ctx.scale), None


def switch_aux_loss(scores_TE: torch.Tensor, counts_E: torch.Tensor, topk: int,
                    coeff: float) -> torch.Tensor:
    """Switch load-balancing loss: E * sum_e f_e * P_e * coeff (Megatron-core's formula)."""
    num_tokens, num_experts = scores_TE.shape
    scale = num_experts * coeff / (topk * num_tokens * num_tokens)
    return torch.sum(scores_TE.sum(dim=0) * counts_E.to(scores_TE.dtype)) * scale


class Router(nn.Module):
    """Gate linear + score function + top-k, with Switch aux loss, z-loss and expert bias.

    The gate's weight grad is computed inline, never deferred: the gate is tiny (E x H) and
    its grad also carries the aux-loss terms, so deferring it would move no real work.

    State a checkpoint keeps: `expert_bias` and `balancing_rng` (the generator of
    --moe-router-force-load-balancing). `step_counts` / `step_aux_loss` are per-step scratch.

    Test seam (no flag): `logit_bias`, when set, is called with the gate logits [T, E] and
    returns a bias [T, E] added to them; the routing fuzz test forces adversarial routings with
    it (all tokens to one expert, one EP rank receiving everything, ...). Grads still flow
    through the gate.
    """

    def __init__(self, moe: MoEConfig, hidden: int, layer: int, ops: MoEOps, *, seed: int,
                 std: float, dtype: torch.dtype, device: torch.device, aux_loss_scale: float):
        super().__init__()
        num_experts = moe.num_experts
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
        self.balancing_rng: Optional[torch.Generator] = None
        if moe.moe_router_force_load_balancing and torch.device(device).type != "meta":
            self.balancing_rng = torch.Generator(device=device)
            self.balancing_rng.manual_seed(param_seed(seed, "balance", layer) % (2**63))
        self.logit_bias: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

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
            logits_TE = _AttachAuxLoss.apply(logits_TE, z_loss, self.aux_loss_scale)
            self.step_aux_loss += z_loss.detach()
        return logits_TE

    def forward(self, x_TH: torch.Tensor):
        """x [T, H] -> probs [T, E], routing_map [T, E] bool, counts [E] int64."""
        moe = self.moe
        logits_TE = self._logits(x_TH)
        probs_TE, routing_map_TE, counts_E = self.ops.router_topk_with_counts(
            logits_TE, moe.moe_router_topk, score_function=moe.moe_router_score_function,
            use_pre_softmax=moe.moe_router_pre_softmax, num_groups=moe.moe_router_num_groups,
            group_topk=moe.moe_router_group_topk,
            scaling_factor=moe.moe_router_topk_scaling_factor, expert_bias=self.expert_bias)
        if moe.moe_aux_loss_coeff > 0:
            scores_TE = aux_loss_scores(logits_TE, moe.moe_router_score_function)
            aux = switch_aux_loss(scores_TE, counts_E, moe.moe_router_topk, moe.moe_aux_loss_coeff)
            probs_TE = _AttachAuxLoss.apply(probs_TE, aux, self.aux_loss_scale)
            self.step_aux_loss += aux.detach()
        self.step_counts += counts_E
        return probs_TE, routing_map_TE, counts_E

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
                 ops: MoEOps, queue=None):
        super().__init__()
        local = moe.num_experts // ep_size
        self.queue, self.ops = queue, ops
        self.fc1 = nn.Parameter(torch.empty(local, hidden, 2 * ffn, dtype=dtype, device=device))
        self.fc2 = nn.Parameter(torch.empty(local, ffn, hidden, dtype=dtype, device=device))
        for e in range(local):  # seeded by the *global* expert index: same model for any EP
            global_e = ep_rank * local + e
            seeded_normal_(self.fc1.data[e], std, param_seed(seed, "expert", layer, global_e, 1))
            seeded_normal_(self.fc2.data[e], out_std,
                           param_seed(seed, "expert", layer, global_e, 2))
        for p in (self.fc1, self.fc2):
            p.is_expert = True

    def forward(self, x_MH, probs_M, counts_L: torch.Tensor, counts_host: list[int]):
        offsets_L = expert_offsets(counts_L)
        h_M2F = grouped_gemm(x_MH, self.fc1, offsets_L, counts_host, self.queue)
        act_MF = self.ops.swiglu(h_M2F, probs_M)  # probs applied here, in fp32
        return grouped_gemm(act_MF, self.fc2, offsets_L, counts_host, self.queue)


@dataclass
class DispatchMeta:
    """Host-side split sizes from the one host sync of the dispatch, plus device counts."""

    input_splits: list[int]  # rows sent to each EP rank
    output_splits: list[int]  # rows received from each EP rank
    recv_counts_RL: torch.Tensor  # [R, L] device: rows received per (source rank, local expert)
    tokens_per_local_expert: list[int]  # host, summed over source ranks


class AllToAllDispatcher:
    """Dropless all-to-all token dispatcher, in the steps the scheduler runs as nodes."""

    def __init__(self, comm: ExpertComm, num_experts: int, topk: int, ops: MoEOps,
                 device: torch.device):
        self.comm, self.ops, self.topk = comm, ops, topk
        self.num_local = num_experts // comm.size
        ranks, local = comm.size, self.num_local
        # chunk order (rank, expert) -> (expert, rank), and back
        self._to_expert_major = torch.tensor([r * local + e for e in range(local)
                                              for r in range(ranks)], device=device)
        self._to_rank_major = torch.tensor([e * ranks + r for r in range(ranks)
                                            for e in range(local)], device=device)

    def preprocess(self, hidden_TH, probs_TE, routing_map_TE):
        """Permute token copies into expert-major rows (N = T * topk, static)."""
        num_out = hidden_TH.shape[0] * self.topk
        return self.ops.permute(hidden_TH, routing_map_TE, probs_TE, num_out_tokens=num_out)

    def dispatch(self, permuted_NH, permuted_probs_N, counts_E):
        """Exchange split sizes (the one host sync), then all-to-all tokens and probs."""
        recv_RL = self.comm.exchange_counts(counts_E)
        send_R = counts_E.view(self.comm.size, self.num_local).sum(dim=1)
        host = torch.cat([send_R, recv_RL.sum(dim=1), recv_RL.sum(dim=0)]).tolist()
        ranks = self.comm.size
        meta = DispatchMeta(input_splits=host[:ranks], output_splits=host[ranks:2 * ranks],
                            recv_counts_RL=recv_RL, tokens_per_local_expert=host[2 * ranks:])
        recv_MH = all_to_all(self.comm, permuted_NH, meta.output_splits, meta.input_splits)
        recv_probs_M = all_to_all(self.comm, permuted_probs_N, meta.output_splits,
                                  meta.input_splits)
        return recv_MH, recv_probs_M, meta

    def sort_by_expert(self, recv_MH, recv_probs_M, meta: DispatchMeta):
        """Rows arrive (source rank, local expert); the experts want (local expert, rank)."""
        if self.comm.size == 1:
            return recv_MH, recv_probs_M
        return self.ops.sort_chunks_by_idxs(recv_MH, meta.recv_counts_RL.reshape(-1),
                                            self._to_expert_major, recv_probs_M)

    def unsort(self, expert_out_MH, meta: DispatchMeta):
        if self.comm.size == 1:
            return expert_out_MH
        splits_LR = meta.recv_counts_RL.t().reshape(-1)
        return self.ops.sort_chunks_by_idxs(expert_out_MH, splits_LR, self._to_rank_major)[0]

    def combine(self, expert_out_MH, meta: DispatchMeta, row_id_map_TE):
        """All-to-all back, then each token sums its rows (probs were applied by the experts)."""
        returned_NH = all_to_all(self.comm, expert_out_MH, meta.input_splits,
                                 meta.output_splits)
        return self.ops.unpermute(returned_NH, row_id_map_TE)
