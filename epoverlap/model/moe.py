"""The MoE layer's compute pieces: router and grouped SwiGLU experts (the dispatch between them
is `model.dispatch`).

Owns `Router` (gate, score function, top-k, aux losses, capacity, expert bias and its per-step
update), `GroupedSwiGLUExperts` and `SwiGLU` (dense / shared MLP); their seeded init is
`model.init`'s. The routing ops come from an
`MoEOps` table chosen once by config (torch or Triton).

With a capacity (`DispatchMode.drops_tokens`, Megatron-core's --moe-expert-capacity-factor) the
router drops routed (token, expert) pairs beyond an expert's capacity and counts them
(`step_dropped`); with --moe-pad-expert-input-to-capacity it also pads every expert to its
capacity with unrouted tokens of prob 0.

Probabilities are applied inside the expert activation (h = silu(gate) * up * prob, in fp32),
so the combine's unpermute sums rows without merging probs.

Shape legend: T local tokens, H hidden, E global experts, L local experts (E / ep), M rows
received by this rank, F expert FFN width.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from epoverlap.kernels import MoEOps
from epoverlap.kernels.capacity import apply_router_token_dropping, dropped_pairs
from epoverlap.kernels.router_topk import (SwitchAuxLoss, attach_aux_loss, aux_loss_scores,
                                          expert_token_counts, plain_topk_counts,
                                          seq_aux_loss, switch_aux_loss)

from epoverlap.config import MoEConfig
from epoverlap.config.dispatch import DispatchMode
from epoverlap.model.init import param_seed, seeded_normal_
from epoverlap.model.linear import expert_offsets, grouped_gemm, linear
from epoverlap.parallel.comm import ContextComm


class Router(nn.Module):
    """Gate linear + score function + top-k, with the Switch aux loss (over the microbatch or
    per sequence, --moe-router-load-balancing-type), z-loss and expert bias.

    The gate's weight grad is computed inline, never deferred: the gate is tiny (E x H) and
    its grad also carries the aux-loss terms, so deferring it would move no real work.

    State a checkpoint keeps: `expert_bias` and `balancing_rng` (the generator of
    --moe-router-force-load-balancing, seeded by the layer and the data-parallel rank whose
    tokens this router routes, so ranks route differently, as learned routers do; each forward
    draws once, in microbatch order, whatever the schedule). `step_counts` / `step_aux_loss` / `step_dropped` are
    per-step scratch.

    Measurement seam (no flag): `aux_loss_in_op` False computes the Switch aux loss with
    separate autograd ops even where the router op could fuse it, so the host time the fusion
    saves can be measured in one process against the fused router.

    Test seam (no flag): `logit_bias`, when set, is called with the gate logits [T, E] and
    returns a bias [T, E] added to them; the routing fuzz test forces adversarial routings with
    it (all tokens to one expert, one EP rank receiving everything, ...). Grads still flow
    through the gate.
    """

    def __init__(self, moe: MoEConfig, hidden: int, layer: int, ops: MoEOps, *, seed: int,
                 std: float, dtype: torch.dtype, device: torch.device, aux_loss_scale: float,
                 mode: DispatchMode, data_rank: int, seq_length: int = 0,
                 cp_comm: Optional[ContextComm] = None):
        """`mode`: the model's dispatch mode (built once from the config), for its capacity;
        `data_rank`: the data-parallel rank whose tokens this router routes (seeds the forced
        balance's draw); `seq_length`: the tokens of a sequence (seq_aux_loss's unit);
        `cp_comm`: the CP group, over which the aux loss counts tokens per expert
        (`_aux_loss`; seq_aux_loss is refused under CP)."""
        super().__init__()
        num_experts = moe.num_experts
        self.mode = mode
        gate_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(moe.moe_router_dtype,
                                                                         dtype)
        self.moe, self.ops, self.layer = moe, ops, layer
        self.aux_loss_scale, self.seq_length = aux_loss_scale, seq_length
        self.cp_comm = cp_comm
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
            self.balancing_rng.manual_seed(param_seed(seed, "balance", layer, data_rank)
                                           % (2**63))
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
        per_sequence = moe.moe_router_load_balancing_type == "seq_aux_loss"
        aux_in_router = (moe.moe_aux_loss_coeff > 0 and self.aux_loss_in_op
                         and self._aux_counts_are_routing_counts() and not per_sequence
                         and self.cp_comm is None)
        probs_TE, routing_map_TE, counts_E = self.ops.router_topk_with_counts(
            logits_TE, moe.moe_router_topk, score_function=moe.moe_router_score_function,
            use_pre_softmax=moe.moe_router_pre_softmax, num_groups=moe.moe_router_num_groups,
            group_topk=moe.moe_router_group_topk,
            scaling_factor=moe.moe_router_topk_scaling_factor, expert_bias=self.expert_bias,
            aux_loss=SwitchAuxLoss(moe.moe_aux_loss_coeff, self.aux_loss_scale,
                                   self.step_aux_loss) if aux_in_router else None)
        aux = None
        if moe.moe_aux_loss_coeff > 0 and not aux_in_router:
            aux = self._aux_loss(logits_TE, counts_E, per_sequence)
        if self.mode.drops_tokens:
            probs_TE, routing_map_TE, counts_E = self._apply_capacity(probs_TE, routing_map_TE)
        if aux is not None:
            probs_TE = attach_aux_loss(probs_TE, aux, self.aux_loss_scale)
            self.step_aux_loss += aux.detach()
        self.step_counts += counts_E
        return probs_TE, routing_map_TE, counts_E

    def _aux_loss(self, logits_TE: torch.Tensor, counts_E: torch.Tensor,
                  per_sequence: bool) -> torch.Tensor:
        """The aux loss by separate ops (Megatron-core's formulas). Under context parallelism
        the Switch loss's tokens per expert are the whole sequence's (summed over the CP group,
        as Megatron-core sums them over its TP x CP group) and the probabilities this rank's:
        the CP ranks' mean is then the aux loss of the whole sequence on one rank."""
        moe = self.moe
        scores_TE = aux_loss_scores(logits_TE, moe.moe_router_score_function)
        if per_sequence:
            return seq_aux_loss(scores_TE, moe.moe_router_topk, moe.moe_aux_loss_coeff,
                                self.seq_length)
        aux_counts_E = (counts_E if self._aux_counts_are_routing_counts()
                        else plain_topk_counts(scores_TE, moe.moe_router_topk))
        counted = None
        if self.cp_comm is not None:
            aux_counts_E = self.cp_comm.sum(aux_counts_E)
            counted = scores_TE.shape[0] * self.cp_comm.size
        return switch_aux_loss(scores_TE, aux_counts_E, moe.moe_router_topk,
                               moe.moe_aux_loss_coeff, counted)

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
                counts_host: Optional[list[int]], experts: Optional[tuple[int, int]] = None):
        """Rows sorted by local expert, counts_L [L] on the device. `counts_host` None: only the
        device knows the counts, and rows past the last expert's are padding (the budget
        dispatch): the GEMMs leave them unwritten, so they are zeroed here (`MoEOps.
        zero_rows_from`: the Triton op writes the zeros into the GEMM's output, which nothing
        else holds, and leaves its other rows alone). `experts` (a, b): the rows are local
        experts a..b-1's only (a wave, `model.waves`), counts theirs."""
        offsets_L = expert_offsets(counts_L)
        h_M2F = grouped_gemm(x_MH, self.fc1, offsets_L, counts_host, self.queue,
                             self.sm_carveout, experts, self.ops.grouped_weight_grad)
        act_MF = self.ops.swiglu(h_M2F, probs_M)  # probs applied here, in fp32
        out_MH = grouped_gemm(act_MF, self.fc2, offsets_L, counts_host, self.queue,
                              self.sm_carveout, experts, self.ops.grouped_weight_grad)
        if counts_host is None:
            out_MH = self.ops.zero_rows_from(out_MH, offsets_L[-1:])
        return out_MH
