"""Every cross-field rule of the configuration: `check_config` checks them all and raises
`ConfigError` naming the flag (as the user types it), the value and what is allowed: every
refusal at once, one line per flag (each flag's own value and the Megatron-LM flags' rules all
of them, the other groups of rules the first each breaks; a group that cannot run once an
earlier one refused a value ends the list).

Validation needs only the world size, whether CUDA is present and the file system (output
paths must be writable: tried with a temporary file, nothing is created), so a bad invocation
exits before any process group work. The memory estimate, which needs the device's size, is
training/setup/memory.py's; the files of --data-path and --load are checked by the data and
checkpoint readers, also before training.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable, Optional

from epoverlap.config.aliases import alias_conflict
from epoverlap.config.compat import compat_rules
from epoverlap.config.cuda_graph_rules import validate_cuda_graph_config
from epoverlap.config.dispatch import (DispatchMode, a2a_waves_blocker, dispatch_choice,
                                       hierarchy_blocker)
from epoverlap.config.dispatch_rules import refusal
from epoverlap.config.flags import _opt_float
from epoverlap.config.context_rules import validate_context_parallel, validate_documents
from epoverlap.config.io_rules import validate_io
from epoverlap.config.layer_freq import layer_freq_list
from epoverlap.config.parse import FLAGS, flag_of, require
from epoverlap.config.run import RunConfig
from epoverlap.config.sections import (COMM_MODES, COPY_ENGINE_TRANSPORTS, MAX_SM_CARVEOUT,
                                       NCCL_MAX_CHANNELS,
                                       ModelConfig, MoEConfig, OverlapConfig, TrainConfig)
from epoverlap.config.tuning import (candidate_paths, probe_steps, steps_needed, timed_steps,
                                     tune_blocker, tune_mode, untimed_steps)
from epoverlap.errors import ConfigError, raise_together
from epoverlap.kernels import triton_unavailable_reason
from epoverlap.kernels.capacity import get_capacity
from epoverlap.parallel.transport import ranks_per_host

MAX_LAYERS = 4096
PAD_FLAG = "--moe-pad-expert-input-to-capacity"
MIN_TIMEOUT_MINUTES = 0.05


def _validate_finite(cfg: RunConfig) -> None:
    """Every float flag: NaN and infinity are refused (they would only surface mid-training)."""
    for item in FLAGS:
        value = item.value(cfg)
        if item.kind in (float, _opt_float) and value is not None:
            require(math.isfinite(value), item.field.name, value, "must be a finite number")


def _validate_choices(cfg: RunConfig, require=require) -> None:
    """Every flag that takes a name: the name is one its flag allows (the CUDA-graph flags check
    theirs as they are built, config.cuda_graphs)."""
    for item in FLAGS:
        value = item.value(cfg)
        if item.flag.choices and item.section != "cuda_graph" and value is not None:
            for one in value if isinstance(value, tuple) else (value,):
                require(one in item.flag.choices, item.field.name, one, item.allowed_text())


def _validate_model(m: ModelConfig) -> None:
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "vocab_size"):
        require(getattr(m, name) >= 1, name, getattr(m, name), "must be >= 1")
    require(m.make_vocab_size_divisible_by >= 1, "make_vocab_size_divisible_by",
            m.make_vocab_size_divisible_by, "must be >= 1 (1: the vocabulary unpadded)")
    # layer lists are built per layer from here on: an absurd count is refused, not allocated
    require(m.num_layers <= MAX_LAYERS, "num_layers", m.num_layers, f"must be <= {MAX_LAYERS}")
    require(m.seq_length >= 2, "seq_length", m.seq_length, "must be >= 2")
    if m.kv_channels is None:
        require(m.hidden_size % m.num_attention_heads == 0, "num_attention_heads",
                 m.num_attention_heads, f"must divide --hidden-size={m.hidden_size} (or give "
                 "the head width, --kv-channels)")
        require(m.head_dim % 2 == 0, "hidden_size", m.hidden_size,
                 f"head dim hidden/heads={m.head_dim} must be even (rotary embeddings)")
    else:
        require(m.kv_channels >= 2 and m.kv_channels % 2 == 0, "kv_channels", m.kv_channels,
                 "must be even and >= 2 (rotary embeddings)")
    require(m.rotary_base > 0, "rotary_base", m.rotary_base, "must be > 0")
    require(m.init_method_std >= 0, "init_method_std", m.init_method_std, "must be >= 0")
    require(m.norm_epsilon > 0, "norm_epsilon", m.norm_epsilon, "must be > 0")
    if m.num_query_groups is not None:
        require(m.num_query_groups >= 1 and m.num_attention_heads % m.num_query_groups == 0,
                 "num_query_groups", m.num_query_groups,
                 f"must divide --num-attention-heads={m.num_attention_heads}")


def _validate_layer_pattern(num_layers: int, moe: MoEConfig) -> None:
    freq = moe.moe_layer_freq.strip()
    try:
        listed = layer_freq_list(freq)
        is_list, items = listed is not None, listed if listed is not None else [int(freq)]
    except ValueError:
        raise ConfigError("--moe-layer-freq", freq, "an integer N, a 0/1 list (0,1,1,1) or "
                          "Megatron-LM's list expression (([0]*1+[1]*3))") from None
    if is_list:
        require(len(items) == num_layers and set(items) <= {0, 1}, "moe_layer_freq", freq,
                 f"a 0/1 list needs exactly --num-layers={num_layers} entries")
    else:
        require(items[0] >= 1, "moe_layer_freq", freq, "must be >= 1")
    require(0 <= moe.moe_first_k_dense_replace <= num_layers, "moe_first_k_dense_replace",
             moe.moe_first_k_dense_replace, f"must be in [0, --num-layers={num_layers}]")


def _validate_router(moe: MoEConfig) -> None:
    num_experts = moe.num_experts
    require(1 <= moe.moe_router_topk <= num_experts, "moe_router_topk", moe.moe_router_topk,
             f"must be in [1, --num-experts={num_experts}]")
    require(not moe.moe_router_enable_expert_bias or moe.moe_router_score_function == "sigmoid",
             "moe_router_enable_expert_bias", True,
             "only with --moe-router-score-function sigmoid")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(moe, name)
        require(value is None or value >= 0, name, value, "must be >= 0")
    require(moe.moe_router_load_balancing_type != "none" or moe.moe_aux_loss_coeff == 0,
            "moe_router_load_balancing_type", "none", "turns the aux loss off: drop "
            "--moe-aux-loss-coeff, or use aux_loss")
    scaling = moe.moe_router_topk_scaling_factor
    require(scaling is None or scaling > 0, "moe_router_topk_scaling_factor", scaling,
             "must be > 0")
    groups, group_topk = moe.moe_router_num_groups, moe.moe_router_group_topk
    require((groups is None) == (group_topk is None), "moe_router_group_topk", group_topk,
             "set together with --moe-router-num-groups (both or neither)")
    if groups is not None:
        require(groups >= 1 and num_experts % groups == 0, "moe_router_num_groups", groups,
                 f"must divide --num-experts={num_experts}")
        require(1 <= group_topk <= groups, "moe_router_group_topk", group_topk,
                 f"must be in [1, --moe-router-num-groups={groups}]")
        require(moe.moe_router_topk % group_topk == 0, "moe_router_topk", moe.moe_router_topk,
                 f"must be divisible by --moe-router-group-topk={group_topk}")
        per_group = num_experts // groups
        require(moe.moe_router_topk // group_topk <= per_group, "moe_router_topk",
                 moe.moe_router_topk,
                 f"topk/group_topk must be <= experts per group ({per_group})")


def _validate_pipeline(cfg: RunConfig, world_size: int) -> None:
    """--pipeline-model-parallel-size and the virtual-stage flags: every stage and every model
    chunk holds the same whole number of layers."""
    p, layers = cfg.parallel, cfg.model.num_layers
    pp = p.pipeline_model_parallel_size
    require(pp >= 1 and world_size % pp == 0, "pipeline_model_parallel_size", pp,
             f"must divide the world size {world_size}")
    require(layers % pp == 0, "pipeline_model_parallel_size", pp,
             f"must divide --num-layers={layers} (every stage holds as many layers)")
    per_stage = layers // pp
    given = [(name, getattr(p, name)) for name in ("num_layers_per_virtual_pipeline_stage",
                                                    "num_virtual_stages_per_pipeline_rank")
             if getattr(p, name) is not None]
    if len(given) == 2:
        raise ConfigError(flag_of(given[1][0]), given[1][1],
                          f"give it or {flag_of(given[0][0])}, not both")
    for name, value in given:
        require(value >= 1, name, value, "must be >= 1")
        require(pp > 1, name, value, "needs --pipeline-model-parallel-size > 1 (virtual "
                 "stages interleave a pipeline)")
        require(per_stage % value == 0, name, value,
                 f"must divide the {per_stage} layers of each stage (--num-layers={layers} / "
                 f"--pipeline-model-parallel-size={pp})")


def _validate_microbatches(cfg: RunConfig, world_size: int) -> None:
    """A pipeline of P stages needs at least P microbatches per step (one in flight each)."""
    pp, t = cfg.parallel.pipeline_model_parallel_size, cfg.train
    if pp == 1:
        return
    if t.global_batch_size is not None:
        dp = cfg.data_parallel_size(world_size)
        count = t.global_batch_size // (t.micro_batch_size * dp)
        require(count >= pp, "global_batch_size", t.global_batch_size,
                 f"gives {count} microbatches per step (/ --micro-batch-size x data-parallel "
                 f"ranks = {t.micro_batch_size} x {dp}); --pipeline-model-parallel-size={pp} "
                 f"needs at least {pp}")
    else:
        require(t.num_microbatches >= pp, "num_microbatches", t.num_microbatches,
                 f"must be >= --pipeline-model-parallel-size={pp} (every stage needs a "
                 "microbatch in flight)")


def _validate_emulated_hosts(cfg: RunConfig, world_size: int, cuda_available: bool) -> None:
    """--emulate-hosts N and --nccl-transport-report: NCCL host identities and NCCL's log."""
    hosts, p = cfg.parallel.emulate_hosts, cfg.parallel
    require(hosts >= 1, "emulate_hosts", hosts, "must be >= 1 (1: off)")
    on_gpu = cfg.resolved_device(cuda_available) == "cuda"
    if hosts > 1:  # on gloo it only says which ranks share a host (no transports to choose)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        require(local % hosts == 0 and local >= hosts, "emulate_hosts", hosts,
                f"must divide the {local} ranks of this machine (LOCAL_WORLD_SIZE)")
    require(not p.nccl_transport_report or on_gpu, "nccl_transport_report", True,
            "reads NCCL's log: needs a CUDA device (NCCL)")


