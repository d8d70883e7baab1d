"""Memory estimate of a training run, per rank, checked against the device (or host) memory
before anything is allocated.

Owns `estimate_memory` (weights, fp32 grads, fp32 masters and AdamW state of this rank's
parameters; activations of the microbatches in flight; the backward's transient grads),
`check_memory`, which refuses a run that cannot fit with one line naming the flags that drive
the estimate, and `place_expert_grads`, the one place that decides whether the experts' weight
grads are paired over microbatches (below).

Per token of one microbatch (b = bytes of the model dtype; Q/G query/key-value heads, D head
dim, k top-k, E experts, Fe expert FFN, V vocab padded to --make-vocab-size-divisible-by, as
the embedding, output layer and logits are), the activations kept for the backward are
counted as the model makes them (model/transformer.py, model/moe.py):
  attention  b x (4H + (Q+2G)D + QD + GD + 2QD [K/V expanded when G < Q] + 2QD) + 4Q + 8
             (K/V are expanded for fp32 on GPUs; 16-bit attention takes them grouped)
  MoE        b x (k (5H + 3Fe) + 2H + 3Fs) + 13E   (router fp32 scores, map; balanced routing)
  dense MLP  b x (3F + 2H)
  loss       V (b + 8) + 2H b                      (logits, fp32 copy, log-softmax)
With a sync-free dispatch k counts the rows the dispatch moves per token instead
(`DispatchMode.expert_rows`): experts x capacity / tokens with --moe-pad-expert-input-to-capacity
(padding rows hold activations too), EP x block / tokens with --moe-dispatch-budget at the
first budget level that holds balanced routing (a step rerun at a larger budget needs more, up
to EP x k). A capacity without padding keeps k: it can only drop rows.
Where the experts' weight grads are paired over microbatches, each MoE layer also holds one
microbatch's expert rows until the next one's backward: b x k x (2H + 3Fe) per token a layer
(each expert GEMM's input and output grad). Pairing saves time, not memory, so it is taken only
where it fits: the flags allow it (training.optimizer.grads.expert_grad_placement) and the
estimate with those rows stays PAIRING_HEADROOM under the rank's budget (`place_expert_grads`);
otherwise one launch a microbatch, and the run is refused only when that does not fit.
One microbatch in flight without the overlap; with it, one microbatch plus the largest layer of
the next (the combined 1F1B forward of layer l runs beside the backward of layer L-1-l); two
plus that layer with the paired-ends plan (F(i-1) is held while F(i) runs beside B(i-2)). The
backward adds a transient: the weight grad of the largest weight (computed in the model dtype,
then added to its fp32 main_grad), or the grads of the loss's logits or of a comm node's
tokens (2kH b per token), whichever is larger. Activations and transient get +5% for what the
formulas leave out (indices, probs copies, allocation rounding).

The estimate assumes balanced routing: a learned router that sends most tokens to one EP rank
can need up to EP times the MoE activations there (the quick-start baseline at 2 GPUs,
imbalance 8.0 in its first steps, peaked 6% above the estimate; balanced, 2% below it).
Calibrated against the peaks measured on H200s (benchmarks/data/bench_overlap_*.json, 7 shapes
x 4 modes at 2 and 4 GPUs): the estimate is above every measured peak and at most about 1.4x
of it (tests/config/test_memory.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from epoverlap.config import RunConfig, resolve_config
from epoverlap.errors import ConfigError
from epoverlap.config.dispatch import DispatchMode
from epoverlap.model.stages import ChunkPlacement, stage_chunks
from epoverlap.schedule.pipeline import microbatch_groups, warmup_forwards
from epoverlap.training.optimizer.grads import expert_grad_placement

GIB = 2**30
# Not in the estimate, needed beside it: CUDA context, NCCL buffers, allocator slack (GPU);
# the torch runtime of each process (CPU).
GPU_RESERVE_BYTES = int(1.5 * GIB)
CPU_RANK_OVERHEAD_BYTES = int(0.5 * GIB)
# Small tensors the per-token formulas leave out (indices, probs copies, norms' rstd) and
# allocation rounding: +5% on activations and transients.
UNCOUNTED_FACTOR = 1.05
# Share of the budget the paired expert rows must leave free: pairing is a speed choice, and a
# learned router's imbalance peaked 6% above the balanced estimate (module docstring).
PAIRING_HEADROOM = 0.10


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank."""

    states: int  # weights, fp32 grads, fp32 masters, AdamW moments
    activations: int  # the microbatches in flight
    transient: int  # the backward's largest temporary: a weight grad, or activation grads
    in_flight: str  # how many microbatches are counted, in words

    @property
    def total(self) -> int:
        return self.states + self.activations + self.transient


