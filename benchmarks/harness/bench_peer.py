"""Peer benchmark: the same proxy MoE model trained by Megatron-core and by epoverlap, each
sequential and overlapped, and by torchtitan in its modes, in one job on the same GPUs, one run
after the other.

    torchrun --standalone --nproc-per-node N -m benchmarks.harness.bench_peer [--shapes a,b] \
        [--systems megatron,epoverlap[,torchtitan]] [--warmup 3] [--iters 5] [--out-dir DIR]

EP = the world size. A shape is a benchmarks/harness/bench_overlap.py shape (default: its three Megatron
shapes: the `megatron-cmp` preset and two variants), with forced balanced routing
(`--moe-router-force-load-balancing`, Megatron-core's benchmark mode), mock data and bf16 on
GPUs. Per shape, each system builds a fresh model per mode:
  seq  the sequential schedule
  ovl  the EP overlap: ours `--overlap-moe-expert-parallel-comm`, Megatron-core's
       `overlap_moe_expert_parallel_comm` (its combined 1F1B through
       `get_forward_backward_func`; it needs the alltoall dispatcher, bf16 and EP > 1)
and trains it for warmup + iters steps on the same token batches (one mock-data source, every
batch made before the first step and fed to both systems). A step is the forward-backward of
every microbatch, the gradient reduction and the AdamW step (same learning-rate schedule),
each system through its own training machinery: ours `Trainer.step`; Megatron-core's
Float16Module, DistributedDataParallel and `get_megatron_optimizer`, as Megatron-LM builds them.
Reported per run: every timed step's time on the slowest rank (`step_ms_samples`, the steps
after the warmup) and the step time as their median (`step_ms`; the tables recompute it from the
samples, with their range),
tokens/s/GPU, TFLOP/s/GPU (one FLOP count for both: `training_flops_per_token`), peak memory
(allocated, max over ranks and timed steps) and the loss of the first and the last step (mean
over microbatches and ranks); per shape, each system's overlap gain (T_seq / T_ovl) and our
tokens/s/GPU over Megatron-core's best mode's. A mode a system refuses is reported with its own
reason (both refuse the overlap at EP = 1: no all-to-all to hide). Prints a markdown table
last; OUT/bench_peer.json holds every number.

Megatron-core is the optional `peer` extra (megatron-core==0.16.1), imported only by the
functions of its side. 0.16.1 without Transformer Engine leaves the TE names of its MoE
utilities unbound and its router raises `NameError: te_general_gemm`; they are bound to None
before use (`bind_missing_te_names`), which is what upstream's fix in 0.17.0 does.

torchtitan (0.3.0, the `peer` extra too, Python >= 3.11) runs only where `--systems` names it:
its side is benchmarks/harness/peer_torchtitan.py (its model at our shape, its modes a2a,
a2a_compile, masync, masync_compile), imported then; its runs take our sequential config's
shape and the same batches. The report is benchmarks/harness/peer_report.py's.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shlex
import statistics
import sys
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from epoverlap.config import RunConfig, parse_config, resolve_config, validate_config
from epoverlap.errors import ConfigError
from epoverlap.model.flops import training_flops_per_token
from epoverlap.parallel.groups import ParallelGroups, destroy_distributed, init_distributed
from epoverlap.training.setup.data import open_data_source
from epoverlap.training.setup.environment import setup_environment
from epoverlap.training.optimizer.optim import lr_at
from epoverlap.training.loop.trainer import Trainer
from epoverlap.config.resolve import SEQUENTIAL_FLAG as SEQUENTIAL
from benchmarks.harness.bench_overlap import (OVERLAP, SHAPES, max_over_ranks,
                                              max_over_ranks_each, nccl_environment,
                                              nccl_environment_text, sync_time)
from benchmarks.harness.peer_report import derived, markdown, run_line, write_report

SYSTEMS = ("megatron", "epoverlap", "torchtitan")
DEFAULT_SYSTEMS = ("megatron", "epoverlap")
MODES = {"seq": [SEQUENTIAL], "ovl": OVERLAP}
DEFAULT_SHAPES = ("megatron_e32_k4_mbs2x8", "megatron_e32_k4_mbs8x4",
                  "megatron_e8_k8_f4096_mbs8x4")
PEER_FLAGS = ["--moe-router-force-load-balancing", "--mock-data", "--tune", "off",
              "--cuda-graph-impl", "none"]  # eager, as Megatron-core's side
# What megatron-core 0.16.1's moe_utils imports from Transformer Engine (unbound without it)
TE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
            "fused_permute_with_probs", "fused_sort_chunks_by_index",
            "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
            "fused_unpermute", "te_general_gemm")
# MoE settings both configs spell alike (ours took Megatron-core's names)
SHARED_MOE_FIELDS = ("moe_router_topk", "moe_shared_expert_intermediate_size",
                     "moe_router_score_function", "moe_router_pre_softmax",
                     "moe_router_num_groups", "moe_router_group_topk",
                     "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
                     "moe_router_bias_update_rate", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                     "moe_router_dtype", "moe_router_force_load_balancing",
                     "moe_pad_expert_input_to_capacity", "moe_token_drop_policy")
INSTALL_HINT = ("bench_peer: megatron-core is not installed: pip install -e '.[peer]' "
                "(megatron-core==0.16.1), or run only ours with --systems epoverlap")
CAVEATS = (
    "Megatron-core 0.16.1 as it installs here, without Transformer Engine: its local layer "
    "spec (unfused softmax attention; the experts a per-expert loop, SequentialMLP, since its "
    "GroupedMLP needs the grouped_gemm package), no delayed wgrad (it needs TE). Not its TE "
    "build.",
    "The two systems initialize their weights differently: the losses (same batches) are a "
    "sanity check that both train alike, not a bitwise comparison.")


# ---------------------------------------------------------------------------- shared
def run_config(shape: str, mode: str, world: int, steps: int,
               extra: Sequence[str] = ()) -> RunConfig:
    """Our config of one shape and mode (Megatron-core's side is translated from it)."""
    flags = SHAPES[shape] + PEER_FLAGS + MODES[mode] + list(extra) + [
        "--expert-model-parallel-size", str(world), "--train-iters", str(steps)]
    if torch.cuda.is_available():
        flags.append("--bf16")
    return parse_config(flags)


def tokens_per_step_per_gpu(cfg: RunConfig) -> int:
    t = cfg.train
    return t.num_microbatches * t.micro_batch_size * cfg.model.seq_length


class PrefetchedBatches:
    """Every (step, microbatch) batch of this rank for the whole run, made before the first
    step (the mock source walks its chain on the host, a few ms a step, which would be timed
    otherwise) and
    read by both systems. The data source protocol of `epoverlap.training.setup.data`."""

    def __init__(self, cfg: RunConfig, rank: int, steps: int):
        source = open_data_source(cfg, dist.get_world_size())
        t, seq = cfg.train, cfg.model.seq_length
        self.vocab_size, self.description, self.rank = source.vocab_size, source.description, rank
        self.batches = {(step, mb): source.batch(step, rank, mb, t.micro_batch_size, seq)
                        for step in range(1, steps + 1) for mb in range(t.num_microbatches)}

    def batch(self, step: int, rank: int, microbatch: int, batch: int, seq: int):
        assert rank == self.rank, f"batches were made for rank {self.rank}, not {rank}"
        return self.batches[(step, microbatch)]


@dataclass
class StepSample:
    seconds: float
    loss: float
    peak_gib: Optional[float]  # None on CPU


def timed_step(device: torch.device, step_fn: Callable[[], float]) -> StepSample:
    """One training step, started like every other: after a barrier, with the device idle and
    its peak memory reset. `step_fn` runs the step and returns its loss."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = sync_time(device)
    loss = step_fn()
    seconds = sync_time(device) - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return StepSample(seconds, loss, peak)


def summarize(samples: list[StepSample], warmup: int, cfg: RunConfig) -> dict:
    """One run's figures (collective: every rank calls it)."""
    timed = samples[warmup:]
    # every timed step, not only the median (ms, the slowest rank's); the median is theirs
    step_ms_samples = [x * 1e3 for x in max_over_ranks_each(s.seconds for s in timed)]
    step_s = statistics.median(step_ms_samples) / 1e3
    tokens = tokens_per_step_per_gpu(cfg)
    return {"step_ms": step_s * 1e3, "step_ms_samples": step_ms_samples,
            "tokens_per_s_per_gpu": tokens / step_s,
            "tflops_per_gpu": training_flops_per_token(cfg.model, cfg.moe) * tokens / step_s / 1e12,
            "peak_gib": (None if timed[0].peak_gib is None
                         else max_over_ranks(max(s.peak_gib for s in timed))),
            "loss_first": samples[0].loss, "loss_last": samples[-1].loss,
            "steps": len(samples)}


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- epoverlap
def run_epoverlap(cfg: RunConfig, groups: ParallelGroups, data: PrefetchedBatches,
                  steps: int) -> dict:
    """`steps` training steps of our trainer -> {"samples": [...]} or {"skipped": why}."""
    try:
        validate_config(cfg, groups.world_size, torch.cuda.is_available())
    except ConfigError as error:
        return {"skipped": f"epoverlap refuses it: {error}"}
    try:
        return {"samples": _epoverlap_samples(cfg, groups, data, steps)}
    finally:
        release_memory(groups.device)  # the trainer's frame is gone


def _epoverlap_samples(cfg: RunConfig, groups: ParallelGroups, data: PrefetchedBatches,
                       steps: int) -> list[StepSample]:
    trainer = Trainer(cfg, groups, log=lambda msg: None, data=data)
    try:
        return [timed_step(groups.device, lambda s=step: trainer.step(s).loss)
                for step in range(1, steps + 1)]
    finally:
        trainer.close()


# ---------------------------------------------------------------------------- Megatron-core
def megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # no `megatron` package at all
        return False


def bind_missing_te_names(moe_utils) -> None:
    """Bind the TE names megatron-core 0.16.1's MoE utilities leave unbound without Transformer
    Engine to None: every use checks them for None (upstream's fix in 0.17.0 does the same)."""
    for name in TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def init_megatron(world: int) -> None:
    """Megatron-core's process groups over the initialized world: EP = world, TP = PP = 1."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils
    bind_missing_te_names(moe_utils)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world,
                                             create_gloo_process_groups=False)


def destroy_megatron() -> None:
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()


def megatron_config(cfg: RunConfig, ep: int):
    """Megatron-core's TransformerConfig of our config: the same layers, widths, heads, query
    groups, query/key norms, experts, router and precision; RMSNorm, SwiGLU, no biases, no
    dropout, as ours.
    Raises AssertionError where Megatron-core refuses the combination."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = resolve_config(cfg, ep, torch.cuda.is_available())  # bf16 and the overlap as ours run
    m, moe = cfg.model, cfg.moe
    dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.kv_heads,
        kv_channels=m.head_dim, normalization="RMSNorm", layernorm_epsilon=m.norm_epsilon,
        qk_layernorm=m.qk_layernorm,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=m.init_method_std,
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.moe_ffn_hidden_size or m.ffn_hidden_size,
        moe_layer_freq=[int(is_moe) for is_moe in cfg.moe_layer_pattern()],
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_router_load_balancing_type="aux_loss" if moe.moe_aux_loss_coeff else "none",
        moe_token_dispatcher_type="alltoall",
        **{name: getattr(moe, name) for name in SHARED_MOE_FIELDS},
        bf16=cfg.train.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        expert_model_parallel_size=ep,
        overlap_moe_expert_parallel_comm=cfg.overlap.overlap_moe_expert_parallel_comm)