def _validate_hierarchy(cfg: RunConfig, world_size: int) -> None:
    """--moe-dispatch-hierarchy node (what it needs: `config.dispatch.hierarchy_blocker`)."""
    blocker = hierarchy_blocker(cfg, ranks_per_host(world_size, cfg.parallel.emulate_hosts))
    require(not blocker, "moe_dispatch_hierarchy", cfg.moe.moe_dispatch_hierarchy, blocker)


def _validate_moe(cfg: RunConfig, world_size: int) -> None:
    moe, ep = cfg.moe, cfg.parallel.expert_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    require(ep >= 1 and world_size % (ep * pp) == 0, "expert_model_parallel_size", ep,
             f"must divide the world size {world_size}" if pp == 1 else
             f"EP x PP = {ep} x {pp} must divide the world size {world_size}")
    if not moe.enabled:
        require(ep == 1, "expert_model_parallel_size", ep, "must be 1 without --num-experts")
        for name in ("moe_expert_capacity_factor", "moe_dispatch_budget"):
            require(getattr(moe, name) is None, name, getattr(moe, name),
                     "needs MoE layers (--num-experts)")
        return
    require(moe.num_experts >= 1 and moe.num_experts % ep == 0, "num_experts", moe.num_experts,
             f"must be divisible by --expert-model-parallel-size={ep}")
    _validate_router(moe)
    _validate_layer_pattern(cfg.model.num_layers, moe)
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(moe, name)
        require(value is None or value >= 1, name, value, "must be >= 1")
    _validate_dispatch(cfg)


