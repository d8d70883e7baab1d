"""Training data: byte-level text from a file or folder, and a deterministic synthetic stream.

Owns `make_data_source` and the two sources. Both are deterministic functions of
(seed, step, data rank, microbatch): the same run gives the same batches on any machine, and
the batches do not depend on how the world is split into expert/data parallel groups (the data
rank is the global rank).

- `TextData`: bytes of a text file, or of every text file under a folder (sorted paths), as
  tokens 0..255; each sequence is a window at a position drawn from the seeded generator.
  `stdlib` means the Python standard library's own source files, which every machine has.
- `SyntheticData`: sequences from a fixed random bigram chain (learnable, so the loss falls).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np
import torch

from epoverlap.errors import ConfigError

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".cfg", ".toml", ".yaml",
                 ".html", ".csv", ".tex", ".sh"}
MAX_BYTES = 64 << 20


def stdlib_folder() -> Path:
    return Path(os.__file__).parent


def _read_folder(folder: Path, max_bytes: int) -> bytes:
    chunks, total = [], 0
    for path in sorted(p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES
                       and "site-packages" not in p.parts and p.is_file()):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


def _batch_seed(seed: int, step: int, rank: int, microbatch: int) -> int:
    return (((seed * 1_000_003 + step) * 10_007 + rank) * 101 + microbatch) % (2**62)


class TextData:
    """Byte tokens from real text."""

    def __init__(self, source: Union[str, Path], seed: int, max_bytes: int = MAX_BYTES):
        path = stdlib_folder() if str(source) == "stdlib" else Path(source)
        raw = path.read_bytes()[:max_bytes] if path.is_file() else _read_folder(path, max_bytes)
        self.description = f"{'Python stdlib sources ' if str(source) == 'stdlib' else ''}" \
                           f"{path} ({len(raw) / 1e6:.1f} MB)"
        self.tokens = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))
        self.seed, self.source = seed, str(source)

    def batch(self, step: int, rank: int, microbatch: int, batch: int, seq: int):
        if self.tokens.numel() < seq + 2:  # a folder with too little text (files: validation)
            raise ConfigError("--data", self.source, f"has {self.tokens.numel()} bytes of text, "
                              f"fewer than --seq-length + 2 = {seq + 2}")
        gen = torch.Generator().manual_seed(_batch_seed(self.seed, step, rank, microbatch))
        starts = torch.randint(0, self.tokens.numel() - seq - 1, (batch,), generator=gen)
        windows = torch.stack([self.tokens[s:s + seq + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class SyntheticData:
    """Deterministic bigram-chain sequences over `vocab` tokens."""

    def __init__(self, vocab: int, seed: int, branching: int = 4):
        gen = torch.Generator().manual_seed(seed)
        self.next_tokens = torch.randint(0, vocab, (vocab, branching), generator=gen)
        self.vocab, self.seed, self.description = vocab, seed, "synthetic bigram stream"

    def batch(self, step: int, rank: int, microbatch: int, batch: int, seq: int):
        gen = torch.Generator().manual_seed(_batch_seed(self.seed, step, rank, microbatch))
        choices = torch.randint(0, self.next_tokens.shape[1], (batch, seq), generator=gen)
        tokens = torch.empty(batch, seq + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=gen)
        for pos in range(seq):
            tokens[:, pos + 1] = self.next_tokens[tokens[:, pos], choices[:, pos]]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_data_source(data: str, vocab: int, seed: int):
    if data == "synthetic":
        return SyntheticData(vocab, seed)
    return TextData(data, seed)
