"""The job's defaults, resolved in one place whichever command starts it.

Five flags default to `auto` (a sixth, the budget, follows the graph scope), because their
best value depends on the job: how many ranks it has, whether they run on CUDA devices, and
over which link. `resolve_config` sets them once the world size and the device are known, so
`torchrun -m epoverlap.train`, `epoverlap-train` and `epoverlap-launch` resolve the same
values:

  --expert-model-parallel-size       every rank of a pipeline stage (world / PP), or the largest
                                     size that divides both them and the experts; 1 without
                                     MoE layers
  --bf16                             on CUDA devices
  --overlap-moe-expert-parallel-comm on with EP > 1 and MoE layers
  --cuda-graph-impl                  on CUDA: over a fast link (`parallel.link`: one host,
                                     NCCL's peer-to-peer on, peer access between its GPUs
                                     and NVLink on each, or peer access where NVML cannot
                                     say), full_iteration over the sync-free budget dispatch
                                     (--moe-dispatch-budget 1.25: still dropless; with
                                     --moe-dispatch-budget-memory 20, so a router that keeps
                                     overflowing it is not rerun every step, and
                                     --moe-dispatch-budget-fit, so its buffers follow the
                                     demand) when the dispatch is dropless and not through
                                     host memory; elsewhere, or where a rule refuses
                                     that, local capturing attn
                                     moe_router moe_preprocess; none
                                     with --context-parallel-size > 1
                                     (graphs there are given, not
                                     chosen: not yet measured)
  --moe-dispatch-hierarchy           node where the EP group spans two or more whole hosts
                                     (torchrun's nodes, or --emulate-hosts) and, routing
                                     balanced, it sends at most 0.8 of the flat dispatch's rows
                                     between them (tokens whose experts share a host cross
                                     once); flat otherwise (one host; top-1; experts spread
                                     over so many hosts that few tokens share one, where its
                                     second stage costs more than it saves)

Which schedule runs (sequential or an overlap plan, delayed weight grads) the path tuner
measures on GPUs (`--tune auto`, config.tuning and training.tuning.tuner).

A value given on the command line (or by a preset) is never changed. Each auto value is taken
only where every rule accepts it beside the other flags given (`config.validate.check_config`);
otherwise that flag resolves to its off value (fp32, the sequential schedule, no graphs), so an
auto default never turns a command line that was valid into an error. The flags an auto default
set are listed in `RunConfig.defaulted` (the run's path line says where each choice came from),
and the link the auto graph scope was chosen over in `RunConfig.link` (the path line names it).

`validate_config` = resolve, then check every rule.
"""

from __future__ import annotations

import dataclasses
import math

from epoverlap.config.cuda_graphs import AUTO, EP_OVERLAP_MODULES
from epoverlap.config.dispatch import BY_HOST_MAX_SHARE, DispatchMode, by_host_row_share
from epoverlap.config.run import RunConfig
from epoverlap.config.sections import COPY_ENGINE_TRANSPORTS, COPY_SLOT_KIB
from epoverlap.config.tuning import candidate_paths, may_tune
from epoverlap.config.validate import MAX_LAYERS, check_config
from epoverlap.errors import ConfigError
from epoverlap.parallel.link import Link, find_link
from epoverlap.parallel.transport import ranks_per_host

EP_FLAG = "--expert-model-parallel-size"
BF16_FLAG = "--bf16"
OVERLAP_FLAG = "--overlap-moe-expert-parallel-comm"
SEQUENTIAL_FLAG = "--no-overlap-moe-expert-parallel-comm"  # pins the sequential schedule
GRAPHS_FLAG = "--cuda-graph-impl"
BUDGET_FLAG = "--moe-dispatch-budget"
HIERARCHY_FLAG = "--moe-dispatch-hierarchy"
FULL_ITERATION_BUDGET = 1.25  # block rows / mean rows per rank pair; overflow reruns the step
BUDGET_MEMORY_STEPS = 20  # a step starts at the largest level one of the last 20 needed


