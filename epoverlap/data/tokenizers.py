"""Tokenizers: the vocabulary a dataset was written with, and text -> ids for the converter.

Owns `build_tokenizer` and the three tokenizers, named as Megatron-core names them where it
has them:
- `NullTokenizer` (`--tokenizer-type NullTokenizer --vocab-size V`): for pre-tokenized data;
  text is space-separated ids; vocabulary V + 1, the end-of-document id is V (Megatron-core's
  convention).
- `HuggingFaceTokenizer` (`--tokenizer-model PATH`, a tokenizer.json or a folder holding one):
  through the `tokenizers` package (the optional extra `hf`); end of document is the first of
  the usual end-of-text tokens the vocabulary has.
- `ByteTokenizer` (the converter's default; no Megatron-core counterpart): UTF-8 bytes as ids
  0..255, end of document 256; data written with it is read for training as
  `NullTokenizer --vocab-size 256`.

Every failure to build one raises `TokenizerError`, one line saying what to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer")
CONVERTER_TOKENIZER_TYPES = ("ByteTokenizer",) + TOKENIZER_TYPES
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
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError("HuggingFaceTokenizer needs the 'tokenizers' package "
                                 "(pip install 'epoverlap[hf]')") from None
        path = Path(model)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"{file}: no such tokenizer file (give a tokenizer.json or a "
                                 "folder holding one)")
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # the library raises its own exception types
            raise TokenizerError(f"{file}: not a Hugging Face tokenizer file "
                                 f"({str(error).splitlines()[0]})") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = next((self._tokenizer.token_to_id(token) for token in END_OF_TEXT_TOKENS
                         if self._tokenizer.token_to_id(token) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def build_tokenizer(tokenizer_type: str, vocab_size: Optional[int] = None,
                    tokenizer_model: Optional[str] = None):
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
    raise TokenizerError(f"tokenizer type {tokenizer_type!r}: allowed "
                         f"{', '.join(CONVERTER_TOKENIZER_TYPES)}")
