"""The per-sequence aux loss (--moe-router-load-balancing-type seq_aux_loss, DeepSeek-V3's)
against megatron-core 0.16.1's own code: `TopKRouter._apply_seq_aux_loss` on the scores and
routing map of its `compute_routing_scores_for_aux_loss`, as its router calls them (tokens
sequence-major there, [S x B, E]; batch-major here, [B x S, E]). The same loss and the same
grad into the logits, to fp32 rounding. Needs megatron-core (`pip install -e ".[peer]"`);
without it the comparison skips."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epoverlap.kernels.router_topk import aux_loss_scores, seq_aux_loss, switch_aux_loss
from test_megatron_signatures import moe_utils  # noqa: F401  (fixture)

SEQ, BATCH, EXPERTS, TOPK, COEFF = 12, 3, 8, 2, 1e-2


@pytest.fixture
def megatron_seq_aux_loss(moe_utils, monkeypatch):
    """Megatron-core's `_apply_seq_aux_loss` on a router of these sizes, returning the loss it
    attaches. Its tensor-parallel group is of one rank: the counts' all-reduce over it is the
    identity (as `mappings._reduce` makes it for a group of one; without torch.distributed
    initialized it would look the group up)."""
    from megatron.core.transformer.moe.router import TopKRouter
    monkeypatch.setattr(moe_utils, "reduce_from_tensor_model_parallel_region",
                        lambda tensor, group=None: tensor)

    class Router:
        routing_type, topk = "seq_aux_loss", TOPK
        config = SimpleNamespace(moe_aux_loss_coeff=COEFF, num_moe_experts=EXPERTS,
                                 moe_router_fusion=False)
        tp_cp_group = SimpleNamespace(size=lambda: 1)
        get_aux_loss_coeff = TopKRouter.get_aux_loss_coeff

        def attach_and_log_load_balancing_loss(self, probs, coeff, aux_loss, *args, **kwargs):
            self.loss = aux_loss
            return probs

    def loss(logits_SBE: torch.Tensor, score_function: str) -> torch.Tensor:
        router = Router()
        logits = logits_SBE.reshape(SEQ * BATCH, EXPERTS)
        routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(
            logits, TOPK, score_function)
        TopKRouter._apply_seq_aux_loss(router, logits, scores, routing_map, SEQ, BATCH)
        return router.loss
    return loss


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(SEQ, BATCH, EXPERTS, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("seed", [0, 1])
def test_seq_aux_loss_matches_megatron_core(megatron_seq_aux_loss, score_function, seed):
    theirs_SBE = _logits(seed).requires_grad_()
    ours_SBE = theirs_SBE.detach().clone().requires_grad_()
    theirs = megatron_seq_aux_loss(theirs_SBE, score_function)
    scores_TE = aux_loss_scores(ours_SBE.transpose(0, 1).reshape(BATCH * SEQ, EXPERTS),
                                score_function)
    ours = seq_aux_loss(scores_TE, TOPK, COEFF, SEQ)
    torch.testing.assert_close(ours, theirs)
    theirs.backward()
    ours.backward()
    torch.testing.assert_close(ours_SBE.grad, theirs_SBE.grad)


def test_seq_aux_loss_is_the_mean_of_each_sequence_s_switch_loss():
    """One sequence: the Switch loss with its plain top-k counts; several: their mean (a
    different loss from the Switch loss over the whole microbatch, unless balanced alike)."""
    scores_TE = aux_loss_scores(_logits(2).transpose(0, 1).reshape(-1, EXPERTS), "softmax")
    per_sequence = []
    for scores_SE in scores_TE.view(BATCH, SEQ, EXPERTS):
        top = torch.topk(scores_SE, TOPK, dim=1).indices
        counts = torch.zeros_like(scores_SE, dtype=torch.bool).scatter(1, top, True).sum(0)
        per_sequence.append(switch_aux_loss(scores_SE, counts, TOPK, COEFF))
        torch.testing.assert_close(seq_aux_loss(scores_SE, TOPK, COEFF, SEQ), per_sequence[-1])
    torch.testing.assert_close(seq_aux_loss(scores_TE, TOPK, COEFF, SEQ),
                               torch.stack(per_sequence).mean())