def resolve_config(cfg: RunConfig, world_size: int, cuda_available: bool) -> RunConfig:
    """`cfg` for this world (`RunConfig.for_world`) with every `auto` default set (see the
    module docstring). Idempotent."""
    cfg = cfg.for_world(world_size)
    if cfg.parallel.moe_a2a_host_slot_kib is None:  # not an auto choice: the transport's size
        cfg = _with(cfg, "parallel", moe_a2a_host_slot_kib=COPY_SLOT_KIB.get(
            cfg.parallel.moe_a2a_transport, COPY_SLOT_KIB["process_group"]))  # (refused later)
    if not _has_auto(cfg):
        return cfg
    on_cuda = cfg.resolved_device(cuda_available) == "cuda"
    defaulted = list(cfg.defaulted)
    hierarchy_auto = cfg.moe.moe_dispatch_hierarchy == AUTO
    if cfg.parallel.expert_model_parallel_size is None:
        cfg = _with(cfg, "parallel", expert_model_parallel_size=auto_ep_size(cfg, world_size))
        defaulted.append(EP_FLAG)
    # each at its off value first; then every wanted value at once, and where a rule refuses
    # that, one at a time (the overlap first: other flags given may need it)
    wanted = []  # per auto flag, its values in order of preference
    if cfg.overlap.overlap_moe_expert_parallel_comm is None:
        cfg = _with(cfg, "overlap", overlap_moe_expert_parallel_comm=False)
        defaulted.append(OVERLAP_FLAG)
        wanted.append([_overlap] if _wants_overlap(cfg) else [])
    if cfg.train.bf16 is None:
        cfg = _with(cfg, "train", bf16=False)
        defaulted.append(BF16_FLAG)
        wanted.append([_bf16] if on_cuda else [])
    if cfg.cuda_graph.impl == AUTO:
        cfg = _with(cfg, "cuda_graph", impl="none")
        defaulted.append(GRAPHS_FLAG)
        link = find_link(world_size, cfg.parallel.emulate_hosts) if on_cuda else None
        if link is not None:
            cfg = dataclasses.replace(cfg, link=link.text())
        wanted.append(_graph_choices(cfg, link) if link is not None else [])
    if hierarchy_auto:  # named among the auto choices only where it chose node
        cfg = _with(cfg, "moe", moe_dispatch_hierarchy="flat")
        wanted.append([_by_host] if _spans_hosts(cfg, world_size) else [])
    budget = cfg.moe.moe_dispatch_budget
    cfg = _take_wanted(cfg, [options for options in wanted if options], world_size,
                       cuda_available)
    if cfg.moe.moe_dispatch_budget != budget:
        defaulted.append(BUDGET_FLAG)
    if hierarchy_auto and DispatchMode.of(cfg.moe).by_host:
        defaulted.append(HIERARCHY_FLAG)
    return dataclasses.replace(cfg, defaulted=tuple(defaulted))


def _graph_choices(cfg: RunConfig, link: Link) -> list:
    """The auto graph scope on CUDA, preferred first: over a fast link (`parallel.link`: every
    rank finds the same), one graph of the whole iteration over the sync-free budget dispatch
    (it moves a budget's fixed blocks, more bytes than the dropless dispatch: where bytes bind,
    over PCIe, through host memory or between hosts, that loses, so there the partial graphs
    come first, as with the copy-engine transports, host_memory and peer_memory); then
    partial graphs. None under context parallelism: its graphs (`config.context_rules`) are
    the flags' to give."""
    if cfg.parallel.context_parallel_size > 1:
        return []
    if (link.fast and DispatchMode.of(cfg.moe).name == "dropless"
            and cfg.parallel.moe_a2a_transport not in COPY_ENGINE_TRANSPORTS):
        return [_full_iteration, _partial_graphs]
    return [_partial_graphs]


def validate_config(cfg: RunConfig, world_size: int, cuda_available: bool) -> None:
    """Check every rule of `cfg` as this world resolves it; raise ConfigError naming the flag.
    Touches no process group."""
    check_config(resolve_config(cfg, world_size, cuda_available), world_size, cuda_available)


def auto_ep_size(cfg: RunConfig, world_size: int) -> int:
    """The largest EP size that divides both the ranks of a pipeline stage and the experts."""
    stage_ranks = cfg.stage_size(world_size)
    if not _has_moe_layers(cfg) or stage_ranks < 1:
        return 1
    return math.gcd(stage_ranks, cfg.moe.num_experts)


def _has_auto(cfg: RunConfig) -> bool:
    return (cfg.parallel.expert_model_parallel_size is None or cfg.train.bf16 is None
            or cfg.overlap.overlap_moe_expert_parallel_comm is None
            or cfg.cuda_graph.impl == AUTO or cfg.moe.moe_dispatch_hierarchy == AUTO)


