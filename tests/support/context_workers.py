"""Per-rank bodies of the context-parallel gloo tests (importable, so spawn can pickle them)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from epoverlap.config import parse_config
from epoverlap.model.context import ContextParallel
from epoverlap.parallel.comm import ContextComm
from epoverlap.parallel.groups import destroy_distributed, init_distributed
from epoverlap.training.loop.trainer import Trainer

from checkpoint_workers import run as train_losses
from gloo_workers import TINY


def reference_attention(q_BQSD, k_BGSD, v_BGSD) -> torch.Tensor:
    """Causal grouped-query attention in float64 with an explicit mask: the whole sequence on
    one rank, written apart from the model's (no SDPA, no log-sum-exp merging)."""
    q, k, v = (x.double() for x in (q_BQSD, k_BGSD, v_BGSD))
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    seq = q.shape[2]
    allowed = torch.arange(seq).view(-1, 1) >= torch.arange(seq).view(1, -1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_against_reference(rank, world_size, comm_type):
    """This rank's CP attention output and its q/k/v grads, beside the reference's rows and
    grads at this rank's positions (one CP group of the whole world)."""
    groups = init_distributed(1, "cpu", timeout_minutes=2, cp_size=world_size)
    try:
        gen = torch.Generator().manual_seed(7)
        seq, B, Q, G, D = 8 * world_size, 2, 4, 2, 8
        whole = [torch.randn(B, heads, seq, D, generator=gen, dtype=torch.float64)
                 for heads in (Q, G, G)]
        context = ContextParallel(ContextComm(groups.cp), comm_type, seq, groups.device)
        pos = context.positions
        mine = [x[:, :, pos].float().requires_grad_(True) for x in whole]
        out = context.attention(*mine)
        grad_out = torch.randn(B, Q, seq, D, generator=gen, dtype=torch.float64)
        out.backward(grad_out[:, :, pos].float())
        ref_in = [x.clone().requires_grad_(True) for x in whole]
        ref = reference_attention(*ref_in)
        ref.backward(grad_out)
        return {"out": (out.detach().double(), ref[:, :, pos].detach()),
                **{name: (x.grad.double(), r.grad[:, :, pos])
                   for name, x, r in zip("qkv", mine, ref_in)}}
    finally:
        destroy_distributed(groups)


def cp_losses(rank, world_size, cp, ep, flags):
    """Losses of a short run at CP `cp` (every flag set in `flags`), layer 0's nodes
    (name, lane) and the run's banner."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3, cp_size=cp)
    try:
        cfg = parse_config(TINY + ["--expert-model-parallel-size", str(ep),
                                   "--context-parallel-size", str(cp)] + list(flags))
        trainer = Trainer(cfg, groups, log=lambda msg: None)
        try:
            nodes = [(spec.name, spec.lane) for spec in trainer.model.node_specs()
                     if spec.layer == 0]
            return [r.loss for r in trainer.train()], nodes, trainer.describe()
        finally:
            trainer.close()
    finally:
        destroy_distributed(groups)


def cp_checkpoint_run(rank, world_size, cp, ep, flags, save_dir=None, resume_from=None):
    """Losses of a run at CP `cp`, saving every 2 steps to `save_dir` and/or resuming from the
    checkpoint folder `resume_from`."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3, cp_size=cp)
    try:
        argv = TINY + ["--expert-model-parallel-size", str(ep), "--context-parallel-size",
                       str(cp)] + list(flags)
        if save_dir is not None:
            argv += ["--save", save_dir, "--save-interval", "2"]
        return train_losses(groups, argv, Path(resume_from) if resume_from else None)
    finally:
        destroy_distributed(groups)


def cp_pipeline_losses(rank, world_size, cp, pp, flags):
    """Losses of a short run at CP `cp` over `pp` pipeline stages (EP 1)."""
    groups = init_distributed(1, "cpu", timeout_minutes=3, cp_size=cp, pp_size=pp)
    try:
        return train_losses(groups, TINY + [
            "--expert-model-parallel-size", "1", "--context-parallel-size", str(cp),
            "--pipeline-model-parallel-size", str(pp)] + list(flags))
    finally:
        destroy_distributed(groups)


EOD_VOCAB = 50  # NullTokenizer ids 0..49; the end-of-document id is 50


def write_short_documents(prefix: str, count: int = 400, seed: int = 5) -> str:
    """An indexed dataset of `count` documents of 3-20 ids, each ended by the end-of-document
    id: many document ends in every sequence, unevenly over a CP group's chunks."""
    import numpy as np

    from epoverlap.data.indexed import IndexedWriter
    rng = np.random.default_rng(seed)
    with IndexedWriter(prefix) as writer:
        for _ in range(count):
            ids = rng.integers(0, EOD_VOCAB, size=int(rng.integers(3, 21)))
            writer.add_document(np.append(ids, EOD_VOCAB))
    return prefix


def cp_indexed_losses(rank, world_size, cp, prefix, flags):
    """Losses of a short run at CP `cp` (EP 1) on the indexed dataset `prefix`."""
    groups = init_distributed(1, "cpu", timeout_minutes=3, cp_size=cp)
    try:
        return train_losses(groups, indexed_argv(prefix, cp) + list(flags))
    finally:
        destroy_distributed(groups)


def write_aligned_documents(prefix: str, unit: int, count: int = 300, seed: int = 6) -> str:
    """An indexed dataset of documents of `unit` (3 in 5), 2 x or 4 x `unit` ids (the last the
    end-of-document id): every document ends at a multiple of `unit` of the token stream, so
    a sample either has an end before its position k x `unit` or runs a document across it
    (dynamic CP's sizes then vary from microbatch to microbatch)."""
    import numpy as np

    from epoverlap.data.indexed import IndexedWriter
    rng = np.random.default_rng(seed)
    with IndexedWriter(prefix) as writer:
        for _ in range(count):
            length = unit * int(rng.choice([1, 1, 1, 2, 4]))
            writer.add_document(np.append(rng.integers(0, EOD_VOCAB, size=length - 1),
                                          EOD_VOCAB))
    return prefix


def indexed_argv(prefix: str, cp: int, ep: int = 1) -> list[str]:
    """TINY on the indexed dataset `prefix` at CP `cp` and EP `ep`."""
    return [flag for flag in TINY if flag != "--mock-data"] + [
        "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size",
        str(EOD_VOCAB), "--split", "100,0,0", "--expert-model-parallel-size", str(ep),
        "--context-parallel-size", str(cp)]


def dynamic_cp_runs(rank, world_size, ep, prefix, flag_sets):
    """One CP group of the whole world (EP `ep`) on the indexed dataset `prefix`: for each
    flag set a run's losses and the microbatches dynamic CP ran at each size ({} when
    fixed), in one process group."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3, cp_size=world_size)
    try:
        results = []
        for flags in flag_sets:
            trainer = Trainer(parse_config(indexed_argv(prefix, world_size, ep) + list(flags)),
                              groups, log=lambda msg: None)
            try:
                losses = [r.loss for r in trainer.train()]
                context = trainer.model.context
                results.append((losses, dict(context.chosen) if context.dynamic else {}))
            finally:
                trainer.close()
        return results
    finally:
        destroy_distributed(groups)


DYNAMIC_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
                  "--cuda-graph-warmup-steps", "1", "--cuda-graph-check-inputs"]


def _counting_graphs():
    """The emulated graph backend (`graph_emulation`), one per runner, counting its replays."""
    from graph_emulation import EmulatedGraphs

    class Counting(EmulatedGraphs):
        def __init__(self, device):
            super().__init__(device)
            self.replays = 0

        def capture(self, body, generators):
            graph = super().capture(body, generators)

            def replay():
                self.replays += 1
                body()
            graph.replay = replay
            return graph
    return Counting


def _runner_state(runner) -> tuple:
    """(captured, the shapes of the tokens its slot buffers hold, its replays)."""
    tokens = sorted({tuple(b.inputs["tokens"].shape) for b in runner.slot_buffers.values()
                     if "tokens" in b.inputs})
    backend = runner.context.backend
    return runner.captured, tokens, backend.replays if backend is not None else 0


def _eager_and_graphed(groups, argv: list[str], graphs: list[str]) -> list:
    """`argv` run eagerly, then with `graphs` under the emulated backend, in one process
    group: a `_run_state` per run."""
    return [_run_state(groups, argv + extra) for extra in ([], graphs)]


def _run_state(groups, argv: list[str]) -> tuple:
    """A run of `argv` (graphs under the emulated backend): (losses, grad norms, the parameters
    after the last step, the microbatches dynamic CP ran at each size ({} when fixed), each
    runner's `_runner_state` by CP size (the run's size when fixed; {} eager), layer 0's node
    names)."""
    cfg = parse_config(argv)
    trainer = Trainer(cfg, groups, log=lambda msg: None, graph_backend=_counting_graphs())
    try:
        results = trainer.train()
        context = trainer.model.context  # None at CP 1
        dynamic = context is not None and context.dynamic
        runners = {}
        if cfg.cuda_graph.impl == "local":
            bank = trainer.parts.graph_banks.active
            runners = ({size: _runner_state(r) for size, r in bank.runners.items()}
                       if dynamic else {context.size if context else 1: _runner_state(bank)})
        params = torch.cat([p.detach().float().flatten() for p in trainer.model.parameters()])
        nodes = [spec.name for spec in trainer.model.node_specs() if spec.layer == 0]
        return ([r.loss for r in results], [r.grad_norm for r in results], params,
                dict(context.chosen) if dynamic else {}, runners, nodes)
    finally:
        trainer.close()


def dynamic_cp_graph_runs(rank, world_size, ep, prefix, flags):
    """Dynamic CP at CP = world (EP `ep`) on `prefix`, eager then with per-layer graphs of
    attention under the emulated graph backend (`_eager_and_graphed`)."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3, cp_size=world_size)
    try:
        return _eager_and_graphed(groups, indexed_argv(prefix, world_size, ep) + list(flags)
                                  + ["--dynamic-context-parallel"], DYNAMIC_GRAPHS)
    finally:
        destroy_distributed(groups)


