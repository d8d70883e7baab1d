"""The paths `--tune` chooses between, and the steps it takes: the config's side of the
measured path tuner (`training.tuning.tuner` times the paths and decides).

A path is a way to run the step that a built run can switch to at a step boundary without
changing the math (the overlap contract, docs/overlap.md: every schedule gives the same bits):

  an overlap plan       combined_1f1b; combined_1f1b_paired_ends where it differs (one pipeline
                        stage of one chunk, two or more microbatches; the training side drops
                        it when its memory estimate does not fit)
  delayed weight grads  off and on (a `+wgrad` suffix) for each overlap plan
  all-to-alls in waves  --moe-a2a-waves 4 (`TUNED_WAVES`, at most the local experts) on the
                        first overlap plan with delayed weight grads (a `+w4` suffix), where
                        the config allows waves (`config.dispatch.a2a_waves_blocker`) and the
                        flags leave the waves at 1; only that one path (each path replays its
                        own graphs: one more bank, not one per plan)
  once per rank         with --tune-allow-rounding only: the first overlap plan with delayed
                        weight grads and the dispatch once per rank (a `+once` suffix), where
                        the config can send once per rank (`once_per_rank_blocker`) and the
                        flags did not; it changes the combine's rounding, so a run that takes
                        it is not an untuned run's bits (its --tune-cache rerun is)
  the process group     with --moe-a2a-transport host_memory or peer_memory: the first
                        overlap plan with delayed weight grads and the all-to-alls on the
                        process group's own (NCCL) instead of the copy engines (a `+group`
                        suffix); the same bits
  sequential            last; no overlap

An axis the user pinned is not tuned: --overlap-plan given keeps that plan (it is still timed
against the sequential schedule), --delay-wgrad-compute keeps weight grads delayed on every
path (no name then carries `+wgrad`), and without the overlap
(--no-overlap-moe-expert-parallel-comm) there is nothing to tune. The paths are in a fixed
order, the flags' own path first: a tie keeps the earlier one. The deprecated
--overlap-probe-steps N is --tune on --tune-steps N over two paths, the flags' overlap plan and
sequential.

Left out: combined_1f1b_early_release (a memory lever: its order releases activations early,
not a faster step); the SM carveout of the experts' grouped GEMMs (--moe-grouped-gemm-sm-carveout:
its partner, the all-to-all's CTA limit --moe-a2a-nccl-max-ctas, is fixed when the EP
communicator is made, so the carveout alone cannot be switched as the lever it is).

Imports only `config.run`, `config.dispatch` and `config.dispatch_rules` (whose table holds
the rules of the graphs each path replays and of the once-per-rank path).
"""

from __future__ import annotations

from dataclasses import dataclass

from epoverlap.config.dispatch import a2a_waves_blocker, dispatch_choice
from epoverlap.config.dispatch_rules import newly_refused, refusal
from epoverlap.config.run import RunConfig
from epoverlap.config.sections import COPY_ENGINE_TRANSPORTS

SEQUENTIAL = "sequential"
DEFAULT_PLAN = "combined_1f1b"
PAIRED_ENDS = "combined_1f1b_paired_ends"
WGRAD = "+wgrad"
ONCE = "+once"
GROUP = "+group"  # the process group's all-to-all where the flags' goes on copy engines
# the wave count the tuner tries: 4 beat 8 and 1 through host memory (benchmarks/chunked.md)
TUNED_WAVES = 4


@dataclass(frozen=True)
class TunePath:
    """One path: its name (the step line's `tune:` and the log's `schedule`), the plan it
    runs and whether weight grads are delayed, its waves, dispatch and transport (built once
    into what a step runs by: `training.loop.path.ExecutionPath`)."""

    name: str
    plan: str
    delay_wgrad: bool
    waves: int = 1  # --moe-a2a-waves of the path's MoE layers
    once_per_rank: bool = False  # the dispatch once per rank where the flags' is not
    copy_engine: bool = False  # the all-to-alls on copy engines (--moe-a2a-transport
    # host_memory or peer_memory)


