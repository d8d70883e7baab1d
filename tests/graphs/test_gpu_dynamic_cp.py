"""GPU tier of context parallelism's graphs (markers `gpu`, `multigpu`; skipped without two
CUDA GPUs), over NCCL at CP 2 x EP 2, each graphed run against the eager run's loss and
grad-norm bits at every step:

  * fixed CP 2, per-layer graphs of attn, moe_router and moe_preprocess: with the ring (the
    attention graphs hold its sends and receives) and with the all-gather (a node of its own
    on the comm lane: the attention graphs hold compute only; the router's graphs hold the
    aux loss's all-reduce over the CP group either way);
  * dynamic CP (sizes 1 and 2): each size's runner captured and replayed, size 2's attention
    graphs holding the ring, or the all-gather (inside the attention under dynamic CP) and
    its backward's all-to-all. The graphs check their inputs, so a slot buffer that served
    both sizes (tokens of S / 2 and of S) stops the run;
  * fixed CP 2 with per-document attention (--reset-attention-mask --reset-position-ids
    --eod-mask-loss on short documents): the tokens an input of the attention graphs, each
    replay reading its own microbatch's documents."""

from __future__ import annotations

import os
import re

import pytest

from context_workers import EOD_VOCAB, write_aligned_documents, write_short_documents
from gpu_runs import identical_losses, needs_gpus
from gpu_runs import train_cli as _train

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
SIZES = re.compile(r"dynamic CP: microbatches at size 1: (\d+), at 2: (\d+)")
CAPTURED = r"CUDA graphs: \d+ captured after step \d+"
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2",
          "--cuda-graph-check-inputs"]


def _flags(prefix: str) -> list[str]:
    """The tiny preset at CP 2 x EP 2 on documents ending at multiples of S / 2, one sequence
    per microbatch (so about half the microbatches run at size 1), the overlap and paths
    pinned (a tuned eager run could take another path than the graphed one)."""
    return ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "12",
            "--micro-batch-size", "1", "--num-microbatches", "4", "--log-interval", "1",
            "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(EOD_VOCAB), "--split", "100,0,0", "--context-parallel-size", "2",
            "--expert-model-parallel-size", "2", "--dynamic-context-parallel",
            "--reset-attention-mask", "--eod-mask-loss", "--overlap-moe-expert-parallel-comm",
            "--tune", "off"]


def _graphed_equals_eager(tmp_path, name: str, flags: list[str]) -> None:
    """`flags` eager, then with per-layer graphs of attn, moe_router and moe_preprocess: a
    capture, and the eager run's loss and grad-norm bits at every step."""
    _, eager = _train(tmp_path, f"{name}_eager", 2, flags + ["--cuda-graph-impl", "none"])
    out, graphed = _train(tmp_path, f"{name}_graphs", 2, flags + GRAPHS + [
        "--cuda-graph-modules", "attn", "moe_router", "moe_preprocess"])
    assert re.search(CAPTURED + r" ", out), out[-3000:]
    assert identical_losses(eager, graphed)


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_gpus
@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_cp2_graphs_replay_the_eager_bits_over_nccl(tmp_path, comm_type):
    flags = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "8",
             "--mock-data", "--log-interval", "1", "--context-parallel-size", "2",
             "--cp-comm-type", comm_type, "--expert-model-parallel-size", "2",
             "--overlap-moe-expert-parallel-comm", "--tune", "off"]
    _graphed_equals_eager(tmp_path, f"cp2_{comm_type}", flags)


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_gpus
@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_cp2_per_document_graphs_replay_the_eager_bits_over_nccl(tmp_path, comm_type):
    prefix = write_short_documents(str(tmp_path / "docs"), count=3000)
    flags = ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "8",
             "--log-interval", "1", "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(EOD_VOCAB), "--split", "100,0,0", "--context-parallel-size",
             "2", "--cp-comm-type", comm_type, "--expert-model-parallel-size", "2",
             "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
             "--overlap-moe-expert-parallel-comm", "--tune", "off"]
    _graphed_equals_eager(tmp_path, f"cp2_documents_{comm_type}", flags)


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_gpus
@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_dynamic_cp_graphs_of_every_size_replay_the_eager_bits_over_nccl(tmp_path, comm_type):
    prefix = write_aligned_documents(str(tmp_path / "docs"), unit=64)  # tiny: S = 128
    flags = _flags(prefix) + ["--cp-comm-type", comm_type]
    eager_out, eager = _train(tmp_path, f"dynamic_cp_{comm_type}_eager", 2,
                              flags + ["--cuda-graph-impl", "none"])
    out, graphed = _train(tmp_path, f"dynamic_cp_{comm_type}_graphs", 2, flags + GRAPHS + [
        "--cuda-graph-modules", "attn"])
    assert re.search(CAPTURED, out), out[-3000:]
    for size in (1, 2):  # each size's runner, in a line of its own
        assert re.search(CAPTURED + rf" .*; CP size {size}\n", out), out[-3000:]
    sizes = SIZES.search(out)
    assert sizes is not None and sizes.groups() == SIZES.search(eager_out).groups()
    at_1, at_2 = (int(n) for n in sizes.groups())
    # more microbatches of each size than the first 3 steps hold: some come after its capture
    assert at_1 > 12 and at_2 > 12, sizes.group(0)
    assert identical_losses(eager, graphed)
