"""The rules of context parallelism and of per-document attention (--context-parallel-size,
--cp-comm-type, --dynamic-context-parallel, --reset-attention-mask, --reset-position-ids):
what they need and what they do not run with yet, each refusal one line naming the flag
(`check_config` runs them)."""

from __future__ import annotations

from epoverlap.config.cuda_graphs import AUTO
from epoverlap.config.parse import flag_of, require
from epoverlap.config.run import RunConfig


def validate_context_parallel(cfg: RunConfig, world_size: int) -> None:
    """--context-parallel-size and --cp-comm-type (model.context): every rank holds two whole
    chunks of each sequence; what CP does not run with yet is refused here."""
    p, m = cfg.parallel, cfg.model
    cp, pp, types = p.context_parallel_size, p.pipeline_model_parallel_size, p.cp_comm_type
    require(cp >= 1 and world_size % (cp * pp) == 0, "context_parallel_size", cp,
            f"CP x PP = {cp} x {pp} must divide the world size {world_size}")
    require(len(types) in (1, m.num_layers), "cp_comm_type", " ".join(types),
            f"give one type, or one per layer (--num-layers={m.num_layers})")
    for one in types:
        require(one in ("p2p", "allgather"), "cp_comm_type", one, "p2p or allgather: a2a "
                "and a2a+p2p (heads split over the CP ranks by an all-to-all) are not "
                "implemented")
    validate_dynamic_context_parallel(cfg)
    if cp == 1:
        return
    require(m.seq_length % (2 * cp) == 0, "context_parallel_size", cp,
            f"2 x CP must divide --seq-length={m.seq_length} (each rank holds 2 equal chunks)")
    require(m.attention_dropout == 0, "attention_dropout", m.attention_dropout,
            "must be 0 with --context-parallel-size > 1: attention dropout under context "
            "parallelism is not implemented")
    _context_parallel_graphs(cfg)
    require(cfg.moe.moe_router_load_balancing_type != "seq_aux_loss",
            "moe_router_load_balancing_type", "seq_aux_loss", "aux_loss or none with "
            "--context-parallel-size > 1: the per-sequence loss over a sequence split across "
            "the CP ranks is not implemented")


def _context_parallel_graphs(cfg: RunConfig) -> None:
    """CUDA graphs at CP > 1 (`graphs.capture`): per-layer graphs of the modules before the
    dispatch, whose attention graphs hold the K/V exchange where it runs inside the attention
    (the ring; the gather under dynamic CP) and compute only where the gather is a node."""
    g = cfg.cuda_graph
    require(g.impl in ("none", AUTO, "local"), "cuda_graph_impl", g.impl, "none or local "
            "with --context-parallel-size > 1: one graph of the whole iteration under context "
            "parallelism is not implemented")
    require(g.impl != "local" or (bool(g.modules) and "moe" not in g.modules),
            "cuda_graph_modules", " ".join(g.modules) or "(every module)", "attn, mlp, "
            "moe_router and/or moe_preprocess with --context-parallel-size > 1: graphs through "
            "the dispatch (moe, or whole layers) under context parallelism are not implemented")


def _power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def validate_dynamic_context_parallel(cfg: RunConfig) -> None:
    """--dynamic-context-parallel (model.context, `DynamicContext`): a set of powers of 2, the
    segments independent only under per-document attention, every rank S / CP tokens."""
    p, m = cfg.parallel, cfg.model
    cp, least = p.context_parallel_size, p.min_dynamic_context_parallel_size
    if not p.dynamic_context_parallel:
        require(least == 1, "min_dynamic_context_parallel_size", least,
                "1 without --dynamic-context-parallel (it is read only with it)")
        require(p.max_seqlen_per_dp_cp_rank is None, "max_seqlen_per_dp_cp_rank",
                p.max_seqlen_per_dp_cp_rank, "unset without --dynamic-context-parallel (it is "
                "read only with it)")
        return
    require(cp > 1 and _power_of_2(cp), "dynamic_context_parallel", cp,
            "needs --context-parallel-size a power of 2 above 1 (the sizes are its halvings)")
    require(_power_of_2(least) and least <= cp, "min_dynamic_context_parallel_size", least,
            f"a power of 2 from 1 to --context-parallel-size={cp}")
    require(p.max_seqlen_per_dp_cp_rank in (None, m.seq_length // cp),
            "max_seqlen_per_dp_cp_rank", p.max_seqlen_per_dp_cp_rank,
            f"--seq-length / --context-parallel-size = {m.seq_length // cp}: every rank holds "
            "S / CP tokens at every size (variable lengths per rank are not implemented)")
    require(cfg.data.reset_attention_mask, "dynamic_context_parallel", True,
            "needs --reset-attention-mask: a segment of a packed sample is computed apart from "
            "the others only when attention stays inside each document")
    _dynamic_cp_graphs(cfg)


def _dynamic_cp_graphs(cfg: RunConfig) -> None:
    """CUDA graphs under dynamic CP (`graphs.banks.SizeBanks`): per-layer graphs of attention
    and dense MLPs, a runner per CP size, each size's attention graphs holding the exchange
    over that size's group (whose ranks all choose the same sizes); nothing that holds a
    collective over ranks choosing sizes apart."""
    g = cfg.cuda_graph
    if g.impl in ("none", AUTO):
        return
    require(g.impl == "local", "cuda_graph_impl", g.impl, "none or local with "
            "--dynamic-context-parallel (a runner per CP size of per-layer graphs)")
    require(bool(g.modules) and set(g.modules) <= {"attn", "mlp"}, "cuda_graph_modules",
            " ".join(g.modules) or "(every module)", "attn and/or mlp with "
            "--dynamic-context-parallel: graphs of the MoE modules under dynamic context "
            "parallelism are not implemented")
    require(flag_of("cuda_graph_impl") not in cfg.defaulted, "cuda_graph_impl", g.impl,
            "given, not the auto scope's, with --dynamic-context-parallel: the ranks capture "
            "at the steps their sizes come, and the auto scope agrees on a capture over all")


def validate_documents(cfg: RunConfig) -> None:
    """--reset-attention-mask / --reset-position-ids: what they do not run with yet. Per-layer
    graphs (`--cuda-graph-impl local`) take the microbatch's tokens as an input of the
    attention's ranges (`model.transformer`), so a replay reads its own documents."""
    d, m = cfg.data, cfg.model
    if not d.reads_documents:
        return
    name = "reset_attention_mask" if d.reset_attention_mask else "reset_position_ids"
    require(cfg.cuda_graph.impl != "full_iteration", "cuda_graph_impl", cfg.cuda_graph.impl,
            f"none or local with {flag_of(name)}: one graph of the whole iteration with "
            "per-document attention is not tested yet (per-layer graphs are)")
    require(not d.reset_attention_mask or m.attention_dropout == 0, "attention_dropout",
            m.attention_dropout, "must be 0 with --reset-attention-mask: attention dropout "
            "with per-document attention is not implemented")
    require(d.max_documents_per_sample >= 1, "max_documents_per_sample",
            d.max_documents_per_sample, "at least 1")