def probe_steps(cfg: RunConfig) -> int:
    """--overlap-probe-steps (deprecated), 0 when not given."""
    return cfg.overlap.overlap_probe_steps


def tune_mode(cfg: RunConfig) -> str:
    """on, off or auto: --tune, or on with the deprecated --overlap-probe-steps."""
    return "on" if probe_steps(cfg) > 0 else cfg.overlap.tune


def timed_steps(cfg: RunConfig) -> int:
    """Timed steps per path: --tune-steps, or the deprecated --overlap-probe-steps."""
    return probe_steps(cfg) or cfg.overlap.tune_steps


def candidate_paths(cfg: RunConfig) -> list[TunePath]:
    """Every path of this config, in the tie-break order (see the module docstring); one,
    the flags' own, when there is nothing to tune."""
    o = cfg.overlap
    if not o.overlap_moe_expert_parallel_comm:
        return [TunePath(SEQUENTIAL, SEQUENTIAL, bool(o.delay_wgrad_compute),
                         copy_engine=flags_copy_engine(cfg))]
    if probe_steps(cfg) > 0 or o.overlap_plan is not None:
        plans = [cfg.plan_name]
    else:
        plans = [DEFAULT_PLAN] + ([PAIRED_ENDS] if paired_ends_differs(cfg) else [])
    pinned_wgrad = probe_steps(cfg) > 0 or o.delay_wgrad_compute
    wgrads = [bool(o.delay_wgrad_compute)] if pinned_wgrad else [False, True]
    tuned_wgrad = len(wgrads) > 1
    waves, copy_engine = o.moe_a2a_waves, flags_copy_engine(cfg)
    paths = [TunePath(plan + (WGRAD if wgrad and tuned_wgrad else ""), plan, wgrad, waves,
                      copy_engine=copy_engine)
             for plan in plans for wgrad in wgrads]
    tried = tuned_waves(cfg)
    if tried > 1:
        paths.append(TunePath(plans[0] + (WGRAD if tuned_wgrad else "") + f"+w{tried}",
                              plans[0], True, tried, copy_engine=copy_engine))
    first_wgrad = True if tuned_wgrad else bool(o.delay_wgrad_compute)
    first = plans[0] + (WGRAD if first_wgrad and tuned_wgrad else "")
    if o.tune_allow_rounding and not once_per_rank_blocker(cfg):
        paths.append(TunePath(first + ONCE, plans[0], first_wgrad, waves, once_per_rank=True,
                              copy_engine=copy_engine))
    if copy_engine and probe_steps(cfg) == 0:
        paths.append(TunePath(first + GROUP, plans[0], first_wgrad, waves))
    return paths + [TunePath(SEQUENTIAL, SEQUENTIAL, bool(o.delay_wgrad_compute), waves,
                             copy_engine=copy_engine)]


def flags_copy_engine(cfg: RunConfig) -> bool:
    """Whether the flags' all-to-alls go on copy engines, through host memory or peer memory
    (--moe-a2a-transport host_memory, peer_memory)."""
    return cfg.parallel.moe_a2a_transport in COPY_ENGINE_TRANSPORTS


def once_per_rank_blocker(cfg: RunConfig) -> str:
    """Why the tuner has no once-per-rank path here ('' when it has): it needs EP > 1, the
    dropless or capacity (unpadded) dispatch one row per expert, flat, and all-to-alls in one
    piece (the budget's buffers and the layer in waves are sized for the flags' dispatch)."""
    if not cfg.moe.num_experts or (cfg.parallel.expert_model_parallel_size or 1) < 2:
        return "needs --expert-model-parallel-size > 1"
    flags = dispatch_choice(cfg)
    if flags.routing != "per_expert":
        return "the flags' dispatch already sends once per rank or host"
    return newly_refused(flags, flags.with_(routing="per_rank", tuning="once"))


