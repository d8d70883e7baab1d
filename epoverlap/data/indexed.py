"""Megatron-core's indexed token format (`PREFIX.bin` + `PREFIX.idx`): reader and writer.

Owns `open_indexed` (memory-maps both files and checks them against each other) and
`IndexedWriter`. Written from the format's description; no megatron-core code or import.

The format, all integers little-endian:

  PREFIX.idx   9 bytes  magic b"MMIDIDX\\x00\\x00"
               u64      version, 1
               u8       token dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                        6 float64, 7 float32, 8 uint16
               u64      S, the number of sequences
               u64      D, the number of document-index entries
               int32[S] tokens per sequence
               int64[S] byte offset of each sequence in PREFIX.bin
               int64[D] document boundaries as sequence indices: 0, end of document 0, ...
               (int8[S] per-sequence modes, present only in multimodal datasets; ignored)
  PREFIX.bin   the tokens of every sequence, back to back, in the token dtype.

Megatron's GPT pipeline treats each sequence as a document; so does `samples.py`.
A missing file, a bad header or a file shorter than the index says raises `IndexedDataError`,
one line naming the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DTYPE_OF_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                 6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_OF_CODE.items()}
INTEGER_CODES = (1, 2, 3, 4, 5, 8)


class IndexedDataError(ValueError):
    """An unreadable indexed dataset; the message is one line naming the file."""


def bin_path(prefix: str) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str) -> Path:
    return Path(f"{prefix}.idx")


def token_dtype_for(vocab_size: int) -> type:
    """The narrowest dtype Megatron-core's tools pick for a vocabulary: uint16 below 65500."""
    return np.uint16 if vocab_size < 65500 else np.int32


@dataclass(frozen=True)
class IndexedTokens:
    """One memory-mapped dataset. Arrays are read-only views of the files."""

    prefix: str
    tokens: np.ndarray  # the whole .bin as its token dtype, memory-mapped
    sequence_lengths: np.ndarray  # int32 [S]
    sequence_starts: np.ndarray  # int64 [S], in tokens (the index stores bytes)
    document_indices: np.ndarray  # int64 [D]

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def sequence(self, index: int) -> np.ndarray:
        start = int(self.sequence_starts[index])
        return self.tokens[start:start + int(self.sequence_lengths[index])]


def _read_header(path: Path) -> tuple[int, int, int]:
    """-> (dtype code, S, D); checks magic, version and code."""
    with open(path, "rb") as stream:
        head = stream.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        raise IndexedDataError(f"{path}: truncated index header ({len(head)} of "
                               f"{HEADER_BYTES} bytes)")
    if head[:len(MAGIC)] != MAGIC:
        raise IndexedDataError(f"{path}: not a Megatron indexed-dataset index (bad magic)")
    version, code, count, doc_count = struct.unpack_from("<QBQQ", head, len(MAGIC))
    if version != VERSION:
        raise IndexedDataError(f"{path}: index version {version}, only {VERSION} is known")
    if code not in INTEGER_CODES:
        raise IndexedDataError(f"{path}: token dtype code {code} is not an integer type "
                               f"(allowed codes {INTEGER_CODES})")
    return code, count, doc_count


def _check_exists(prefix: str) -> None:
    for path in (idx_path(prefix), bin_path(prefix)):
        if not path.is_file():
            raise IndexedDataError(f"{path}: no such file (an indexed dataset is PREFIX.bin + "
                                   "PREFIX.idx; give PREFIX)")


def open_indexed(prefix: str) -> IndexedTokens:
    """Memory-map PREFIX.idx and PREFIX.bin, check sizes and boundaries. -> IndexedTokens."""
    _check_exists(prefix)
    index_file = idx_path(prefix)
    code, count, doc_count = _read_header(index_file)
    need = HEADER_BYTES + count * (4 + 8) + doc_count * 8
    have = index_file.stat().st_size
    if have < need:
        raise IndexedDataError(f"{index_file}: truncated: {have} bytes, its header needs {need}")
    index = np.memmap(index_file, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(index, np.int32, count, HEADER_BYTES)
    pointers = np.frombuffer(index, np.int64, count, HEADER_BYTES + 4 * count)
    documents = np.frombuffer(index, np.int64, doc_count, HEADER_BYTES + 12 * count)
    dtype = np.dtype(DTYPE_OF_CODE[code])
    _check_boundaries(index_file, lengths, pointers, documents, dtype.itemsize)
    data_file = bin_path(prefix)
    ends = pointers + lengths.astype(np.int64) * dtype.itemsize
    need_bin = int(ends.max()) if count else 0
    have_bin = data_file.stat().st_size
    if have_bin < need_bin:
        raise IndexedDataError(f"{data_file}: truncated: {have_bin} bytes, {index_file} needs "
                               f"{need_bin}")
    tokens = (np.memmap(data_file, mode="r", dtype=dtype) if have_bin >= dtype.itemsize
              else np.zeros(0, dtype))
    return IndexedTokens(str(prefix), tokens, lengths, pointers // dtype.itemsize, documents)


def _check_boundaries(path: Path, lengths, pointers, documents, itemsize: int) -> None:
    if lengths.size and int(lengths.min()) < 0:
        raise IndexedDataError(f"{path}: negative sequence length")
    if pointers.size and (int(pointers.min()) < 0 or np.any(pointers % itemsize)):
        raise IndexedDataError(f"{path}: sequence offsets not aligned to the {itemsize}-byte "
                               "token dtype")
    if documents.size and (documents[0] != 0 or documents[-1] != lengths.size
                           or np.any(np.diff(documents) < 0)):
        raise IndexedDataError(f"{path}: document indices must rise from 0 to the sequence "
                               f"count {lengths.size}")


class IndexedWriter:
    """Writes PREFIX.bin while documents are added, PREFIX.idx on `close` (or `with` exit).

    Each document is one sequence (as Megatron's GPT preprocessing writes them).
    """

    def __init__(self, prefix: str, dtype: type = np.uint16):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE or CODE_OF_DTYPE[self.dtype] not in INTEGER_CODES:
            raise ValueError(f"token dtype {self.dtype}: allowed "
                             f"{[str(np.dtype(DTYPE_OF_CODE[c])) for c in INTEGER_CODES]}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._data = open(bin_path(self.prefix), "wb")
        self._lengths: list[int] = []
        self.num_tokens = 0

    def add_document(self, token_ids: Iterable[int]) -> None:
        ids = np.asarray(token_ids, dtype=np.int64)
        info = np.iinfo(self.dtype)
        if ids.size and (int(ids.min()) < info.min or int(ids.max()) > info.max):
            raise ValueError(f"token ids outside {self.dtype} range [{info.min}, {info.max}]")
        self._data.write(ids.astype(self.dtype).tobytes())
        self._lengths.append(int(ids.size))
        self.num_tokens += int(ids.size)

    def close(self) -> None:
        self._data.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) \
            if lengths.size else np.zeros(0, np.int64)
        documents = np.arange(lengths.size + 1, dtype=np.int64)
        with open(idx_path(self.prefix), "wb") as index:
            index.write(MAGIC + struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[self.dtype],
                                            lengths.size, documents.size))
            index.write(lengths.tobytes())
            index.write((starts * self.dtype.itemsize).astype(np.int64).tobytes())
            index.write(documents.tobytes())

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> Optional[bool]:
        self.close()
        return None