def weight_sizes(cfg: RunConfig, ep_size: int, stage: int = 0) -> list[int]:
    """Element counts of this rank's weights on pipeline `stage`: the dense ones of its layers
    (the embedding on the first stage, the final norm and output layer on the last), and its
    1/EP share of every MoE layer's experts (one entry per weight tensor; norms as one entry
    per layer)."""
    m, moe = cfg.model, cfg.moe
    h, qd, gd = m.hidden_size, m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim
    chunks = _stage_chunks(cfg, stage)
    vocab = m.padded_vocab_size
    sizes = [vocab * h] if chunks[0].has_embedding else []
    sizes += [vocab * h, h] if chunks[-1].has_loss else []
    pattern = cfg.moe_layer_pattern()
    for layer in (layer for chunk in chunks for layer in chunk.layers):
        sizes += [2 * h, h * (qd + 2 * gd), qd * h]
        sizes += [2 * m.head_dim] if m.qk_layernorm else []
        if not pattern[layer]:
            sizes += [2 * m.ffn_hidden_size * h, m.ffn_hidden_size * h]
            continue
        ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size
        local = moe.num_experts // ep_size
        sizes += [moe.num_experts * h, local * h * 2 * ffn, local * ffn * h]
        shared = moe.moe_shared_expert_intermediate_size or 0
        sizes += [2 * shared * h, shared * h] if shared else []
    return sizes


def _stage_chunks(cfg: RunConfig, stage: int) -> list[ChunkPlacement]:
    return stage_chunks(cfg.model.num_layers, cfg.parallel.pipeline_model_parallel_size,
                        cfg.virtual_stages, stage)


def dispatch_rows_per_token(cfg: RunConfig) -> float:
    """Rows the MoE dispatch moves per token of a microbatch (the k of the formulas)."""
    tokens = cfg.microbatch_tokens
    rows = DispatchMode.of(cfg.moe).expert_rows(tokens, cfg.moe.moe_router_topk,
                                                cfg.moe.num_experts,
                                                cfg.parallel.expert_model_parallel_size)
    return rows / tokens


def _layer_bytes_per_token(cfg: RunConfig, is_moe: bool, b: int, rows: float) -> int:
    """Activation bytes one token leaves in a layer; `rows`: dispatch rows per token."""
    m, moe = cfg.model, cfg.moe
    h, q, g, d = m.hidden_size, m.num_attention_heads, m.kv_heads, m.head_dim
    expanded = 2 * q * d if g < q else 0
    attn = b * (4 * h + (q + 2 * g) * d + q * d + g * d + expanded + 2 * q * d) + 4 * q + 8
    if m.qk_layernorm:  # the query/key norms keep their input and an fp32 1/rms per head
        attn += (q + g) * (b * d + 4)
    if not is_moe:
        return attn + b * (3 * m.ffn_hidden_size + 2 * h)
    ffn = moe.moe_ffn_hidden_size or m.ffn_hidden_size
    shared = moe.moe_shared_expert_intermediate_size or 0
    return attn + int(b * (rows * (5 * h + 3 * ffn) + 2 * h + 3 * shared)) + 13 * moe.num_experts


def estimate_memory(cfg: RunConfig, world_size: int,
                    paired: Optional[bool] = None) -> MemoryEstimate:
    """Peak bytes one rank needs for `cfg` (see the module docstring for what is counted): the
    largest over the pipeline stages. `paired`: whether the experts' weight grads are paired
    over microbatches (`place_expert_grads` decides); None: wherever the flags allow it (the
    most the run can need)."""
    stages = range(cfg.parallel.pipeline_model_parallel_size)
    return max((_stage_estimate(cfg, stage, paired) for stage in stages),
               key=lambda e: e.total)


@dataclass(frozen=True)
class ExpertGradPlacement:
    """Where the experts' fused weight grads go (`schedule.wgrad.WeightGradQueue`'s options),
    and the start-up line that says so."""

    first_write: bool
    pair_microbatches: bool
    line: str

    def queue_options(self) -> dict:
        return {"first_write": self.first_write, "pair_microbatches": self.pair_microbatches}