def _spans_hosts(cfg: RunConfig, world_size: int) -> bool:
    """Whether the EP group spans two or more whole hosts and the hierarchical dispatch would
    send at most `BY_HOST_MAX_SHARE` of the flat dispatch's rows between them (tokens whose
    experts share hosts: what it saves on; top-1 saves nothing)."""
    ep, moe = cfg.parallel.expert_model_parallel_size, cfg.moe
    per_host = ranks_per_host(world_size, cfg.parallel.emulate_hosts)
    if (not _has_moe_layers(cfg) or not 1 <= ep <= world_size or ep % per_host
            or ep // per_host < 2 or not 1 <= moe.moe_router_topk <= moe.num_experts
            or moe.num_experts % (ep // per_host)):
        return False  # not a layout over hosts (or refused by the check, naming the flag)
    return by_host_row_share(moe.num_experts, moe.moe_router_topk,
                             ep // per_host) <= BY_HOST_MAX_SHARE


def _by_host(cfg: RunConfig) -> RunConfig:
    return _with(cfg, "moe", moe_dispatch_hierarchy="node")


def _has_moe_layers(cfg: RunConfig) -> bool:
    """Whether the model has MoE layers (a --moe-layer-freq validation refuses counts as yes:
    the refusal comes from the check, naming it)."""
    if not cfg.moe.num_experts:
        return False
    if not 1 <= cfg.model.num_layers <= MAX_LAYERS:  # refused by the check; build no pattern
        return True
    try:
        return any(cfg.moe_layer_pattern())
    except (ValueError, ArithmeticError, ConfigError):
        return True


def _wants_overlap(cfg: RunConfig) -> bool:
    return cfg.parallel.expert_model_parallel_size > 1 and _has_moe_layers(cfg)


def _bf16(cfg: RunConfig) -> RunConfig:
    return _with(cfg, "train", bf16=True)


def _overlap(cfg: RunConfig) -> RunConfig:
    return _with(cfg, "overlap", overlap_moe_expert_parallel_comm=True)


def _full_iteration(cfg: RunConfig) -> RunConfig:
    """One graph of the whole iteration, over the budget dispatch (dropless: an overflowing
    step is rerun at a larger budget), fitted to the demand."""
    cfg = _with(cfg, "moe", moe_dispatch_budget=FULL_ITERATION_BUDGET,
                moe_dispatch_budget_memory=BUDGET_MEMORY_STEPS, moe_dispatch_budget_fit=True)
    return _with(cfg, "cuda_graph", impl="full_iteration", modules=(), inference_scope="none")


def _partial_graphs(cfg: RunConfig) -> RunConfig:
    """Partial graphs of the segments before the dispatch (as `--cuda-graph-impl local
    --cuda-graph-modules attn moe_router moe_preprocess`, or the modules given)."""
    graphs = cfg.cuda_graph
    modules = graphs.modules or EP_OVERLAP_MODULES
    scope = "layer" if graphs.inference_scope == "none" else graphs.inference_scope
    return _with(cfg, "cuda_graph", impl="local", modules=modules, inference_scope=scope)


def _take_wanted(cfg: RunConfig, wanted: list, world_size: int, cuda_available: bool
                 ) -> RunConfig:
    """`cfg` with each flag's first choice (`wanted`: per flag, its changes RunConfig ->
    RunConfig in order of preference) where the rules accept them together; else flag by
    flag, the first choice the rules accept beside those kept (none: the off value stays)."""
    if not wanted:
        return cfg
    everything = cfg
    for options in wanted:
        everything = options[0](everything)
    if _accepted(everything, world_size, cuda_available):
        return everything
    for options in wanted:
        for option in options:
            changed = option(cfg)
            if _accepted(changed, world_size, cuda_available):
                cfg = changed
                break
    return cfg


def _accepted(cfg: RunConfig, world_size: int, cuda_available: bool) -> bool:
    """Whether every rule accepts `cfg`, the output paths' aside (no auto value changes a
    path; `validate_config` checks them once, on the result)."""
    try:
        check_config(cfg, world_size, cuda_available, paths=False)
    except ConfigError:
        return False
    return True


def _with(cfg: RunConfig, section: str, **changes) -> RunConfig:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                    **changes)})


def path_text(cfg: RunConfig, device: str) -> str:
    """The resolved path of a run in one line: dispatch, graph scope (and the link the auto
    one was chosen over, with why), schedule and delayed wgrad (or the paths the tuner picks
    among), the levers set, and which of them an `auto` default chose (the others the user
    gave)."""
    o, p, graphs = cfg.overlap, cfg.parallel, cfg.cuda_graph
    mode = DispatchMode.of(cfg.moe)
    dispatch = mode.name + (", by host" if mode.by_host else
                            ", once per rank" if mode.once_per_rank else "")
    if o.moe_a2a_waves > 1:
        dispatch += f", {o.moe_a2a_waves} waves"
    scope = graphs.impl if graphs.impl != "local" else \
        f"local ({' '.join(graphs.modules) or 'whole layers'})"
    levers = [text for text, on in (
        (f"SM carveout {p.moe_grouped_gemm_sm_carveout}",
         p.moe_grouped_gemm_sm_carveout is not None),
        (f"NCCL max CTAs {p.moe_a2a_nccl_max_ctas}", p.moe_a2a_nccl_max_ctas is not None),
        (f"NCCL min CTAs {p.moe_a2a_nccl_min_ctas}", p.moe_a2a_nccl_min_ctas is not None),
        (f"comm stream priority {o.comm_stream_priority}", o.comm_stream_priority != "high"),
        (f"all-to-all over {p.moe_a2a_transport.replace('_', ' ')} "
         f"({p.moe_a2a_host_slot_kib} KiB slots)",
         p.moe_a2a_transport in COPY_ENGINE_TRANSPORTS))
        if on]
    auto = ", ".join(cfg.defaulted) or "none"
    schedule = (f"schedule {cfg.plan_name} | delayed wgrad "
                f"{'on' if o.delay_wgrad_compute else 'off'}")
    if may_tune(cfg, device):
        names = ", ".join(path.name for path in candidate_paths(cfg))
        schedule = f"schedule and delayed wgrad: the tuner's pick of {names}"
    if cfg.link:
        scope += f" | link {cfg.link}"
    return (f"path: dispatch {dispatch} | graphs {scope} | {schedule} | levers "
            f"{', '.join(levers) or 'none'} | {'bf16' if cfg.train.bf16 else 'fp32'} | "
            f"set by auto defaults: {auto}; the rest as given")
