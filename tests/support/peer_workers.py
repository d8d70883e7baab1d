"""Worker for tests/test_bench_peer.py (spawned by dist_helpers.run_ranks): Megatron-core's
GPTModel as benchmarks/harness/bench_peer.py translates our config, built on the CPU beside our model.

Megatron-core's layers ask for the current CUDA device and its token dispatcher makes a CUDA
stream when built; in this process (no other use for torch.cuda) the device is the CPU and the
stream a placeholder the build never touches. Everything else is bench_peer's and
megatron-core's own code."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from dist_helpers import one_process_model


def _dense_shapes(named_parameters) -> list[tuple]:
    return sorted(tuple(p.shape) for name, p in named_parameters
                  if ".experts." not in f".{name}")


def _expert_count(named_parameters) -> int:
    return sum(p.numel() for name, p in named_parameters if ".experts." in f".{name}")


def megatron_and_our_parameters(rank, world_size, flags):
    """-> {"megatron": (dense shapes, expert elements), "epoverlap": (...)} for the model of
    `flags` (our training flags), EP = world_size; and the refusal of the overlap at EP 1."""
    from epoverlap.config import parse_config
    from benchmarks.harness import bench_peer
    from megatron.core.transformer.moe import token_dispatcher
    torch.cuda.current_device = lambda: "cpu"
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    dist.init_process_group("gloo")
    try:
        bench_peer.init_megatron(world_size)
        cfg = parse_config(flags).with_vocab_size(300)
        config = dataclasses.replace(bench_peer.megatron_config(cfg, world_size),
                                     use_cpu_initialization=True)
        theirs = list(bench_peer.megatron_model(config, cfg).named_parameters())
        ours = list(one_process_model(cfg, "torch", torch.float32, "cpu")[0].named_parameters())
        overlap = parse_config(flags + ["--overlap-moe-expert-parallel-comm"])
        try:
            bench_peer.megatron_config(overlap, 1)
            refusal = None
        except AssertionError as error:
            refusal = str(error)
        return {"megatron": (_dense_shapes(theirs), _expert_count(theirs)),
                "epoverlap": (_dense_shapes(ours), _expert_count(ours)),
                "config": {name: getattr(config, name) for name in bench_peer.SHARED_MOE_FIELDS},
                "ep1_overlap_refusal": refusal}
    finally:
        bench_peer.destroy_megatron()
        dist.destroy_process_group()


# torchtitan's modules that keep the device type they found at import ("cuda" where none is)
TORCHTITAN_DEVICE_MODULES = ("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims",
                             "torchtitan.distributed.utils",
                             "torchtitan.models.common.token_dispatcher")


def torchtitan_cpu_steps(rank, world_size, flags, steps):
    """bench_peer's torchtitan side (its all-to-all mode, eager) training `steps` steps on gloo
    ranks, EP = world_size -> the losses. torchtitan presumes an accelerator (its meshes take
    "cuda" where none is found); here its modules are told the CPU instead, the one change."""
    import importlib
    from epoverlap.config import parse_config
    from benchmarks.harness.peer_torchtitan import Session
    for name in TORCHTITAN_DEVICE_MODULES:
        module = importlib.import_module(name)
        module.device_type, module.device_module = "cpu", torch.cpu
    dist.init_process_group("gloo")
    try:
        cfg = parse_config(flags).with_vocab_size(256)
        session = Session(cfg, world_size, "a2a", torch.device("cpu"))
        generator = torch.Generator().manual_seed(rank)
        t, seq = cfg.train, cfg.model.seq_length
        losses = []
        for _ in range(steps):
            batches = [tuple(torch.randint(0, 256, (t.micro_batch_size, seq), generator=generator)
                             for _ in range(2)) for _ in range(t.num_microbatches)]
            losses.append(session.step(batches, t.lr))
        session.close()
        return losses
    finally:
        dist.destroy_process_group()