def megatron_model(config, cfg: RunConfig):
    """Megatron-core's GPTModel of `config` with its local (no-TE) layer specs."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=cfg.model.padded_vocab_size,  # as Megatron-LM pads it
                    max_sequence_length=cfg.model.seq_length,
                    position_embedding_type="rope", rotary_base=int(cfg.model.rotary_base),
                    share_embeddings_and_output_weights=False)


def megatron_training(config, cfg: RunConfig):
    """(model, optimizer) as Megatron-LM builds them: the model on this GPU, Float16Module for
    bf16, DistributedDataParallel (fp32 grad buffers, reduced after the last microbatch), the
    Megatron optimizer (AdamW on fp32 masters, our hyperparameters)."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    t = cfg.train
    torch.manual_seed(t.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    model = megatron_model(config, cfg).cuda(torch.cuda.current_device())
    if config.bf16:
        model = Float16Module(config, model)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), module=model)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype),
        [model], use_gloo_process_groups=False)
    return model, optimizer


def megatron_batches(data: PrefetchedBatches, step: int, cfg: RunConfig,
                     device: torch.device) -> list[dict]:
    """One step's microbatches as GPTModel's keyword arguments (the causal mask given, True =
    masked, so nothing asks for a default mask)."""
    t, seq = cfg.train, cfg.model.seq_length
    mask_11SS = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(diagonal=1)
    positions_BS = torch.arange(seq, device=device).expand(t.micro_batch_size, seq)
    batches = []
    for mb in range(t.num_microbatches):
        tokens_BS, labels_BS = data.batch(step, data.rank, mb, t.micro_batch_size, seq)
        batches.append({"input_ids": tokens_BS.to(device), "labels": labels_BS.to(device),
                        "position_ids": positions_BS, "attention_mask": mask_11SS})
    return batches


