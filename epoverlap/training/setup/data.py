"""Training data sources: raw text, Megatron indexed datasets, and mock tokens.

Owns `open_data_source`, which turns the data flags into one source and checks its inputs
before training (a missing, truncated, empty or too short input is a ConfigError naming the
flag and the file), and the three sources. Each has `vocab_size` (the model's vocabulary for
it), `description` (for the banner) and `batch(step, rank, microbatch, batch, seq)` ->
(tokens, labels), both int64 [batch, seq]. Every batch is a pure function of the seed, the
step, the data-parallel rank (the global rank without pipeline parallelism; every stage of a
pipeline reads the same batches) and the microbatch: the same on any machine and for any split
of the world into pipeline-, expert- and data-parallel groups.

- `TextData` (`--data`, default `stdlib`): the bytes of a text file, or of every text file
  under a folder (sorted paths), as tokens 0..255; each sequence is a window at a position
  drawn from the seeded generator. `stdlib` is the Python standard library's own sources.
- `IndexedData` (`--data-path`): Megatron-core `.bin/.idx` datasets through
  `epoverlap.data` (split, epochs, shuffling, blend). Global sample i of the run is read by
  data-parallel rank (i // micro_batch_size) % W (W data-parallel ranks, `world_size` below:
  the world / PP): microbatch m of step s covers samples
  [(s-1) * M + m) * W * B, ... + W * B), rank r the B after r * B (Megatron-core's order).
- `SyntheticData` (`--mock-data`): sequences from a fixed random bigram chain (learnable).

`StepFeed` gives the training step its microbatches and makes the next step's on a worker thread
meanwhile (the same batches, earlier).

Validation data (--eval-interval, `validation_source`; `open_data_source` opens it beside the
training source, as `source.validation`, so its inputs are checked before training too):
global validation batch g (1-based) is read as training step g is, from the `--split` valid
document range of each `--data-path` dataset (the same shuffling, blend and sample-to-rank
mapping; weights default to the datasets' valid sample counts), or for `--mock-data` from the
same bigram chain with the batch seeds of another stream (`VALID_STREAM_OFFSET`), so no
validation sequence is drawn as a training one is.
"""

from __future__ import annotations

import copy
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from epoverlap.config import DEFAULT_SPLIT, RunConfig
from epoverlap.data.indexed import IndexedDataError, open_indexed
from epoverlap.data.samples import BlendedSamples, DocumentSamples, split_bounds
from epoverlap.data.tokenizers import BYTE_VOCAB, TokenizerError, build_tokenizer
from epoverlap.errors import ConfigError
from epoverlap.kernels.cross_entropy import IGNORE_INDEX

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".cfg", ".toml", ".yaml",
                 ".html", ".csv", ".tex", ".sh"}
MAX_BYTES = 64 << 20
VOCAB_CHECK_TOKENS = 1 << 20  # tokens of each dataset checked against the vocabulary at start


def stdlib_folder() -> Path:
    return Path(os.__file__).parent


def text_files(folder: Path) -> list[Path]:
    """The text files under `folder` (by suffix, sorted, no site-packages)."""
    return sorted(p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES
                  and "site-packages" not in p.parts and p.is_file())


def _read_folder(folder: Path, max_bytes: int) -> bytes:
    chunks, total = [], 0
    for path in text_files(folder):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


def _batch_seed(seed: int, step: int, rank: int, microbatch: int) -> int:
    return (((seed * 1_000_003 + step) * 10_007 + rank) * 101 + microbatch) % (2**62)


# Added to the seed of the mock validation stream. torch's CPU generator keeps the low 32 bits of
# a seed, and every factor of `_batch_seed` is odd, so each validation batch seed is its
# training twin's plus 2**31 in those bits: as far as 32 bits allow from every training batch
# seed (meeting one takes steps at least some 2,000 apart and ranks over 1,000 apart at once).
VALID_STREAM_OFFSET = 2**31


def _inputs_and_labels(windows_BL: torch.Tensor, masked_eod: Optional[int] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) of windows of seq + 1 tokens; with `masked_eod` (--eod-mask-loss) the
    label after each end-of-document input token is IGNORE_INDEX, out of the loss (Megatron-
    LM's loss mask: 0 where the input is the end-of-document id)."""
    tokens, labels = windows_BL[:, :-1].contiguous(), windows_BL[:, 1:].contiguous()
    if masked_eod is not None:
        labels = labels.masked_fill(tokens == masked_eod, IGNORE_INDEX)
    return tokens, labels


class TextData:
    """Byte tokens from real text."""

    vocab_size = BYTE_VOCAB

    def __init__(self, source: Union[str, Path], seed: int, max_bytes: int = MAX_BYTES):
        path = stdlib_folder() if str(source) == "stdlib" else Path(source)
        raw = path.read_bytes()[:max_bytes] if path.is_file() else _read_folder(path, max_bytes)
        self.description = f"{'Python stdlib sources ' if str(source) == 'stdlib' else ''}" \
                           f"{path} ({len(raw) / 1e6:.1f} MB)"
        self.tokens = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))
        self.seed, self.source = seed, str(source)

    def batch(self, step: int, rank: int, microbatch: int, batch: int, seq: int):
        gen = torch.Generator().manual_seed(_batch_seed(self.seed, step, rank, microbatch))
        starts = torch.randint(0, self.tokens.numel() - seq - 1, (batch,), generator=gen)
        return _inputs_and_labels(torch.stack([self.tokens[s:s + seq + 1]
                                               for s in starts.tolist()]))


