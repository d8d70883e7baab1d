"""Packed samples on one process (pure CPU): --reset-position-ids and --reset-attention-mask
(`model.documents`) make each document of a packed sample the same to the model as that
document alone at the start of a sample: the same logits, up to fp32 rounding."""

from __future__ import annotations

import torch

from epoverlap.config import parse_config
from epoverlap.kernels import make_moe_ops
from epoverlap.model.documents import Documents
from epoverlap.model.linear import linear
from epoverlap.model.nodes import hidden_value
from epoverlap.model.transformer import MoEModel
from epoverlap.parallel.comm import ExpertComm

from gloo_workers import TINY

EOD, SEQ = 60, 32
DOCS = [[5, 7, 1, 3, 9, 11], [2, 2, 8, 4, 6, 1, 13, 12, 10], [3, 1, 4, 1, 5, 9, 2, 6]]


def _model(documents) -> MoEModel:
    cfg = parse_config(TINY).with_vocab_size(EOD + 1)
    return MoEModel(cfg.model, cfg.moe, cfg.model_options(),
                    ExpertComm(None, 1), 0, make_moe_ops("torch"), dtype=torch.float32,
                    device=torch.device("cpu"), documents=documents).eval()


def _logits(model: MoEModel, tokens_BS: torch.Tensor) -> torch.Tensor:
    """[B, S, V] the model's logits, through its nodes (the loss node's head, no loss)."""
    values = {"tokens": tokens_BS}
    for spec in model.node_specs():
        if spec.name == "loss":
            break
        out = spec.fn(**{local: values[name] for local, name in spec.inputs.items()})
        values.update({spec.outputs[local]: value for local, value in out.items()})
    hidden = values[hidden_value(len(model.layers))]
    return linear(model.final_norm(hidden), model.head).view(*tokens_BS.shape, -1)


def _samples() -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """One packed sample of DOCS (each ended by EOD, the rest filler), and each document
    alone at the start of a sample; the packed sample's offset of each."""
    packed, offsets = [], []
    for doc in DOCS:
        offsets.append(len(packed))
        packed += doc + [EOD]
    filler = [7] * (SEQ - len(packed))
    alone = [torch.tensor([doc + [EOD] + [7] * (SEQ - len(doc) - 1)]) for doc in DOCS]
    return torch.tensor([packed + filler]), alone, offsets


def test_a_packed_document_is_the_document_alone():
    """Both flags: each document's logits (its tokens and its end) are those of the document
    alone; without them a later document sees the earlier ones."""
    packed, alone, offsets = _samples()
    with torch.no_grad():
        model = _model(Documents(EOD, reset_positions=True, reset_mask=True, capacity=64))
        whole = _logits(model, packed)[0]
        plain = _logits(_model(None), packed)[0]
        for doc, sample, start in zip(DOCS, alone, offsets):
            mine = _logits(model, sample)[0, :len(doc) + 1]
            theirs = whole[start:start + len(doc) + 1]
            assert torch.allclose(mine, theirs, atol=2e-5), (mine - theirs).abs().max()
            if start:  # without the rules the later documents see the earlier ones
                assert not torch.allclose(plain[start:start + len(doc) + 1], theirs, atol=1e-3)


def test_documents_end_at_each_end_of_document_token_as_megatron_lm_s():
    rules = Documents(9, reset_positions=True, reset_mask=True, capacity=64)
    tokens = torch.tensor([[1, 2, 9, 3, 4, 5, 9, 6]])
    assert rules.ids(tokens).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert rules.positions(tokens).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    positions = torch.arange(8)
    seen = rules.visible(rules.ids(tokens), positions, positions)[0, 0]
    assert seen[4].tolist() == [False, False, False, True, True, False, False, False]
    kept = Documents(9, reset_positions=False, reset_mask=False, capacity=64)
    assert kept.positions(tokens).tolist() == [list(range(8))]
    assert kept.visible(kept.ids(tokens), positions, positions)[0, 0, 4].sum() == 5