def _validate_dispatch(cfg: RunConfig) -> None:
    """Capacity (Megatron-core's drop/pad) or the dropless budget; see epoverlap.model.moe."""
    moe = cfg.moe
    factor, budget = moe.moe_expert_capacity_factor, moe.moe_dispatch_budget
    require(factor != 0, "moe_expert_capacity_factor", factor,
             "must be > 0 (a negative value means no capacity: dropless, as Megatron-core "
             "reads it)")
    pad = moe.moe_pad_expert_input_to_capacity
    require(not pad or moe.capacity_factor is not None, "moe_pad_expert_input_to_capacity",
             True, "needs --moe-expert-capacity-factor > 0 (the capacity to pad to)")
    memory = moe.moe_dispatch_budget_memory
    require(memory >= 0, "moe_dispatch_budget_memory", memory, "must be >= 0 (0: no memory)")
    require(memory == 0 or budget is not None, "moe_dispatch_budget_memory", memory,
             "needs --moe-dispatch-budget (the levels it remembers)")
    require(not moe.moe_dispatch_budget_fit or budget is not None, "moe_dispatch_budget_fit",
             True, "needs --moe-dispatch-budget (the base budget it fits)")
    if budget is not None:
        require(budget > 0, "moe_dispatch_budget", budget,
                 "must be > 0 (1.0 = the balanced share of rows per EP rank)")
        require(moe.capacity_factor is None, "moe_dispatch_budget", budget,
                 "is dropless and --moe-expert-capacity-factor drops tokens: give one of them")
    if moe.moe_dispatch_once_per_rank:  # the flag's routing, whatever the hierarchy's
        why = refusal(dispatch_choice(cfg).with_(routing="per_rank"), PAD_FLAG)
        require(not why, "moe_pad_expert_input_to_capacity", True, why)
    if pad:
        tokens = cfg.microbatch_tokens
        capacity = get_capacity(tokens * moe.moe_router_topk, moe.num_experts, factor)
        require(capacity <= tokens, "moe_expert_capacity_factor", factor,
                 f"with --moe-pad-expert-input-to-capacity the capacity ({capacity}) must not "
                 f"exceed the {tokens} tokens of a microbatch (Megatron-core's padded permute "
                 f"fails there): use a factor <= num_experts / topk = "
                 f"{moe.num_experts / moe.moe_router_topk:g}")


