"""Megatron-LM's GPT2BPETokenizer (--vocab-file, --merge-file; pure Python) and
Llama2Tokenizer (--tokenizer-model, a SentencePiece model whose vocabulary is read without the
sentencepiece package), on tiny files written here. Pure CPU."""

from __future__ import annotations

import importlib.util
import json

import pytest

from epoverlap.config import parse_config, validate_config
from epoverlap.data.tokenizers import (GPT2BPETokenizer, TokenizerError, _byte_chars,
                                       build_tokenizer)
from epoverlap.errors import ConfigError

MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o"]


def write_gpt2_files(folder):
    """A vocab.json of GPT-2's 256 byte characters, the merges' results and <|endoftext|>, and a
    merges.txt of MERGES. -> (vocab path, merges path, vocab)."""
    pieces = [_byte_chars()[b] for b in range(256)]
    pieces += ["".join(m.split()) for m in MERGES] + ["<|endoftext|>"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    return str(folder / "vocab.json"), str(folder / "merges.txt"), vocab


def test_gpt2_bpe_applies_the_merges_lowest_rank_first(tmp_path):
    vocab_file, merge_file, vocab = write_gpt2_files(tmp_path)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file,
                                merge_file=merge_file)
    assert (tokenizer.vocab_size, tokenizer.eod) == (263, 262)
    # "hello": h+e, l+l, he+ll, hell+o -> one piece; " wor": Ġ+w, Ġw+o, then r alone
    assert tokenizer.encode("hello wor") == [vocab["hello"], vocab["Ġwo"], vocab["r"]]
    # bytes outside ASCII go through GPT-2's byte characters: é is two bytes
    assert tokenizer.encode("é") == [vocab[_byte_chars()[0xC3]], vocab[_byte_chars()[0xA9]]]


def test_gpt2_bpe_files_that_cannot_be_read_are_one_line(tmp_path):
    vocab_file, merge_file, _ = write_gpt2_files(tmp_path)
    (tmp_path / "bad.txt").write_text("one two three\n")
    with pytest.raises(TokenizerError, match="--merge-file .*bad.txt: not a GPT-2 merges.txt"):
        GPT2BPETokenizer(vocab_file, str(tmp_path / "bad.txt"))
    with pytest.raises(TokenizerError, match="--vocab-file .*nothing.json"):
        GPT2BPETokenizer(str(tmp_path / "nothing.json"), merge_file)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (sizes below 128 here)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


def write_sentencepiece_model(path, pieces):
    """A SentencePiece ModelProto holding `pieces` (each: piece, score 0, type), as
    sentencepiece writes them, and a trainer spec after them."""
    body = b"".join(_field(1, _field(1, p.encode()) + b"\x15\x00\x00\x00\x00" + b"\x18\x01")
                    for p in pieces)
    path.write_bytes(body + _field(2, b"\x08\x01"))
    return str(path)


PIECES = ["<unk>", "<s>", "</s>", "\u2581a", "b"]


def test_llama2_tokenizer_reads_the_vocabulary_without_sentencepiece(tmp_path):
    model = write_sentencepiece_model(tmp_path / "tokenizer.model", PIECES)
    tokenizer = build_tokenizer("Llama2Tokenizer", tokenizer_model=model)
    assert (tokenizer.vocab_size, tokenizer.eod) == (5, 2)
    (tmp_path / "not.model").write_bytes(b"\x07not a model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=str(tmp_path / "not.model"))


@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is not None,
                    reason="sentencepiece is installed")
def test_llama2_tokenizer_names_the_extra_that_encodes_text(tmp_path):
    model = write_sentencepiece_model(tmp_path / "tokenizer.model", PIECES)
    with pytest.raises(TokenizerError) as info:
        build_tokenizer("Llama2Tokenizer", tokenizer_model=model).encode("a b")
    assert str(info.value) == ("Llama2Tokenizer encodes text through the sentencepiece package "
                               "(pip install 'epoverlap[sentencepiece]')")


