"""GPU tier of per-document attention under CUDA graphs (marker `gpu`; skipped without CUDA):
the tiny preset in bf16 on short packed documents (--reset-attention-mask --reset-position-ids
--eod-mask-loss), so the attention is the variable-length flash kernel over the document tables
of --max-documents-per-sample entries, made on the device from the tokens inside the graph.
Per-layer graphs of attention (input checks on) replay the eager run's loss and grad-norm bits
at every step: each microbatch's documents end elsewhere, so a replay that read another
microbatch's tokens would change them. The control: the same data without the document flags
gives other losses (the documents reach the attention)."""

from __future__ import annotations

import os
import re

import pytest

from context_workers import EOD_VOCAB, write_short_documents
from gpu_runs import identical_losses, needs_gpu
from gpu_runs import train_cli as _train

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
CAPTURED = r"CUDA graphs: \d+ captured after step \d+"
EAGER = ["--cuda-graph-impl", "none"]
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
          "--cuda-graph-warmup-steps", "2", "--cuda-graph-check-inputs"]
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def _flags(prefix: str) -> list[str]:
    """The tiny preset (S = 128) on documents of 4-21 ids, paths pinned (a tuned eager run
    could take another path than the graphed one)."""
    return ["--preset", "tiny", "--bf16", "--deterministic-mode", "--train-iters", "8",
            "--log-interval", "1", "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(EOD_VOCAB), "--split", "100,0,0", "--tune", "off"]


@pytest.mark.gpu
@needs_gpu
def test_per_document_graphs_replay_the_eager_bits_on_one_gpu(tmp_path):
    prefix = write_short_documents(str(tmp_path / "docs"), count=3000)
    flags = _flags(prefix)
    _, eager = _train(tmp_path, "documents_eager", 1, flags + DOCUMENTS + EAGER)
    out, graphed = _train(tmp_path, "documents_graphs", 1, flags + DOCUMENTS + GRAPHS)
    assert re.search(CAPTURED, out), out[-3000:]
    assert identical_losses(eager, graphed)
    _, whole = _train(tmp_path, "documents_whole", 1, flags + ["--eod-mask-loss"] + EAGER)
    assert [r["loss_hex"] for r in whole] != [r["loss_hex"] for r in eager]