CP_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router",
             "--cuda-graph-warmup-steps", "1", "--cuda-graph-check-inputs"]


def cp_graph_runs(rank, world_size, ep, flags):
    """Fixed CP = world (EP `ep`), eager then with per-layer graphs of attention and the
    router under the emulated graph backend (`_eager_and_graphed`)."""
    groups = init_distributed(ep, "cpu", timeout_minutes=3, cp_size=world_size)
    try:
        argv = TINY + ["--expert-model-parallel-size", str(ep), "--context-parallel-size",
                       str(world_size)] + list(flags)
        return _eager_and_graphed(groups, argv, CP_GRAPHS)
    finally:
        destroy_distributed(groups)


def document_graph_runs(rank, world_size, prefix, flags, stale=False):
    """CP = world (EP 1) on the documents of `prefix`, eager then with per-layer graphs of
    attention and the router under the emulated backend (`_eager_and_graphed`); with `stale`
    a third run whose range graphs copy the tokens in at their first replay only, as graphs
    that held the tokens instead of taking them as an input would."""
    groups = init_distributed(1, "cpu", timeout_minutes=3, cp_size=world_size)
    argv = indexed_argv(prefix, world_size) + list(flags)
    try:
        runs = _eager_and_graphed(groups, argv, CP_GRAPHS)
        if stale:
            with _stale_tokens():
                runs.append(_run_state(groups, argv + CP_GRAPHS))
        return runs
    finally:
        destroy_distributed(groups)


@contextlib.contextmanager
def _stale_tokens():
    """Range graphs that keep the tokens of their first replay."""
    from epoverlap.graphs.capture import RangeGraphs
    original, seen = RangeGraphs.replay_forward, set()

    def replay_forward(self, inputs, where):
        if "tokens" in inputs and id(self) in seen:
            inputs = {name: value for name, value in inputs.items() if name != "tokens"}
        seen.add(id(self))
        return original(self, inputs, where)
    RangeGraphs.replay_forward = replay_forward
    try:
        yield
    finally:
        RangeGraphs.replay_forward = original


def cp_pipeline_indexed_losses(rank, world_size, cp, pp, prefix, flags):
    """Losses of a short run at CP `cp` over `pp` pipeline stages (EP 1) on `prefix`."""
    groups = init_distributed(1, "cpu", timeout_minutes=3, cp_size=cp, pp_size=pp)
    try:
        return train_losses(groups, indexed_argv(prefix, cp) + [
            "--pipeline-model-parallel-size", str(pp)] + list(flags))
    finally:
        destroy_distributed(groups)