def test_vocab_and_merge_files_alone_mean_gpt2_bpe_as_megatron_lm_s_tests_use_them(tmp_path):
    vocab_file, merge_file, _ = write_gpt2_files(tmp_path)
    cfg = parse_config(["--mock-data", "--vocab-file", vocab_file, "--merge-file", merge_file])
    validate_config(cfg, 1, False)
    assert cfg.data.tokenizer == "GPT2BPETokenizer" and cfg.data.tokenizer_type is None


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file=None: --tokenizer-type "
     "GPT2BPETokenizer needs --vocab-file and --merge-file"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "9", "--vocab-file", "v.json"],
     "--vocab-file=v.json: only with --tokenizer-type GPT2BPETokenizer"),
    (["--tokenizer-type", "Llama2Tokenizer"], "--tokenizer-model=None: --tokenizer-type "
     "Llama2Tokenizer needs a SentencePiece tokenizer.model"),
])
def test_a_tokenizer_without_its_files_is_one_line(argv, message):
    with pytest.raises(ConfigError) as info:
        validate_config(parse_config(["--mock-data"] + argv), 1, False)
    assert str(info.value).splitlines()[0] == message


def write_hf_tokenizer(folder, size: int = 4):
    """A WordLevel tokenizer.json (as the `tokenizers` package writes one, the fields read
    here): `size` - 1 words and <|endoftext|> as an added token."""
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, size - 1)}}
    spec = {"version": "1.0", "added_tokens": [{"id": size - 1, "content": "<|endoftext|>",
                                                "special": True}],
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return str(folder / "tokenizer.json")


def test_hugging_face_vocabulary_is_read_without_the_package(tmp_path):
    model = write_hf_tokenizer(tmp_path, 6)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=model)
    assert (tokenizer.vocab_size, tokenizer.eod) == (6, 5)
    (tmp_path / "bad.json").write_text('{"model": {}}')
    with pytest.raises(TokenizerError, match="bad.json: not a Hugging Face tokenizer file"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "bad.json"))


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None,
                    reason="tokenizers is installed")
def test_hugging_face_tokenizer_names_the_extra_that_encodes_text(tmp_path):
    tokenizer = build_tokenizer("HuggingFaceTokenizer",
                                tokenizer_model=write_hf_tokenizer(tmp_path))
    with pytest.raises(TokenizerError, match=r"pip install 'epoverlap\[hf\]'"):
        tokenizer.encode("w1")


def test_gpt2_words_cover_the_text_as_gpt2_s_pattern_splits_it():
    """Every character lands in a word (none dropped); words split where GPT-2's do."""
    from epoverlap.data.tokenizers import GPT2_PATTERN
    text = "snake_case  x=1_000 Ünïcode's 42nd\tend \n"
    words = GPT2_PATTERN.findall(text)
    assert "".join(words) == text
    assert words[:4] == ["snake", "_", "case", " "]
    assert " Ünïcode" in words and "'s" in words and " 42" in words and "nd" in words


def test_gpt2_words_are_gpt2_s_own_pattern_s_but_for_non_decimal_numbers():
    """Against GPT-2's pattern as it is written (the `regex` package's \\p{L}, \\p{N}), on
    random strings of letters, digits, `_`, punctuation, spaces, CJK and emoji: the same words.
    (Numbers that are not decimal digits, ² or Ⅳ, are letters to `re`.)"""
    import random
    regex = pytest.importorskip("regex", reason="the regex package is not installed")
    from epoverlap.data.tokenizers import GPT2_PATTERN
    theirs = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
                           r"""|\s+(?!\S)|\s+""")
    alphabet = list("abcXYZ_019 \t\n=.,!'é中😀\u00a0\u2003")
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert GPT2_PATTERN.findall(text) == theirs.findall(text), repr(text)