def _validate_train(t: TrainConfig, dp_size: int, cuda_available: bool) -> None:
    for name in ("micro_batch_size", "num_microbatches", "train_iters"):
        require(getattr(t, name) >= 1, name, getattr(t, name), "must be >= 1")
    per_microbatch = t.micro_batch_size * dp_size
    require(t.global_batch_size is None or (t.global_batch_size >= per_microbatch and
                                             t.global_batch_size % per_microbatch == 0),
             "global_batch_size", t.global_batch_size, f"must be a multiple of "
             f"--micro-batch-size x ranks = {t.micro_batch_size} x {dp_size}")
    require(t.lr > 0, "lr", t.lr, "must be > 0")
    require(0 <= t.min_lr <= t.lr, "min_lr", t.min_lr, f"must be in [0, --lr={t.lr}]")
    require(t.lr_warmup_iters >= 0, "lr_warmup_iters", t.lr_warmup_iters, "must be >= 0")
    _validate_lr_schedule(t)
    require(t.clip_grad >= 0, "clip_grad", t.clip_grad, "must be >= 0 (0 disables clipping)")
    for name in ("adam_beta1", "adam_beta2"):
        require(0 <= getattr(t, name) < 1, name, getattr(t, name), "must be in [0, 1)")
    for name in ("adam_eps", "weight_decay"):
        require(getattr(t, name) >= 0, name, getattr(t, name), "must be >= 0")
    require(0 <= t.seed < 2**63, "seed", t.seed, "must be in [0, 2**63)")
    require(t.device != "cuda" or cuda_available, "device", t.device,
             "no CUDA device is visible here; use --device cpu or auto")
    require(t.deterministic_mode or not t.deterministic_fill_uninitialized_memory,
             "deterministic_fill_uninitialized_memory", True, "needs --deterministic-mode")