def megatron_loss(losses_BS: torch.Tensor):
    """Megatron-core's loss function protocol: (loss sum, token count, what to report)."""
    total = losses_BS.float().sum()
    count = torch.tensor(losses_BS.numel(), dtype=torch.int, device=losses_BS.device)
    return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}


def megatron_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron-core's forward_step_func: the per-token losses of the next microbatch or, for
    its combined 1F1B (`return_schedule_plan`), the schedule plan that computes them."""
    batch = next(data_iterator)
    forward = model.build_schedule_plan if return_schedule_plan else model
    return forward(**batch), megatron_loss


def megatron_step(model, optimizer, batches: list[dict], cfg: RunConfig, lr: float) -> float:
    """One training step as Megatron-LM's train_step runs it -> the mean loss over
    microbatches and ranks."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    model.zero_grad_buffer()
    optimizer.zero_grad()
    reported = get_forward_backward_func()(
        forward_step_func=megatron_forward_step, data_iterator=iter(batches), model=model,
        num_microbatches=cfg.train.num_microbatches, seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.train.micro_batch_size, forward_only=False)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    sum_and_count = torch.stack([entry["lm loss"] for entry in reported]).sum(dim=0)
    dist.all_reduce(sum_and_count)
    return float(sum_and_count[0] / sum_and_count[1])


