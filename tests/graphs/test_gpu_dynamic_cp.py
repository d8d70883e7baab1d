"""GPU tier of dynamic context parallelism's graphs (markers `gpu`, `multigpu`; skipped without
two CUDA GPUs): over NCCL at CP 2, the size-1 runner of the dynamic-CP graph bank is captured
and replayed while size-2 microbatches run eagerly beside it, and the run gives the eager run's
loss and grad-norm bits at every step. The graphs check their inputs, so a slot buffer that
served both sizes (tokens of S / 2 and of S) stops the run."""

from __future__ import annotations

import os
import re

import pytest

from context_workers import EOD_VOCAB, write_aligned_documents
from gpu_runs import identical_losses, needs_gpus
from gpu_runs import train_cli as _train

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
SIZES = re.compile(r"dynamic CP: microbatches at size 1: (\d+), at 2: (\d+)")


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


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_gpus
def test_dynamic_cp_size_1_graphs_replay_the_eager_bits_over_nccl(tmp_path):
    prefix = write_aligned_documents(str(tmp_path / "docs"), unit=64)  # tiny: S = 128
    flags = _flags(prefix)
    eager_out, eager = _train(tmp_path, "dynamic_cp_eager", 2,
                              flags + ["--cuda-graph-impl", "none"])
    out, graphed = _train(tmp_path, "dynamic_cp_graphs", 2, flags + [
        "--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
        "--cuda-graph-warmup-steps", "2", "--cuda-graph-check-inputs"])
    assert re.search(r"CUDA graphs: \d+ captured after step \d+", out), out[-3000:]
    sizes = SIZES.search(out)
    assert sizes is not None and sizes.groups() == SIZES.search(eager_out).groups()
    at_1, at_2 = (int(n) for n in sizes.groups())
    # more size-1 microbatches than the first 3 steps hold: some come after the capture
    assert at_1 > 12 and at_2 > 0, sizes.group(0)
    assert identical_losses(eager, graphed)
