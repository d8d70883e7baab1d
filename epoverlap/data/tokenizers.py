"""Tokenizers: the vocabulary a dataset was written with, and text -> ids for the converter.

Owns `build_tokenizer` and the tokenizers, named as Megatron-core names them where it has
them:
- `NullTokenizer` (`--tokenizer-type NullTokenizer --vocab-size V`): for pre-tokenized data;
  text is space-separated ids; vocabulary V + 1, the end-of-document id is V (Megatron-core's
  convention).
- `HuggingFaceTokenizer` (`--tokenizer-model PATH`, a tokenizer.json or a folder holding one):
  the vocabulary (the model's and the added tokens) is read from the JSON with no package;
  encoding text goes through the `tokenizers` package (the optional extra `hf`); end of
  document is the first of the usual end-of-text tokens the vocabulary has.
- `GPT2BPETokenizer` (`--vocab-file vocab.json --merge-file merges.txt`): GPT-2's byte-level
  BPE, read and applied in pure Python; vocabulary len(vocab.json), end of document
  `<|endoftext|>`. Words are split by GPT-2's pattern with `re` (its letters and digits are
  Unicode's, as the `regex` package's letter and number classes are, but for the few numbers
  outside `re`'s digits).
- `Llama2Tokenizer` (`--tokenizer-model tokenizer.model`, a SentencePiece model): the
  vocabulary (its pieces) and end of document (`</s>`) are read from the file's protobuf with
  no package; encoding text needs `sentencepiece` (the optional extra `sentencepiece`).
- `ByteTokenizer` (the converter's default; no Megatron-core counterpart): UTF-8 bytes as ids
  0..255, end of document 256; data written with it is read for training as
  `NullTokenizer --vocab-size 256`.

Every failure to build one raises `TokenizerError`, one line saying what to fix.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "Llama2Tokenizer")
CONVERTER_TOKENIZER_TYPES = ("ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer")
BYTE_VOCAB = 256
END_OF_TEXT_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class TokenizerError(ValueError):
    """A tokenizer that cannot be built; one line."""


class ByteTokenizer:
    name = "ByteTokenizer"
    vocab_size = BYTE_VOCAB + 1
    eod = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class NullTokenizer:
    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError as error:
            raise TokenizerError(f"NullTokenizer reads space-separated token ids: {error}") \
                from None
        bad = [i for i in ids if not 0 <= i < self.eod]
        if bad:
            raise TokenizerError(f"NullTokenizer: id {bad[0]} outside [0, --vocab-size="
                                 f"{self.eod})")
        return ids


class HuggingFaceTokenizer:
    name = "HuggingFaceTokenizer"

    def __init__(self, model: str):
        path = Path(model)
        self.file = path / "tokenizer.json" if path.is_dir() else path
        if not self.file.is_file():
            raise TokenizerError(f"{self.file}: no such tokenizer file (give a tokenizer.json or "
                                 "a folder holding one)")
        ids = _hf_vocabulary(self.file)
        self.vocab_size = len(set(ids.values()))
        self.eod = next((ids[token] for token in END_OF_TEXT_TOKENS if token in ids), None)
        self._tokenizer = None

    def encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise TokenizerError("HuggingFaceTokenizer encodes text through the 'tokenizers' "
                                     "package (pip install 'epoverlap[hf]')") from None
            self._tokenizer = Tokenizer.from_file(str(self.file))
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def _hf_vocabulary(file: Path) -> dict[str, int]:
    """token -> id of a tokenizer.json: its model's vocabulary (an object for BPE, WordPiece
    and WordLevel, a list of [piece, score] for Unigram) and its added tokens, as the
    `tokenizers` package counts them (`get_vocab_size(with_added_tokens=True)`)."""
    try:
        spec = json.loads(file.read_text(encoding="utf-8"))
        vocab = spec["model"]["vocab"]
        ids = (dict(vocab) if isinstance(vocab, dict)
               else {entry[0]: i for i, entry in enumerate(vocab)})
        ids.update({added["content"]: added["id"] for added in spec.get("added_tokens") or []})
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        raise TokenizerError(f"{file}: not a Hugging Face tokenizer file ({type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''})") from None
    return ids


# GPT-2's pre-tokenizer pattern, with `re`'s Unicode classes for \p{L} and \p{N} (`_` is
# neither, as there)
GPT2_PATTERN = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


@lru_cache(maxsize=1)
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (its `bytes_to_unicode`)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


class GPT2BPETokenizer:
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        self.encoder = _read_json(vocab_file, "--vocab-file")
        if not isinstance(self.encoder, dict):
            raise TokenizerError(f"{vocab_file}: not a GPT-2 vocab.json (a token -> id object)")
        self.ranks = _read_merges(merge_file)
        self.vocab_size = len(self.encoder)
        self.eod = self.encoder.get("<|endoftext|>")

    def encode(self, text: str) -> list[int]:
        chars = _byte_chars()
        ids = []
        for word in GPT2_PATTERN.findall(text):
            for piece in self._bpe("".join(chars[b] for b in word.encode("utf-8"))):
                if piece not in self.encoder:
                    raise TokenizerError(f"GPT2BPETokenizer: {piece!r} is not in --vocab-file")
                ids.append(self.encoder[piece])
        return ids

    def _bpe(self, word: str) -> list[str]:
        """The word's pieces after applying the merges, lowest rank first."""
        pieces = list(word)
        while len(pieces) > 1:
            pairs = [(self.ranks.get(pair, len(self.ranks)), i)
                     for i, pair in enumerate(zip(pieces, pieces[1:]))]
            rank, at = min(pairs)
            if rank == len(self.ranks):
                break
            first, second = pieces[at], pieces[at + 1]
            merged, i = [], 0
            while i < len(pieces):
                if i + 1 < len(pieces) and (pieces[i], pieces[i + 1]) == (first, second):
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(pieces[i])
                    i += 1
            pieces = merged
        return pieces