def run_megatron(cfg: RunConfig, groups: ParallelGroups, data: PrefetchedBatches,
                 steps: int) -> dict:
    """`steps` training steps of Megatron-core -> {"samples": [...]} or {"skipped": why}."""
    try:
        config = megatron_config(cfg, groups.ep_size)
    except AssertionError as error:
        return {"skipped": f"megatron-core refuses it: {error}"}
    try:
        return {"samples": _megatron_samples(config, cfg, groups, data, steps)}
    finally:
        config.no_sync_func = config.finalize_model_grads_func = None  # they hold the model
        release_memory(groups.device)


def _megatron_samples(config, cfg: RunConfig, groups: ParallelGroups, data: PrefetchedBatches,
                      steps: int) -> list[StepSample]:
    model, optimizer = megatron_training(config, cfg)

    def step_fn(step: int) -> float:
        batches = megatron_batches(data, step, cfg, groups.device)
        return megatron_step(model, optimizer, batches, cfg, lr_at(step, cfg.train))
    return [timed_step(groups.device, lambda s=step: step_fn(s)) for step in range(1, steps + 1)]


# ---------------------------------------------------------------------------- torchtitan
def run_torchtitan(cfg: RunConfig, groups: ParallelGroups, data: PrefetchedBatches,
                   steps: int, mode: str) -> dict:
    """`steps` training steps of torchtitan in `mode` -> {"samples": [...]} or {"skipped": why}
    (its refusal, or the error a build or step raised on every rank)."""
    from benchmarks.harness import peer_torchtitan
    why = peer_torchtitan.refusal(cfg, groups.world_size, mode, torch.cuda.is_available())
    if why is not None:
        return {"skipped": why}
    try:
        return {"samples": _torchtitan_samples(cfg, groups, data, steps, mode)}
    except Exception as error:  # noqa: BLE001 - reported per run, the other systems go on
        return {"skipped": f"torchtitan failed: {type(error).__name__}: {error}"}
    finally:
        release_memory(groups.device)