def place_expert_grads(cfg: RunConfig, world_size: int, budget: Optional[int],
                       where: str) -> ExpertGradPlacement:
    """The experts' weight-grad placement of a run whose ranks may use `budget` bytes each
    (`available_memory`: `where` says what that figure is; None: unknown). The first write
    (no zeroing) as the flags allow; the pairing where they allow it and the estimate with the
    paired rows fits under the budget less PAIRING_HEADROOM, else one launch a microbatch. It
    changes no bit either way, so ranks need not agree."""
    allowed = expert_grad_placement(cfg)
    first = allowed["first_write"]
    if not allowed["pair_microbatches"] or not cfg.moe.enabled \
            or cfg.train.num_microbatches < 2:
        return ExpertGradPlacement(first, False, "expert weight grads: one launch a microbatch "
                                   "(nothing to pair: unfused grads, per-layer CUDA graphs, no "
                                   "MoE layer or one microbatch)")
    needs = estimate_memory(cfg, world_size, paired=True).total
    if budget is None:
        return ExpertGradPlacement(first, False, "expert weight grads: one launch a microbatch "
                                   f"(pairing needs about {_gib(needs)} and the memory at hand "
                                   f"is unknown: {where})")
    room = int(budget * (1 - PAIRING_HEADROOM))
    pair = needs <= room
    verdict = "microbatches 2k and 2k+1 paired" if pair else "one launch a microbatch"
    relation = "within" if pair else "above"
    return ExpertGradPlacement(first, pair, f"expert weight grads: {verdict} (the estimate with "
                               f"the paired rows, {_gib(needs)}, is {relation} "
                               f"{100 - round(100 * PAIRING_HEADROOM)}% of {_gib(max(budget, 0))}"
                               f" per rank; {where})")


def _stage_estimate(cfg: RunConfig, stage: int,
                    paired: Optional[bool] = None) -> MemoryEstimate:
    if paired is None:  # wherever the flags allow it
        paired = expert_grad_placement(cfg)["pair_microbatches"]
    m, t = cfg.model, cfg.train
    b = 2 if t.bf16 else 4
    sizes = weight_sizes(cfg, cfg.parallel.expert_model_parallel_size, stage)
    per_param = b + 4 + (4 if t.bf16 else 0) + (0 if t.skip_optimizer_step else 8)
    tokens = cfg.microbatch_tokens
    pattern = cfg.moe_layer_pattern()
    chunks = _stage_chunks(cfg, stage)
    rows = dispatch_rows_per_token(cfg) if cfg.moe.enabled else 0
    per_chunk = [[_layer_bytes_per_token(cfg, pattern[layer], b, rows) for layer in chunk.layers]
                 for chunk in chunks]
    loss = m.padded_vocab_size * (b + 8) + 2 * m.hidden_size * b if chunks[-1].has_loss else 0
    one_chunk = tokens * (m.hidden_size * b + max(sum(layers) for layers in per_chunk) + loss)
    in_flight_chunks, in_flight = _chunks_in_flight(cfg, stage)
    activations = in_flight_chunks * one_chunk
    if cfg.overlap.overlap_moe_expert_parallel_comm:
        activations += tokens * max(max(layers) for layers in per_chunk)
        in_flight += " + 1 layer"
    held = _paired_expert_rows(cfg, chunks, pattern, b, rows) if paired else 0
    if held:
        activations += tokens * held
        in_flight += " + one microbatch's expert rows (paired weight grads)"
    grads_per_token = max(m.padded_vocab_size * (8 + b) if loss else 0,
                          int(2 * rows * m.hidden_size * b))
    transient = max(max(sizes) * b, tokens * grads_per_token)
    return MemoryEstimate(states=sum(sizes) * per_param,
                          activations=int(activations * UNCOUNTED_FACTOR),
                          transient=int(transient * UNCOUNTED_FACTOR), in_flight=in_flight)


def _paired_expert_rows(cfg: RunConfig, chunks, pattern, b: int, rows: float) -> int:
    """Bytes per token a stage's MoE layers hold while microbatch 2k's expert weight grads
    wait for 2k+1's: each expert GEMM's input and output grad, b x rows x (2H + 3Fe) a layer;
    0 where nothing is paired (no MoE layer, one microbatch)."""
    if not cfg.moe.enabled or cfg.train.num_microbatches < 2:
        return 0
    ffn = cfg.moe.moe_ffn_hidden_size or cfg.model.ffn_hidden_size
    moe_layers = sum(pattern[layer] for chunk in chunks for layer in chunk.layers)
    return int(moe_layers * b * rows * (2 * cfg.model.hidden_size + 3 * ffn))