class SyntheticData:
    """Deterministic bigram-chain sequences over `vocab` tokens.

    Each microbatch's rows draw their choices from a generator seeded by (seed, step, rank,
    microbatch); the chain itself (token t+1 = next_tokens[token t, choice t]) is sequential
    along the sequence, so it is walked once per step for every microbatch's rows together, in
    numpy (`batches_of_step`): a torch op per position and microbatch would cost the host one
    op launch per token position, on the critical path before the step's first kernel."""

    def __init__(self, vocab: int, seed: int, branching: int = 4):
        gen = torch.Generator().manual_seed(seed)
        self.next_tokens = torch.randint(0, vocab, (vocab, branching), generator=gen)
        self.vocab_size, self.seed = vocab, seed
        self.stream_seed = seed  # the batches' seeds (the validation stream's differ)
        self.description = f"mock data (bigram chain over {vocab} tokens)"
        self._next_flat = self.next_tokens.numpy().reshape(-1)

    def validation_stream(self) -> "SyntheticData":
        """The same chain (so the same distribution), other batches (module docstring)."""
        stream = copy.copy(self)
        stream.stream_seed = (self.seed + VALID_STREAM_OFFSET) % 2**62
        stream.description = f"{self.description}, validation stream"
        return stream

    def batch(self, step: int, rank: int, microbatch: int, batch: int, seq: int):
        return self.batches_of_step(step, rank, [microbatch], batch, seq)[0]

    def batches_of_step(self, step: int, rank: int, microbatches, batch: int, seq: int) -> list:
        """`batch` of each of `microbatches`, the chains of all their rows walked together."""
        branching = self.next_tokens.shape[1]
        choices, firsts = [], []
        for mb in microbatches:
            gen = torch.Generator().manual_seed(_batch_seed(self.stream_seed, step, rank, mb))
            choices.append(torch.randint(0, branching, (batch, seq), generator=gen).numpy())
            firsts.append(torch.randint(0, self.vocab_size, (batch,), generator=gen).numpy())
        choice_SR = np.ascontiguousarray(np.concatenate(choices).T)  # [seq, rows]
        tokens_SR = np.empty((seq + 1, choice_SR.shape[1]), dtype=np.int64)
        tokens_SR[0] = np.concatenate(firsts)
        table = self._next_flat
        for pos in range(seq):
            np.take(table, tokens_SR[pos] * branching + choice_SR[pos], out=tokens_SR[pos + 1])
        rows_RS = torch.from_numpy(np.ascontiguousarray(tokens_SR.T))
        return [_inputs_and_labels(rows) for rows in rows_RS.split(batch)]


class StepFeed:
    """A step's microbatches (`step_batches`), the next step's made on a worker thread while
    this one trains: the host makes a step's tokens (the mock data's bigram chain walks the
    sequence position by position, ~10-17 ms at seq 4096) while the device runs the step before,
    instead of between two steps with the device idle. Every batch is a pure function of (step,
    rank, microbatch), so making it early changes no bit. A step asked for again (a rerun) is
    made again; an error of the next step's batch surfaces when that step asks for it."""

    def __init__(self, source, rank: int, count: int, batch: int, seq: int):
        self.source, self._shape = source, (rank, count, batch, seq)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epoverlap-data")
        self._ahead: Optional[tuple[int, Future]] = None  # (step, its batches being made)

    def _make(self, step: int) -> list:
        rank, count, batch, seq = self._shape
        return step_batches(self.source, step, rank, count, batch, seq)

    def batches(self, step: int) -> list:
        """(tokens, labels) of the step's microbatches; starts making the next step's."""
        if self._ahead is not None and self._ahead[0] == step:
            made, self._ahead = self._ahead[1].result(), None
        else:
            made = self._make(step)
        if self._ahead is None or self._ahead[0] != step + 1:
            self._ahead = (step + 1, self._worker.submit(self._make, step + 1))
        return made

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