def _torchtitan_samples(cfg: RunConfig, groups: ParallelGroups, data: PrefetchedBatches,
                        steps: int, mode: str) -> list[StepSample]:
    from benchmarks.harness.peer_torchtitan import Session
    session = Session(cfg, groups.world_size, mode, groups.device)
    t = cfg.train

    def step_fn(step: int) -> float:
        batches = [data.batch(step, data.rank, mb, t.micro_batch_size, cfg.model.seq_length)
                   for mb in range(t.num_microbatches)]
        return session.step(batches, lr_at(step, t))
    try:
        return [timed_step(groups.device, lambda s=step: step_fn(s))
                for step in range(1, steps + 1)]
    finally:
        session.close()


def system_runs(systems: list[str], args) -> list[tuple]:
    """(system, the run's name, our mode its config is made with, our extra flags, runner)
    of every run of one shape."""
    wanted = [(system, mode, mode, (), RUNNERS[system]) for system in systems
              if system in RUNNERS for mode in MODES]
    if "epoverlap" in systems and args.ours_seq_flags:  # our sequential step with more flags
        wanted.append(("epoverlap", "seq_flags", "seq", args.ours_seq_flags, run_epoverlap))
    if "epoverlap" in systems and args.ours_ovl_flags:  # our overlap with more flags
        wanted.append(("epoverlap", "ovl_flags", "ovl", args.ours_ovl_flags, run_epoverlap))
    if "torchtitan" in systems:
        from benchmarks.harness.peer_torchtitan import MODES as TORCHTITAN_MODES
        wanted += [("torchtitan", mode, "seq", (), partial(run_torchtitan, mode=mode))
                   for mode in TORCHTITAN_MODES]
    return wanted


def torchtitan_caveats(systems: list[str]) -> tuple:
    if "torchtitan" not in systems:
        return ()
    from benchmarks.harness.peer_torchtitan import CAVEATS as TORCHTITAN_CAVEATS
    return TORCHTITAN_CAVEATS


RUNNERS = {"megatron": run_megatron, "epoverlap": run_epoverlap}


# ---------------------------------------------------------------------------- report
def header(report: dict) -> list[str]:
    """The lines printed above the tables: setup, caveats, the runs not run and why."""
    lines = [f"bench_peer: {report['world']} rank(s) (EP = {report['world']}), "
             f"{report['device']}, NCCL_P2P_DISABLE={report['nccl_p2p_disable']}, "
             f"{report['steps']} training steps per run ({report['warmup']} warmup), eager; "
             f"{nccl_environment_text(report.get('nccl_env', {}))}"]
    if "megatron" in report["systems"]:
        lines += [f"note: {caveat}" for caveat in CAVEATS]
    lines += [f"note: {caveat}" for caveat in torchtitan_caveats(report["systems"])]
    for r in report["results"]:
        for system, modes in r["runs"].items():
            lines += [f"not run: {r['shape']} {system} {mode}: {run['skipped']}"
                      for mode, run in modes.items() if "skipped" in run]
    return lines


# ---------------------------------------------------------------------------- main
def bench_shape(name: str, systems: list[str], groups: ParallelGroups, args,
                log: Callable[[str], None]) -> dict:
    steps = args.warmup + args.iters
    world = groups.world_size
    base = run_config(name, "seq", world, steps)
    data = PrefetchedBatches(base, groups.dp_rank, steps)
    rated = base.with_vocab_size(data.vocab_size)  # the model every system builds
    runs: dict = {}
    for system, run_name, mode, extra, runner in system_runs(systems, args):
        cfg = run_config(name, mode, world, steps, extra).with_vocab_size(data.vocab_size)
        raw = runner(cfg, groups, data, steps)
        run = summarize(raw["samples"], args.warmup, cfg) if "samples" in raw else raw
        runs.setdefault(system, {})[run_name] = run
        log(f"[bench_peer] {name} {system} {run_name}: {run_line(run)}")
    return {"shape": name, "flags": SHAPES[name] + PEER_FLAGS,
            "flops_per_token": training_flops_per_token(rated.model, rated.moe),
            "tokens_per_step_per_gpu": tokens_per_step_per_gpu(rated), "runs": runs,
            "derived": derived(runs)}