def _read_json(path: str, flag: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise TokenizerError(f"{flag} {path}: {error.strerror}") from None
    except ValueError as error:
        raise TokenizerError(f"{flag} {path}: not JSON ({error})") from None


def _read_merges(path: str) -> dict[tuple[str, str], int]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise TokenizerError(f"--merge-file {path}: {error.strerror}") from None
    pairs = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    if any(len(pair) != 2 for pair in pairs):
        raise TokenizerError(f"--merge-file {path}: not a GPT-2 merges.txt (two pieces a line)")
    return {pair: rank for rank, pair in enumerate(pairs)}


class Llama2Tokenizer:
    name = "Llama2Tokenizer"

    def __init__(self, model: str):
        self.model = model
        try:
            data = Path(model).read_bytes()
        except OSError as error:
            raise TokenizerError(f"--tokenizer-model {model}: {error.strerror} (a SentencePiece "
                                 "tokenizer.model)") from None
        try:
            pieces = [_piece_text(body) for number, body in _proto_fields(data) if number == 1]
        except (IndexError, ValueError, UnicodeDecodeError):
            pieces = []
        if not pieces:
            raise TokenizerError(f"--tokenizer-model {model}: not a SentencePiece model (no "
                                 "pieces read)")
        self.vocab_size = len(pieces)
        self.eod = pieces.index("</s>") if "</s>" in pieces else None

    def encode(self, text: str) -> list[int]:
        try:
            import sentencepiece
        except ImportError:
            raise TokenizerError("Llama2Tokenizer encodes text through the sentencepiece package "
                                 "(pip install 'epoverlap[sentencepiece]')") from None
        return sentencepiece.SentencePieceProcessor(model_file=self.model).encode(text)


def _proto_fields(data: bytes):
    """(field number, bytes) of each length-delimited field of a protobuf message (the other
    wire types skipped)."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, at = _varint(data, at)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            size, at = _varint(data, at)
            yield number, data[at:at + size]
            at += size
        else:
            raise ValueError(f"wire type {wire}")


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _piece_text(body: bytes) -> str:
    """A SentencePiece message's `piece` (field 1)."""
    return next(value for number, value in _proto_fields(body) if number == 1).decode("utf-8")


def build_tokenizer(tokenizer_type: str, vocab_size: Optional[int] = None,
                    tokenizer_model: Optional[str] = None, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None):
    """One of the tokenizers above by Megatron-core's type name. Raises TokenizerError."""
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise TokenizerError("NullTokenizer needs --vocab-size >= 1")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise TokenizerError("HuggingFaceTokenizer needs --tokenizer-model")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise TokenizerError("GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "Llama2Tokenizer":
        if not tokenizer_model:
            raise TokenizerError("Llama2Tokenizer needs --tokenizer-model (tokenizer.model)")
        return Llama2Tokenizer(tokenizer_model)
    raise TokenizerError(f"tokenizer type {tokenizer_type!r}: allowed "
                         f"{', '.join(CONVERTER_TOKENIZER_TYPES)}")