def _validate_lr_schedule(t: TrainConfig) -> None:
    """--lr-decay-iters, --lr-warmup-fraction, WSD's decay steps and --train-samples."""
    if t.train_samples is not None:
        require(t.train_samples >= 1, "train_samples", t.train_samples, "must be >= 1")
    for name, least in (("lr_decay_samples", 1), ("lr_warmup_samples", 0)):
        value = getattr(t, name)
        if value is not None:
            require(value >= least, name, value, f"must be >= {least}")
            require(t.train_samples is not None, name, value, "needs --train-samples (the "
                    "schedule in sequences; else give it in steps)")
    require(t.lr_warmup_init >= 0, "lr_warmup_init", t.lr_warmup_init, "must be >= 0")
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if t.lr_decay_iters is not None:
        require(t.lr_decay_iters >= 1, "lr_decay_iters", t.lr_decay_iters, "must be >= 1")
    if t.lr_warmup_fraction is not None:
        require(0 <= t.lr_warmup_fraction <= 1, "lr_warmup_fraction", t.lr_warmup_fraction,
                "must be in [0, 1]")
    if t.lr_wsd_decay_iters is not None:
        require(1 <= t.lr_wsd_decay_iters <= decay - t.warmup_steps, "lr_wsd_decay_iters",
                t.lr_wsd_decay_iters, f"must be in [1, {decay - t.warmup_steps}] (the steps "
                "between the warmup and the decay's end)")
        require(t.lr_decay_style == "WSD", "lr_wsd_decay_iters", t.lr_wsd_decay_iters,
                "needs --lr-decay-style WSD")


def _validate_overlap(cfg: RunConfig, cuda_available: bool) -> None:
    o = cfg.overlap
    if o.overlap_plan == "combined_1f1b_paired_ends":
        require(cfg.parallel.pipeline_model_parallel_size == 1, "overlap_plan", o.overlap_plan,
                 "pairs the first two forwards and the last two backwards of one stage: needs "
                 "--pipeline-model-parallel-size 1")
    if o.overlap_moe_expert_parallel_comm and cfg.parallel.pipeline_model_parallel_size == 1:
        # with pipeline stages there are always transfers to hide (the P2P on the comm lane)
        require(cfg.parallel.expert_model_parallel_size > 1, "overlap_moe_expert_parallel_comm",
                 True, "requires --expert-model-parallel-size > 1 or "
                 "--pipeline-model-parallel-size > 1 (there is no communication to hide)")
        require(any(cfg.moe_layer_pattern()), "overlap_moe_expert_parallel_comm", True,
                 "requires at least one MoE layer (--num-experts, --moe-layer-freq) or "
                 "--pipeline-model-parallel-size > 1")
    require(not o.delay_wgrad_compute or o.overlap_moe_expert_parallel_comm,
             "delay_wgrad_compute", True, "requires --overlap-moe-expert-parallel-comm")
    require(not o.overlap_grad_reduce or cfg.cuda_graph.impl != "full_iteration",
             "overlap_grad_reduce", True, "not with --cuda-graph-impl full_iteration (the "
             "graph would capture the data-parallel reduces, which the step runs after the "
             "replay instead); leave --overlap-grad-reduce out")
    _validate_tune(cfg)
    _validate_a2a_waves(cfg)
    _validate_local_copy_hold(o)
    if o.comm_stream_priority != "high":
        require(o.overlap_moe_expert_parallel_comm and cfg.resolved_device(cuda_available)
                 == "cuda", "comm_stream_priority", o.comm_stream_priority,
                 "sets the CUDA stream of the overlap's comm lane: needs a CUDA device and "
                 "--overlap-moe-expert-parallel-comm (without them there is no comm stream)")


def _validate_local_copy_hold(o: OverlapConfig) -> None:
    """The harness's stand-in (benchmarks.harness.train_bench, not product flags): a known
    --comm-mode; --local-copy-hold-us N a hold after each local copy, so only with them."""
    require(o.comm_mode in COMM_MODES, "comm_mode", o.comm_mode,
            f"one of {', '.join(COMM_MODES)}")
    hold = o.local_copy_hold_us
    require(hold >= 0, "local_copy_hold_us", hold, "must be >= 0 (0: no hold)")
    require(hold == 0 or o.comm_mode == "local_copy", "local_copy_hold_us", hold,
            "holds the comm lane after each local copy: needs --comm-mode local_copy (with "
            "real all-to-alls the lane is held by the all-to-alls themselves)")


