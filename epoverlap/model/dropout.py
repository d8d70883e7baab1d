"""Dropout whose masks depend on what is dropped, never on when it runs (issue 47).

Owns the seeds of --attention-dropout and --hidden-dropout and the two draws. Semantics are
Megatron-LM's: attention dropout on the attention probabilities (SDPA's `dropout_p`), hidden
dropout on the attention block's output and on the MLP / MoE block's output before each
residual add; inverted scaling (kept values times 1 / (1 - p)); nothing in eval mode and
nothing at p = 0 (no draw, no extra op: the default path runs exactly the ops it ran before).

Why explicit seeds: the executor runs a node's forward whenever the plan says, interleaving
microbatches (the combined 1F1B) and lanes (a CUDA stream, or a CPU worker thread for the comm
nodes), so a draw from torch's global RNG would give each schedule different masks. Here every
mask is a function of (run seed, step, data-parallel rank, microbatch, layer, site) only:

- `StepRunner.microbatches` puts `microbatch_seed(run seed, step, dp rank, microbatch)` into
  each microbatch dict under `DROPOUT_SEED` (`dropout_inputs`), beside tokens and labels: the
  same identity the data of that microbatch is drawn from. It reaches the nodes that drop
  (attn, and mlp or combine) as a named input like any other value (`model.nodes`); a model
  without dropout declares no such input and its microbatches carry no seed.
- Each draw mixes that seed with its layer and site (`draw_seed`) into a fresh generator's seed.
  Hidden dropout draws its mask from a `torch.Generator` of its own (`hidden_dropout`), so it
  never touches the global RNG: the MoE combine node, which runs on the comm lane (the CPU comm
  thread), draws its mask there safely.
- SDPA takes no generator, so attention dropout seeds the default generator of the tensors'
  device for the one SDPA call and gives it its state back right after (`seeded_default_rng`).
  SDPA keeps what its backward needs (the math path saves the dropped probabilities through
  autograd; the flash / efficient / cuDNN kernels save their Philox seed and offset), so the
  backward, whenever the plan runs it, never reads the RNG again. This runs in the attn node,
  on the compute lane (the main thread on CPU); no node on the comm lane draws from the global
  generators, so the brief reseed cannot race with another draw.

A rerun of a step (the budget dispatch's) and a run resumed from a checkpoint draw the same
masks: nothing here has state.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from epoverlap.config import ModelConfig

DROPOUT_SEED = "dropout_seed"  # the microbatch-wide value name of a microbatch's dropout seed

# draw sites of a layer
ATTENTION_PROBS = "attention_probs"
ATTENTION_OUT = "attention_out"
MLP_OUT = "mlp_out"


def uses_dropout(model: ModelConfig) -> bool:
    """Whether the model drops anything in training (then its microbatches carry a seed)."""
    return model.attention_dropout > 0 or model.hidden_dropout > 0


def _mix(*keys: object) -> int:
    """A 63-bit seed from `keys` (a stable hash: the same on every rank, run and platform)."""
    text = "/".join(str(key) for key in keys).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def microbatch_seed(run_seed: int, step: int, rank: int, microbatch: int) -> int:
    """The dropout seed of microbatch `microbatch` of step `step` on data-parallel rank `rank`."""
    return _mix("dropout", run_seed, step, rank, microbatch)


def dropout_inputs(model: ModelConfig, run_seed: int, step: int, rank: int,
                   microbatch: int) -> dict:
    """What a microbatch dict carries for dropout: {DROPOUT_SEED: seed}, or {} without it
    (`run_seed`: --seed)."""
    if not uses_dropout(model):
        return {}
    return {DROPOUT_SEED: microbatch_seed(run_seed, step, rank, microbatch)}


def draw_seed(seed: Optional[int], layer: int, site: str) -> int:
    """The seed of one draw: a microbatch's seed mixed with the layer and the site."""
    if seed is None:
        raise ValueError("a training forward with dropout needs its microbatch's dropout seed "
                         f"(the {DROPOUT_SEED!r} input: StepRunner.microbatches makes it)")
    return _mix(seed, layer, site)


def hidden_dropout(x: torch.Tensor, p: float, seed: Optional[int], layer: int,
                   site: str) -> torch.Tensor:
    """`x` with each element zeroed with probability p and the rest scaled by 1 / (1 - p);
    `x` itself at p = 0. The mask comes from a generator of its own (see the module doc) and
    is kept as bools for the backward."""
    if p == 0.0:
        return x
    generator = torch.Generator(device=x.device)
    generator.manual_seed(draw_seed(seed, layer, site))
    keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p, generator=generator)
    return x * keep * (1.0 / (1.0 - p))


@contextlib.contextmanager
def seeded_default_rng(device: torch.device, seed: int) -> Iterator[None]:
    """The default generator of `device` seeded with `seed` for the body, its state restored
    after (only that one generator: `torch.manual_seed` would reseed every GPU)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
    else:
        generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(state)


def grouped_kv(q_BQSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor):
    """(K, V, whether SDPA groups them): grouped-query K/V as they are, except fp32 on CUDA,
    expanded to the query heads (see `causal_attention`)."""
    gqa = k_BGSD.shape[1] != q_BQSD.shape[1]
    if gqa and q_BQSD.is_cuda and q_BQSD.dtype == torch.float32:
        repeat = q_BQSD.shape[1] // k_BGSD.shape[1]
        return (k_BGSD.repeat_interleave(repeat, dim=1), v_BGSD.repeat_interleave(repeat, dim=1),
                False)
    return k_BGSD, v_BGSD, gqa


def causal_attention(q_BQSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, *,
                     p: float, seed: Optional[int], layer: int) -> torch.Tensor:
    """Causal SDPA (grouped-query when K/V have fewer heads than Q), with dropout p on the
    attention probabilities drawn from `seed` (see the module doc); the plain call at p = 0.

    Grouped K/V go into SDPA as they are, except fp32 on CUDA: no fused kernel takes them
    there (flash attention is 16-bit only), and SDPA's math fallback keeps the S x S scores of
    every head for the backward, so K/V are expanded to the query heads for the
    memory-efficient kernel."""
    k_BGSD, v_BGSD, gqa = grouped_kv(q_BQSD, k_BGSD, v_BGSD)
    if p == 0.0:
        return F.scaled_dot_product_attention(q_BQSD, k_BGSD, v_BGSD, is_causal=True,
                                              enable_gqa=gqa)
    with seeded_default_rng(q_BQSD.device, draw_seed(seed, layer, ATTENTION_PROBS)):
        return F.scaled_dot_product_attention(q_BQSD, k_BGSD, v_BGSD, dropout_p=p,
                                              is_causal=True, enable_gqa=gqa)