def tuned_waves(cfg: RunConfig) -> int:
    """The wave count the tuner's path in waves has (module docstring); 1: none. Not with
    the deprecated probe (two paths), nor where the flags chose the waves."""
    if probe_steps(cfg) > 0 or cfg.overlap.moe_a2a_waves != 1 or not cfg.moe.num_experts:
        return 1
    ep = cfg.parallel.expert_model_parallel_size or 1
    waves = min(TUNED_WAVES, cfg.moe.num_experts // ep)
    return waves if waves > 1 and not a2a_waves_blocker(cfg, waves) else 1


def paired_ends_differs(cfg: RunConfig) -> bool:
    """Whether combined_1f1b_paired_ends is a path of its own here: one stage of one chunk
    (the plan builder's rule) and two or more microbatches (with one it is the plain plan)."""
    return (cfg.parallel.pipeline_model_parallel_size == 1 and cfg.virtual_stages == 1
            and cfg.train.num_microbatches >= 2)


def flags_path(cfg: RunConfig) -> TunePath:
    """The path the flags say (what --tune off runs)."""
    plan = cfg.plan_name
    return TunePath(plan, plan, bool(cfg.overlap.delay_wgrad_compute),
                    cfg.overlap.moe_a2a_waves, copy_engine=flags_copy_engine(cfg))


def untimed_steps(cfg: RunConfig, paths: int) -> int:
    """Steps before the timed window: the first step (compiles, allocator warm-up); with CUDA
    graphs the graphs' warm-up steps (the first path's capture after the last) and one step
    per other path that captures its graphs."""
    if cfg.cuda_graph.impl == "none":
        return 1
    return max(cfg.cuda_graph.warmup_steps, 1) + paths - 1


def steps_needed(cfg: RunConfig, paths: int) -> int:
    """Steps the tuner takes to decide among `paths` paths (each timed --tune-steps times)."""
    return untimed_steps(cfg, paths) + paths * timed_steps(cfg)


def paths_within(cfg: RunConfig, paths: list[TunePath], steps_left: int) -> list[TunePath]:
    """The paths the tuner can time in `steps_left` steps: all of them, else the first ones
    (the tie-break order) as far as the steps reach, the sequential path kept last as the
    baseline; [] when not even one overlap path and the sequential one fit."""
    sequential = [path for path in paths if path.plan == SEQUENTIAL]
    kept = [path for path in paths if path.plan != SEQUENTIAL]
    while kept and steps_needed(cfg, len(kept) + len(sequential)) > steps_left:
        kept.pop()
    within = kept + sequential
    return within if len(within) >= 2 and kept else []


def tune_blocker(cfg: RunConfig) -> str:
    """Why this config cannot be tuned ('' when it can), in the words of a ConfigError."""
    impl = cfg.cuda_graph.impl
    if not cfg.overlap.overlap_moe_expert_parallel_comm:
        return ("times the overlap's paths against the sequential schedule: needs "
                "--overlap-moe-expert-parallel-comm")
    if cfg.parallel.pipeline_model_parallel_size != 1:
        return "needs --pipeline-model-parallel-size 1 (one stage's plan is switched)"
    if cfg.parallel.dynamic_context_parallel and impl != "none":
        return ("switches paths that each replay their own graphs; under "
                "--dynamic-context-parallel the graphs are a runner per CP size, not per path: "
                "use --cuda-graph-impl none")
    return refusal(dispatch_choice(cfg).with_(tuning="paths"), "--tune")


def may_tune(cfg: RunConfig, device: str) -> bool:
    """Whether this run tunes, if it has the steps (the training side checks those after
    looking in --tune-cache: a cached decision needs none): --tune on (validated), or auto on
    CUDA where the config can be tuned and has two or more paths; never with off."""
    mode = tune_mode(cfg)
    if mode == "off" or tune_blocker(cfg) or len(candidate_paths(cfg)) < 2:
        return False
    return mode == "on" or device == "cuda"