def _validate_a2a_waves(cfg: RunConfig) -> None:
    """--moe-a2a-waves K: K groups of a rank's local experts, each with its own all-to-alls
    (`model.waves`; what they need: `config.dispatch.a2a_waves_blocker`)."""
    waves = cfg.overlap.moe_a2a_waves
    require(waves >= 1, "moe_a2a_waves", waves, "must be >= 1 (1: unsplit)")
    blocker = a2a_waves_blocker(cfg, waves)
    require(not blocker, "moe_a2a_waves", waves, blocker)


def _validate_tune(cfg: RunConfig) -> None:
    """--tune, --tune-steps, --tune-cache and the deprecated --overlap-probe-steps
    (`config.tuning`): --tune on needs the overlap, one pipeline stage, graphs each path can
    replay its own of, and --train-iters that hold the tuning window (unless --tune-cache
    may hold the decision)."""
    o = cfg.overlap
    require(o.tune_steps >= 1, "tune_steps", o.tune_steps,
             "must be >= 1 (the timed steps of each path)")
    probe = probe_steps(cfg)
    require(probe >= 0, "overlap_probe_steps", probe,
             "must be >= 0 (0: not given; deprecated: use --tune on --tune-steps N)")
    if probe and o.tune == "off":
        raise alias_conflict("--overlap-probe-steps", probe, f"--tune on --tune-steps {probe}",
                             "--tune off")
    if o.tune_cache is not None:
        require(not os.path.exists(o.tune_cache) or os.path.isdir(o.tune_cache), "tune_cache",
                 o.tune_cache, "must be a folder (it is a file)")
    if tune_mode(cfg) != "on":
        require(o.tune_cache is None or o.tune == "auto", "tune_cache", o.tune_cache,
                 "holds tuning decisions: needs --tune on or auto (not --tune off)")
        return
    name, value = ("overlap_probe_steps", probe) if probe else ("tune", "on")
    if not o.overlap_moe_expert_parallel_comm and \
            "--overlap-moe-expert-parallel-comm" in cfg.defaulted:
        # auto left the overlap off, maybe for one of these rules: name that one first
        _validate_tune_window(dataclasses.replace(cfg, overlap=dataclasses.replace(
            o, overlap_moe_expert_parallel_comm=True)), name, value)
    _validate_tune_window(cfg, name, value)


def _validate_tune_window(cfg: RunConfig, name: str, value: object) -> None:
    """--tune on: a stage's plan switched, graphs each path replays its own of, and the
    steps of the tuning window (unless --tune-cache may hold the decision)."""
    require(not tune_blocker(cfg), name, value, tune_blocker(cfg))
    if cfg.overlap.tune_cache is not None:  # a cached decision needs no steps; else one
        return  # line says so
    paths = candidate_paths(cfg)
    needed = steps_needed(cfg, len(paths))
    untimed = untimed_steps(cfg, len(paths))
    before = ("the first step" if cfg.cuda_graph.impl == "none" else
              f"{untimed} untimed: the graphs' warm-up and one capture step per other path")
    require(cfg.train.train_iters >= needed, name, value,
             f"needs --train-iters >= {needed} ({before}, then {timed_steps(cfg)} of each of "
             f"{len(paths)} paths: {', '.join(path.name for path in paths)}), got "
             f"--train-iters={cfg.train.train_iters}")