def _chunks_in_flight(cfg: RunConfig, stage: int) -> tuple[int, str]:
    """(microbatch-chunks whose activations a stage holds at once, in words): one without
    pipeline stages; the warmup forwards plus one with them (schedule.pipeline)."""
    pp, virtual = cfg.parallel.pipeline_model_parallel_size, cfg.virtual_stages
    if pp == 1:
        if cfg.plan_name == "combined_1f1b_paired_ends" and cfg.train.num_microbatches > 1:
            return 2, "2 microbatches (paired ends)"  # F(i-1) held while F(i) meets B(i-2)
        return 1, "1 microbatch"
    microbatches = cfg.train.num_microbatches
    first_group = len(microbatch_groups(microbatches, pp)[0])
    count = 1 + warmup_forwards(stage, pp, virtual, first_group, microbatches * virtual,
                                combined=False)
    count = min(count, microbatches * virtual)
    held = f"{count} microbatch{'es' if count > 1 else ''}" if virtual == 1 else \
        f"{count} microbatch-chunks"
    return count, f"{held} on stage {stage}"


def available_memory(device: str, local_rank: int, local_ranks: int
                     ) -> tuple[Optional[int], str]:
    """(bytes one rank may use, where that figure comes from); None when unknown."""
    if device == "cuda":
        import torch
        total = torch.cuda.get_device_properties(local_rank).total_memory
        return total - GPU_RESERVE_BYTES, (f"GPU {local_rank} has {total / GIB:.1f} GiB, "
                                           f"{GPU_RESERVE_BYTES / GIB:.1f} GiB of it kept for "
                                           "the CUDA context and NCCL")
    available = _mem_available_bytes()
    if available is None:
        return None, "no /proc/meminfo"
    share = available // max(local_ranks, 1) - CPU_RANK_OVERHEAD_BYTES
    return share, (f"this host has {available / GIB:.1f} GiB available (/proc/meminfo) for "
                   f"{local_ranks} rank(s), {CPU_RANK_OVERHEAD_BYTES / GIB:.1f} GiB each kept "
                   "for the torch runtime")


def _mem_available_bytes(path: str = "/proc/meminfo") -> Optional[int]:
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(cfg: RunConfig, world_size: int, device: str, local_ranks: int) -> None:
    """Raise ConfigError (naming the flags that drive the estimate) when a rank cannot fit, with
    the experts' weight grads unpaired (where the paired rows do not fit the run does without
    them: `place_expert_grads`)."""
    cfg = resolve_config(cfg, world_size, device == "cuda")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    budget, source = available_memory(device, local_rank, local_ranks)
    if budget is None:
        return
    estimate = estimate_memory(cfg, world_size, paired=False)
    if estimate.total <= budget:
        return
    m, t = cfg.model, cfg.train
    sizes = (f"needs about {_gib(estimate.total)} per rank: activations "
             f"{_gib(estimate.activations + estimate.transient)} ({estimate.in_flight} of "
             f"--micro-batch-size {t.micro_batch_size} x --seq-length {m.seq_length} tokens), "
             f"weights, grads and optimizer state {_gib(estimate.states)}; "
             f"{source}: {_gib(max(budget, 0))} per rank")
    if estimate.states > estimate.activations + estimate.transient:
        if cfg.parallel.pipeline_model_parallel_size > 1:
            raise ConfigError("--pipeline-model-parallel-size",
                              cfg.parallel.pipeline_model_parallel_size,
                              f"{sizes}; use more pipeline stages or more expert parallelism, "
                              "or lower --hidden-size, --num-layers or --num-experts")
        raise ConfigError("--hidden-size", m.hidden_size, f"{sizes}; lower --hidden-size, "
                          "--num-layers, --num-experts or --moe-ffn-hidden-size, or raise "
                          "--expert-model-parallel-size or --pipeline-model-parallel-size")
    mode = DispatchMode.of(cfg.moe)
    buffers = {"budget": " (or --moe-dispatch-budget, which sizes the dispatch buffers)",
               "capacity_padded": " (or --moe-expert-capacity-factor, the padded capacity)"}
    raise ConfigError("--seq-length", m.seq_length, f"{sizes}; lower --seq-length or "
                      f"--micro-batch-size{buffers.get(mode.name, '') if cfg.moe.enabled else ''}")


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / GIB:.3f} GiB"