def step_batches(source, step: int, rank: int, count: int, batch: int, seq: int) -> list:
    """(tokens, labels) of microbatches 0..count-1 of a step: the source's `batches_of_step`
    where it makes them together (SyntheticData), else one `batch` call each."""
    if hasattr(source, "batches_of_step"):
        return source.batches_of_step(step, rank, range(count), batch, seq)
    return [source.batch(step, rank, mb, batch, seq) for mb in range(count)]


class IndexedData:
    """Samples of Megatron indexed datasets, in Megatron-core's global order (module doc)."""

    def __init__(self, samples: BlendedSamples, vocab_size: int, description: str, *,
                 micro_batch_size: int, num_microbatches: int, world_size: int,
                 eod: Optional[int] = None, masked_eod: Optional[int] = None):
        """`eod`: the end-of-document id (where the model's documents end, the reset flags);
        `masked_eod`: the one whose next token the loss leaves out (--eod-mask-loss; None:
        every label counts)."""
        self.samples, self.vocab_size, self.description = samples, vocab_size, description
        self.eod, self.masked_eod = eod, masked_eod
        self.micro_batch_size, self.num_microbatches = micro_batch_size, num_microbatches
        self.world_size = world_size

    def batch(self, step: int, rank: int, microbatch: int, batch: int, seq: int):
        if batch != self.micro_batch_size or seq != self.samples.datasets[0].seq_length:
            raise ValueError(f"IndexedData was opened for micro batch {self.micro_batch_size} "
                             f"x seq {self.samples.datasets[0].seq_length}, asked {batch} x {seq}")
        first = (((step - 1) * self.num_microbatches + microbatch) * self.world_size + rank) \
            * batch
        windows_BL = np.stack([self.samples.sample(first + b) for b in range(batch)])
        _check_vocab(windows_BL, self.vocab_size, f"samples {first}..{first + batch - 1}")
        return _inputs_and_labels(torch.from_numpy(windows_BL), self.masked_eod)


