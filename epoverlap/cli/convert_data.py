"""Text to Megatron indexed dataset: `epoverlap-convert-data --input PATH... --output-prefix P`.

Writes P.bin and P.idx in Megatron-core's indexed format (`epoverlap.data.indexed`), which
`epoverlap-train --data-path P` (and Megatron-core itself) reads. One document per input text
file, or per line of a `.jsonl` file (its `--json-keys` fields, default `text`, as Megatron's
preprocessing reads them). Inputs: files, folders (their text files, sorted, recursively) and
`stdlib` (the Python standard library's sources, on every machine: the no-download default).

Tokenizers (`--tokenizer-type`):
  ByteTokenizer (default)  UTF-8 bytes as ids 0..255, end-of-document 256; train with
                           `--tokenizer-type NullTokenizer --vocab-size 256`
  NullTokenizer            the text already holds space-separated ids < --vocab-size
  HuggingFaceTokenizer     --tokenizer-model PATH (tokenizer.json or its folder; needs the
                           `tokenizers` package); text is decoded as UTF-8, bad bytes replaced
`--append-eod` ends every document with the tokenizer's end-of-document id. Empty documents
are skipped and counted. Token dtype: uint16 below 65500 ids, else int32.

Exit status 0 written (prints the counts and the training flags to use), 2 bad input (one line
naming the file or flag).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from epoverlap.data.indexed import IndexedWriter, token_dtype_for
from epoverlap.data.tokenizers import (CONVERTER_TOKENIZER_TYPES, ByteTokenizer, TokenizerError,
                                       build_tokenizer)
from epoverlap.training.setup.data import stdlib_folder, text_files


class InputError(ValueError):
    """Bad converter input; one line naming the file or flag."""


def input_files(inputs: Sequence[str]) -> list[Path]:
    """Files named, text files under folders named, `stdlib` expanded; in the order given."""
    files: list[Path] = []
    for item in inputs:
        path = stdlib_folder() if item == "stdlib" else Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = text_files(path)
            if not found:
                raise InputError(f"{item}: no text files under this folder")
            files += found
        else:
            raise InputError(f"{item}: no such file or folder")
    return files


def documents(files: Sequence[Path], json_keys: Sequence[str]) -> Iterator[bytes]:
    """Each document's raw UTF-8 bytes: a whole file, or one field of one .jsonl line."""
    for path in files:
        if path.suffix != ".jsonl":
            yield path.read_bytes()
            continue
        with open(path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield from _json_fields(path, number, line, json_keys)


def _json_fields(path: Path, number: int, line: bytes, keys: Sequence[str]) -> Iterator[bytes]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"{path}:{number}: not JSON ({error.msg})") from None
    for key in keys:
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise InputError(f"{path}:{number}: no text field {key!r} (--json-keys)")
        yield record[key].encode("utf-8")


def encode(tokenizer, raw: bytes) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    return np.asarray(tokenizer.encode(raw.decode("utf-8", errors="replace")), dtype=np.int64)


def convert(inputs: Sequence[str], output_prefix: str, tokenizer, append_eod: bool = False,
            json_keys: Sequence[str] = ("text",)) -> dict:
    """Write OUTPUT_PREFIX.bin/.idx from the inputs. -> counts. Raises InputError."""
    if append_eod and tokenizer.eod is None:
        raise InputError(f"--append-eod: the {tokenizer.name} vocabulary has no end-of-text "
                         "token")
    files = input_files(inputs)
    counts = {"documents": 0, "empty_documents": 0, "tokens": 0}
    with IndexedWriter(output_prefix, token_dtype_for(tokenizer.vocab_size)) as writer:
        for raw in documents(files, json_keys):
            ids = encode(tokenizer, raw)
            if ids.size == 0:
                counts["empty_documents"] += 1
                continue
            writer.add_document(np.append(ids, tokenizer.eod) if append_eod else ids)
            counts["documents"] += 1
        counts["tokens"] = writer.num_tokens
    if counts["documents"] == 0:
        raise InputError(f"{' '.join(inputs)}: no non-empty documents")
    return counts


def training_flags(args: argparse.Namespace, tokenizer) -> str:
    """The `--data-path ... --tokenizer-type ...` that reads the written data for training."""
    if isinstance(tokenizer, ByteTokenizer):
        how = "--tokenizer-type NullTokenizer --vocab-size 256"
    elif args.tokenizer_type == "NullTokenizer":
        how = f"--tokenizer-type NullTokenizer --vocab-size {args.vocab_size}"
    else:
        how = f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {args.tokenizer_model}"
    return f"--data-path {args.output_prefix} {how}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epoverlap-convert-data", allow_abbrev=False,
                                     description="Text files to a Megatron indexed dataset "
                                                 "(PREFIX.bin + PREFIX.idx).")
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="text files, .jsonl files, folders, or 'stdlib'")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer-type", default="ByteTokenizer",
                        choices=CONVERTER_TOKENIZER_TYPES, help="default: ByteTokenizer")
    parser.add_argument("--tokenizer-model", default=None,
                        help="HuggingFaceTokenizer: tokenizer.json or its folder")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="NullTokenizer: ids are below this")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every document with the end-of-document id")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help=".jsonl fields holding the text (default: text)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size, args.tokenizer_model)
        counts = convert(args.input, args.output_prefix, tokenizer, args.append_eod,
                         args.json_keys)
    except (InputError, TokenizerError, ValueError) as error:
        print(f"epoverlap-convert-data: error: {error}", file=sys.stderr)
        return 2
    dtype = np.dtype(token_dtype_for(tokenizer.vocab_size))
    print(f"wrote {args.output_prefix}.bin/.idx: {counts['documents']} documents, "
          f"{counts['tokens']:,} tokens ({dtype}), {counts['empty_documents']} empty skipped")
    print(f"train with: {training_flags(args, tokenizer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