def _validate_nccl_ctas(cfg: RunConfig, cuda_available: bool) -> None:
    """The expert-parallel communicator's CTA budget: NCCL only, and only where it has
    all-to-alls to shape (EP > 1). Refused rather than ignored on gloo."""
    p = cfg.parallel
    given = [(name, getattr(p, name)) for name in ("moe_a2a_nccl_max_ctas",
                                                    "moe_a2a_nccl_min_ctas")
             if getattr(p, name) is not None]
    for name, value in given:
        require(1 <= value <= NCCL_MAX_CHANNELS, name, value,
                 f"must be in [1, {NCCL_MAX_CHANNELS}] (NCCL's most CTAs per collective)")
        require(cfg.resolved_device(cuda_available) == "cuda", name, value,
                 "sets the NCCL communicator of the expert-parallel group: this run is on "
                 "CPU, where the groups use gloo (no CTAs to budget)")
        require(p.expert_model_parallel_size > 1, name, value,
                 "needs --expert-model-parallel-size > 1 (with EP 1 there is no all-to-all)")
        reason = nccl_config_unavailable()
        require(reason is None, name, value, reason or "")
    carveout = p.moe_grouped_gemm_sm_carveout
    if carveout is not None:
        require(1 <= carveout <= MAX_SM_CARVEOUT, "moe_grouped_gemm_sm_carveout", carveout,
                 f"must be in [1, {MAX_SM_CARVEOUT}] (SMs left free; the GPU's SM count "
                 "bounds it further at the first GEMM)")
        require(cfg.resolved_device(cuda_available) == "cuda", "moe_grouped_gemm_sm_carveout",
                 carveout, "leaves SMs of a CUDA device free: this run is on CPU")
        require(cfg.moe.enabled, "moe_grouped_gemm_sm_carveout", carveout,
                 "needs MoE layers (--num-experts): it applies to the experts' grouped GEMMs")
    if len(given) == 2:
        require(p.moe_a2a_nccl_min_ctas <= p.moe_a2a_nccl_max_ctas, "moe_a2a_nccl_min_ctas",
                 p.moe_a2a_nccl_min_ctas,
                 f"must be <= --moe-a2a-nccl-max-ctas={p.moe_a2a_nccl_max_ctas}")


MAX_HOST_SLOT_KIB = 1 << 20  # 1 GiB slots: past any all-to-all of one pair


def _validate_a2a_transport(cfg: RunConfig) -> None:
    """--moe-a2a-transport host_memory or peer_memory: an all-to-all to carry (EP > 1), over
    the flat dispatch (by host the two stages have communicators of their own). CUDA graphs may hold
    it (its operations are the same at every replay); a graph that holds the all-to-all
    needs split sizes fixed at capture, a sync-free dispatch, which the CUDA-graph rules
    require already (`_validate_cuda_graphs`)."""
    p = cfg.parallel
    slot = p.moe_a2a_host_slot_kib
    require(4 <= slot <= MAX_HOST_SLOT_KIB, "moe_a2a_host_slot_kib", slot,
            f"must be in [4, {MAX_HOST_SLOT_KIB}] KiB")
    if p.moe_a2a_transport not in COPY_ENGINE_TRANSPORTS:
        return
    name, value = "moe_a2a_transport", p.moe_a2a_transport
    require(cfg.moe.enabled and (p.expert_model_parallel_size or 1) > 1, name, value,
            "carries the expert-parallel all-to-alls: needs MoE layers and "
            "--expert-model-parallel-size > 1")
    why = refusal(dispatch_choice(cfg), "--moe-a2a-transport")
    require(not why, name, value, why)