def _check_vocab(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = int(tokens.max()) if int(tokens.max()) >= vocab_size else int(tokens.min())
        raise ConfigError("--data-path", where, f"token id {bad} is outside the tokenizer's "
                          f"vocabulary [0, {vocab_size}): data and --tokenizer-type / "
                          "--vocab-size disagree")


# ---------------------------------------------------------------------------------------------
# Opening and checking a source
# ---------------------------------------------------------------------------------------------


def open_data_source(cfg: RunConfig, world_size: int):
    """The configured source, its inputs checked. Raises ConfigError (one line, the flag)."""
    d, seq = cfg.data, cfg.model.seq_length
    if d.text_source is not None:
        return _open_text(d.text_source, cfg.train.seed, seq)
    vocab_size = tokenizer_vocab(cfg) if d.tokenizer else cfg.model.vocab_size
    if d.mock_data:
        source = SyntheticData(vocab_size, cfg.train.seed)
    else:
        source = _open_indexed(cfg, vocab_size, world_size)
    if evaluates(cfg):
        source.validation = validation_source(cfg, world_size, source)
    return source


def evaluates(cfg: RunConfig) -> bool:
    """Whether the run evaluates (--eval-interval given, --eval-iters > 0)."""
    return cfg.eval.eval_interval is not None and cfg.eval.eval_iters > 0


def validation_source(cfg: RunConfig, world_size: int, source):
    """The validation data of a run whose training source is `source` (module docstring):
    the one `open_data_source` opened beside it, else opened now. Raises ConfigError."""
    if getattr(source, "validation", None) is not None:
        return source.validation
    if isinstance(source, SyntheticData):
        return source.validation_stream()
    if isinstance(source, IndexedData):
        e, t = cfg.eval, cfg.train
        batches = math.ceil(t.train_iters / e.eval_interval) * e.eval_iters
        return _open_indexed(cfg, source.vocab_size, world_size, part=1, steps=batches)
    raise ConfigError("--eval-interval", cfg.eval.eval_interval, "needs validation data: "
                      "--data-path (its --split valid part) or --mock-data")


def _open_text(source: str, seed: int, seq: int) -> TextData:
    path = stdlib_folder() if source == "stdlib" else Path(source)
    if path.is_dir() and not text_files(path):
        raise ConfigError("--data", source, f"no text files under it (suffixes "
                          f"{' '.join(sorted(TEXT_SUFFIXES))})")
    data = TextData(source, seed)
    if data.tokens.numel() < seq + 2:
        raise ConfigError("--data", source, f"{data.tokens.numel()} bytes of text, fewer than "
                          f"--seq-length + 2 = {seq + 2}")
    return data


def tokenizer_vocab(cfg: RunConfig) -> int:
    """The vocabulary of the data's tokenizer (--tokenizer-type and its files). Raises
    ConfigError naming the flag."""
    return _tokenizer(cfg).vocab_size


def _eod(cfg: RunConfig) -> Optional[int]:
    """The end-of-document id, where --eod-mask-loss or the reset flags need it (else None)."""
    d = cfg.data
    given = [flag for flag, on in (("--eod-mask-loss", d.eod_mask_loss),
                                   ("--reset-position-ids", d.reset_position_ids),
                                   ("--reset-attention-mask", d.reset_attention_mask)) if on]
    if not given:
        return None
    eod = _tokenizer(cfg).eod
    if eod is None:
        raise ConfigError(given[0], True, f"the {d.tokenizer} vocabulary has no "
                          "end-of-document token")
    return eod


def _tokenizer(cfg: RunConfig):
    d = cfg.data
    try:
        return build_tokenizer(d.tokenizer, d.vocab_size, d.tokenizer_model, d.vocab_file,
                               d.merge_file)
    except TokenizerError as error:
        flag, value = (("--tokenizer-model", d.tokenizer_model) if d.tokenizer_model
                       else ("--vocab-file", d.vocab_file) if d.vocab_file
                       else ("--tokenizer-type", d.tokenizer))
        raise ConfigError(flag, value, str(error)) from None


SPLIT_NAMES = ("train", "valid", "test")


def _open_indexed(cfg: RunConfig, vocab_size: int, world_size: int, part: int = 0,
                  steps: Optional[int] = None) -> IndexedData:
    """The samples of split `part` (0 train, 1 valid) for `steps` global batches (default:
    --train-iters)."""
    d, t, seq = cfg.data, cfg.train, cfg.model.seq_length
    prefixes, weights = d.blend
    datasets = [_split_samples(prefix, index, cfg, vocab_size, part)
                for index, prefix in enumerate(prefixes)]
    for index, dataset in enumerate(datasets):
        if dataset.samples_per_epoch == 0 and (weights is None or weights[index] > 0):
            begin, end = dataset.first_doc, dataset.end_doc
            raise ConfigError("--data-path", prefixes[index], f"its {SPLIT_NAMES[part]} split "
                              f"(documents [{begin}, {end}) by --split "
                              f"{d.split or DEFAULT_SPLIT}) has {dataset.num_tokens} tokens, fewer "
                              f"than --seq-length + 1 = {seq + 1}{_working_split(dataset, part)}")
    steps = t.train_iters if steps is None else steps
    total = steps * t.num_microbatches * world_size * t.micro_batch_size
    samples = BlendedSamples(datasets, weights, total)
    description = _describe(prefixes, samples, f"{d.tokenizer} vocabulary {vocab_size}",
                            SPLIT_NAMES[part])
    return IndexedData(samples, vocab_size, description,
                       micro_batch_size=t.micro_batch_size,
                       num_microbatches=t.num_microbatches, world_size=world_size,
                       eod=_eod(cfg), masked_eod=_eod(cfg) if cfg.data.eod_mask_loss else None)


def _working_split(dataset: DocumentSamples, part: int) -> str:
    """'; ... --split A,B,0 would work': the valid part as the dataset's last documents, as few
    as hold one sample (--split in document counts cuts exactly there); '' for another part or
    a dataset too small for any."""
    lengths = dataset.data.sequence_lengths[::-1].astype(np.int64).cumsum()
    enough = np.nonzero(lengths >= dataset.seq_length + 1)[0]
    total = len(lengths)
    if part != 1 or not len(enough) or enough[0] + 1 >= total:
        return ""
    valid = int(enough[0]) + 1
    return (f"; the valid part needs one sample: --split {total - valid},{valid},0 (document "
            f"counts: its last {valid} of {total} documents) would hold one")


def _split_samples(prefix: str, index: int, cfg: RunConfig, vocab_size: int,
                   part: int) -> DocumentSamples:
    try:
        data = open_indexed(prefix)
    except IndexedDataError as error:
        raise ConfigError("--data-path", prefix, str(error)) from None
    if part == 0:  # once per dataset
        _check_vocab(np.asarray(data.tokens[:VOCAB_CHECK_TOKENS]), vocab_size,
                     f"{prefix} (first {VOCAB_CHECK_TOKENS} tokens)")
    documents = split_bounds(data.num_sequences, cfg.data.split_fractions, part)
    return DocumentSamples(data, documents, cfg.model.seq_length, cfg.train.seed, index)


def _describe(prefixes, samples: BlendedSamples, vocabulary: str, split: str = "train") -> str:
    total = sum(samples.weights)
    parts = [f"{prefix} {weight / total:.0%}" for prefix, weight in zip(prefixes, samples.weights)]
    tokens = sum(d.num_tokens for d in samples.datasets)
    return f"indexed {', '.join(parts)} ({tokens / 1e6:.2f}M {split} tokens, {vocabulary})"
