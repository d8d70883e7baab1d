"""Seeded initialization: every parameter drawn from a generator of its own, seeded by the run's
seed and the parameter's name (`param_seed`), so a model's values do not depend on the order
its parameters are made in, the device count or the EP size; the vocabulary's weights, whose
padding rows are zero (`vocab_parameter`)."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from epoverlap.config import ModelConfig


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


def vocab_parameter(m: ModelConfig, seed: int, name: str, dtype: torch.dtype,
                    device: torch.device) -> nn.Parameter:
    """The embedding's or output head's [padded V, H] weight: its first V rows drawn as an
    unpadded model's whole tensor is (the same values, so a padded run starts from the
    unpadded one's weights), the padding rows zero (never looked up, out of the softmax)."""
    weight = torch.empty(m.padded_vocab_size, m.hidden_size, dtype=dtype, device=device)
    seeded_normal_(weight[:m.vocab_size], m.init_method_std, param_seed(seed, name))
    if weight.device.type != "meta":
        with torch.no_grad():
            weight[m.vocab_size:].zero_()
    return nn.Parameter(weight)