def nccl_config_unavailable() -> Optional[str]:
    """Why this torch build cannot configure an NCCL communicator's CTAs (None: it can).
    `ProcessGroupNCCL.Options().config` (an ncclConfig_t with max_ctas / min_ctas) exists in
    builds with NCCL >= 2.17, torch 2.1 onwards (2.11 and 2.13 included)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_nccl_available():
        return "this torch build has no NCCL"
    config = getattr(dist.ProcessGroupNCCL.Options(), "config", None)
    if config is None or not all(hasattr(config, f) for f in ("max_ctas", "min_ctas")):
        return ("this torch build's NCCL takes no communicator config (needs NCCL >= 2.17): "
                "set NCCL_MAX_CTAS / NCCL_MIN_CTAS in the environment instead (every group)")
    return None


def _validate_kernel_backend(cfg: RunConfig, cuda_available: bool) -> None:
    backend = cfg.kernels.kernel_backend
    if cfg.resolved_kernel_backend(cfg.resolved_device(cuda_available)) == "triton":
        reason = triton_unavailable_reason()
        require(reason is None, "kernel_backend", backend, reason or "")


def _validate_dropout(cfg: RunConfig) -> None:
    for name in ("attention_dropout", "hidden_dropout"):
        value = getattr(cfg.model, name)
        require(0 <= value < 1, name, value, "must be in [0, 1)")
        require(value == 0 or cfg.cuda_graph.impl == "none", name, value,
                "dropout inside CUDA graphs is not built: use --cuda-graph-impl none")


def _validate_cuda_graphs(cfg: RunConfig, cuda_available: bool) -> None:
    pattern = cfg.moe_layer_pattern()
    pp = cfg.parallel.pipeline_model_parallel_size
    require(cfg.cuda_graph.impl == "none" or pp == 1, "cuda_graph_impl", cfg.cuda_graph.impl,
             f"not built with --pipeline-model-parallel-size={pp} yet (graphs capture a "
             "one-stage plan); use --cuda-graph-impl none")
    try:
        import transformer_engine  # noqa: F401
        te_available = True
    except ImportError:
        te_available = False
    device = cfg.resolved_device(cuda_available)
    mode = DispatchMode.of(cfg.moe)
    validate_cuda_graph_config(
        cfg.cuda_graph,
        overlap_moe_expert_parallel_comm=cfg.overlap.overlap_moe_expert_parallel_comm,
        has_moe_layers=any(pattern), has_dense_layers=not all(pattern),
        preprocess_syncs_host=mode.preprocess_syncs_host(cfg.resolved_kernel_backend(device)),
        dispatch_sizing=mode.sizing,
        transformer_engine_available=te_available, cuda_available=device == "cuda",
        experts_gemm_reads_host=device == "cuda" and not cfg.train.bf16)


def check_config(cfg: RunConfig, world_size: int, cuda_available: bool,
                 paths: bool = True) -> None:
    """Check every rule of a resolved `cfg` (`config.resolve`: what users call is
    `validate_config`, which resolves first); raise ConfigError naming the flag. `paths`
    False leaves out the output paths' checks (`validate_io`, which tries a temporary file in
    each folder): the resolution's trials of auto values change no path."""
    cfg = cfg.for_world(world_size)
    errors: list[ConfigError] = []

    def each(ok: bool, field_name: str, value: object, allowed: str) -> None:
        if not ok:  # a rule of one flag's value: every such refusal is named
            errors.append(ConfigError(flag_of(field_name), value, allowed))
    _validate_choices(cfg, each)
    compat_rules(cfg, each)
    for number, rule in enumerate(_rule_groups(cfg, world_size, cuda_available, paths)):
        try:
            rule()
        except ConfigError as error:
            errors.append(error)
            if number < GATES:  # the later groups build per-layer lists from these sizes
                break
        except Exception:  # a group that assumes what a refused value broke: end the list
            if not errors:
                raise
            break
    raise_together(errors)


GATES = 2  # the first groups of `_rule_groups` (finite numbers, the model's sizes)


def _rule_groups(cfg: RunConfig, world_size: int, cuda_available: bool,
                 paths: bool) -> list[Callable[[], None]]:
    """The groups of rules, in order; each raises at the first rule it finds broken."""
    timeout = cfg.parallel.distributed_timeout_minutes
    return [
        lambda: _validate_finite(cfg),
        lambda: _validate_model(cfg.model),
        lambda: require(timeout >= MIN_TIMEOUT_MINUTES, "distributed_timeout_minutes", timeout,
                        f"must be >= {MIN_TIMEOUT_MINUTES} (3 s): the liveness checks need a "
                        "few heartbeats within it"),
        lambda: _validate_pipeline(cfg, world_size),
        lambda: validate_context_parallel(cfg, world_size),
        lambda: validate_documents(cfg),
        lambda: _validate_emulated_hosts(cfg, world_size, cuda_available),
        lambda: _validate_moe(cfg, world_size),
        lambda: _validate_hierarchy(cfg, world_size),
        lambda: _validate_train(cfg.train, cfg.data_parallel_size(world_size), cuda_available),
        lambda: _validate_microbatches(cfg, world_size),
        lambda: _validate_overlap(cfg, cuda_available),
        lambda: _validate_nccl_ctas(cfg, cuda_available),
        lambda: _validate_a2a_transport(cfg),
        lambda: _validate_kernel_backend(cfg, cuda_available),
        lambda: validate_io(cfg, cfg.resolved_device(cuda_available)) if paths else None,
        lambda: _validate_cuda_graphs(cfg, cuda_available),
        lambda: _validate_dropout(cfg),
    ]


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