def parse_args(argv: Optional[list[str]]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"benchmarks/harness/bench_overlap.py shapes ({', '.join(SHAPES)})")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"of {', '.join(SYSTEMS)}: megatron needs the peer extra and "
                             "CUDA GPUs, torchtitan the peer extra")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--iters", type=int, default=5, help="timed steps after the warmup")
    parser.add_argument("--out-dir", default="runs/bench_peer")
    parser.add_argument("--ours-ovl-flags", default="",
                        help="also run our overlap with these training flags (one string, "
                             "e.g. \"--moe-grouped-gemm-sm-carveout 8 --moe-a2a-nccl-max-ctas "
                             "8\"), as mode ovl_flags")
    parser.add_argument("--ours-seq-flags", default="",
                        help="also run our sequential schedule with these training flags, as "
                             "mode seq_flags: with --ours-ovl-flags, the overlap gain of the "
                             "same flags (the ones that need the overlap, such as "
                             "--delay-wgrad-compute, left out)")
    args = parser.parse_args(argv)
    args.ours_ovl_flags = shlex.split(args.ours_ovl_flags)
    args.ours_seq_flags = shlex.split(args.ours_seq_flags)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.systems = [s for s in args.systems.split(",") if s]
    return args


def refusal(args) -> Optional[str]:
    """The one line saying why this run cannot start, or None."""
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        return f"bench_peer: --shapes {','.join(args.shapes)}: allowed: {', '.join(SHAPES)}"
    if not args.systems or any(s not in SYSTEMS for s in args.systems):
        return f"bench_peer: --systems {','.join(args.systems)}: allowed: {', '.join(SYSTEMS)}"
    if args.warmup < 0 or args.iters < 1:
        return (f"bench_peer: --warmup {args.warmup} --iters {args.iters}: the warmup must be "
                ">= 0 and the timed steps >= 1")
    if "megatron" in args.systems and not megatron_installed():
        return INSTALL_HINT
    if "torchtitan" in args.systems:
        from benchmarks.harness import peer_torchtitan
        if not peer_torchtitan.torchtitan_installed():
            return peer_torchtitan.INSTALL_HINT
    if "megatron" in args.systems and not torch.cuda.is_available():
        return ("bench_peer: --systems megatron: megatron-core's side runs on CUDA GPUs only "
                "and none is visible here; on CPU run --systems epoverlap")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for shape in args.shapes:
        try:
            validate_config(run_config(shape, "seq", world, args.warmup + args.iters), world,
                            torch.cuda.is_available())
        except ConfigError as error:
            return f"bench_peer: shape {shape}: {error}"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    problem = refusal(args)
    if problem is not None:
        if os.environ.get("RANK", "0") == "0":
            print(problem, file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    setup_environment(run_config(args.shapes[0], "ovl", world, 1), print)
    groups = init_distributed(world, "cuda" if torch.cuda.is_available() else "cpu")
    log = print if groups.rank == 0 else (lambda msg: None)
    results = []
    try:
        if "megatron" in args.systems:
            init_megatron(world)
        for name in args.shapes:
            results.append(bench_shape(name, args.systems, groups, args, log))
            if groups.rank == 0:  # after every shape: a run cut short keeps what it did
                write_report(full_report(args, world, results), args.out_dir)
    finally:
        if "megatron" in args.systems:
            destroy_megatron()
        destroy_distributed(groups)
    if groups.rank == 0:
        report = full_report(args, world, results)
        print("\n" + "\n".join(header(report)) + "\n\n" + markdown(results))
    return 0


def full_report(args, world: int, results: list) -> dict:
    return {"world": world, "systems": args.systems, "warmup": args.warmup,
            "steps": args.warmup + args.iters, "device": device_name(),
            "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE", "0"),
            "nccl_env": nccl_environment(),
            "ours_ovl_flags": args.ours_ovl_flags, "ours_seq_flags": args.ours_seq_flags,
            "caveats": list(CAVEATS) + list(torchtitan_caveats(args.systems)),
            "results": results}


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (gloo)"


if __name__ == "__main__":
    sys.exit(main())
