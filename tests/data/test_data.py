"""Data tier (pure CPU): the indexed format (our writer and converter, and megatron-core's own
IndexedDatasetBuilder when installed, read back token for token), damaged files, the split,
epochs, shuffling and blend of samples, the sources' input checks, and tokenizers."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from epoverlap.config import parse_config, parse_split, validate_config
from epoverlap.data.indexed import IndexedWriter, open_indexed
from epoverlap.data.samples import BlendedSamples, DocumentSamples, blend_order, split_bounds
from epoverlap.data.tokenizers import TokenizerError, build_tokenizer
from epoverlap.errors import ConfigError
from epoverlap.training.setup.data import (IndexedData, StepFeed, SyntheticData, open_data_source,
                                           step_batches)
from epoverlap.cli import convert_data

NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--num-experts", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--num-microbatches", "2", "--train-iters", "3"]


def write_documents(prefix, documents, dtype=np.uint16):
    with IndexedWriter(str(prefix), dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return str(prefix)


def random_documents(count=40, seed=0, vocab=1000, max_len=50):
    gen = np.random.default_rng(seed)
    return [gen.integers(0, vocab, gen.integers(0, max_len)) for _ in range(count)]


def source(prefix_args, extra=(), world=1):
    cfg = parse_config(SMALL + ["--data-path", *prefix_args] + NULL_TOKENIZER + list(extra))
    validate_config(cfg, world, False)
    return open_data_source(cfg, world)


# ------------------------------------------------------------------------------ the format
@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_writer_round_trip(tmp_path, dtype):
    docs = random_documents(vocab=200)
    data = open_indexed(write_documents(tmp_path / "d", docs, dtype))
    assert data.tokens.dtype == dtype and data.num_sequences == len(docs)
    for index, doc in enumerate(docs):
        assert np.array_equal(data.sequence(index), doc)
    assert list(data.document_indices) == list(range(len(docs) + 1))


def test_converter_writes_what_the_reader_reads(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("héllo\n")
    (tmp_path / "in" / "b.py").write_text("")  # empty: skipped, counted
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "xy"}) + "\n\n"
                                      + json.dumps({"text": "z"}) + "\n")
    prefix = str(tmp_path / "out" / "ds")
    tokenizer = build_tokenizer("ByteTokenizer")
    counts = convert_data.convert([str(tmp_path / "in"), str(tmp_path / "c.jsonl")], prefix,
                                  tokenizer, append_eod=True)
    assert counts == {"documents": 3, "empty_documents": 1, "tokens": 7 + 1 + 3 + 2}
    data = open_indexed(prefix)
    expected = [list("héllo\n".encode()) + [256], [ord("x"), ord("y"), 256], [ord("z"), 256]]
    assert [data.sequence(i).tolist() for i in range(3)] == expected


def test_converter_cli_errors_are_one_line(tmp_path, capsys):
    assert convert_data.main(["--input", str(tmp_path / "none"), "--output-prefix",
                              str(tmp_path / "o")]) == 2
    (tmp_path / "ids.txt").write_text("1 2 x")
    assert convert_data.main(["--input", str(tmp_path / "ids.txt"), "--output-prefix",
                              str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", "10"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "no such file" in errors[0] and "x" in errors[1]
    (tmp_path / "ids.txt").write_text("1 2 9")
    assert convert_data.main(["--input", str(tmp_path / "ids.txt"), "--output-prefix",
                              str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", "10", "--append-eod"]) == 0
    assert "--tokenizer-type NullTokenizer --vocab-size 10" in capsys.readouterr().out
    assert open_indexed(str(tmp_path / "o")).sequence(0).tolist() == [1, 2, 9, 10]


@pytest.fixture(scope="module")
def megatron_builder():
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError as error:
        pytest.skip(f"megatron-core is not installed (pip install -e '.[peer]'): {error}")
    return IndexedDatasetBuilder


@pytest.mark.parametrize("dtype, multimodal", [(np.uint16, False), (np.int32, False),
                                               (np.int64, True)])
def test_megatron_core_builder_output_is_read_token_for_token(tmp_path, megatron_builder,
                                                              dtype, multimodal):
    """Documents of several sequences (add_item + end_document) and whole documents
    (add_document), written by megatron-core's IndexedDatasetBuilder."""
    prefix = str(tmp_path / "mc")
    builder = megatron_builder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    sequences, boundaries = [], [0]
    for doc, seq in enumerate(random_documents(count=12, seed=3)):
        builder.add_item(torch.from_numpy(seq), mode=doc % 2)
        sequences.append(seq)
        if doc % 3 == 2:
            builder.end_document()
            boundaries.append(len(sequences))
    whole = random_documents(count=2, seed=4, max_len=20)
    builder.add_document(torch.from_numpy(np.concatenate(whole)), [len(s) for s in whole],
                         modes=[0, 1] if multimodal else None)
    sequences += whole
    boundaries.append(len(sequences))
    builder.finalize(prefix + ".idx")
    data = open_indexed(prefix)
    assert data.tokens.dtype == dtype
    assert data.num_sequences == len(sequences)
    for index, seq in enumerate(sequences):
        assert np.array_equal(data.sequence(index), seq), index
    assert data.document_indices.tolist() == boundaries


def test_megatron_core_reads_what_we_write(tmp_path, megatron_builder):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = random_documents(seed=5)
    prefix = write_documents(tmp_path / "ours", docs)
    theirs = IndexedDataset(prefix)
    assert len(theirs) == len(docs)
    for index, doc in enumerate(docs):
        assert np.array_equal(theirs[index], doc)


# ------------------------------------------------------------------------------ damaged input
def _damage(prefix, kind):
    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    if kind == "missing_bin":
        (__import__("os")).remove(bin_)
    elif kind == "short_bin":
        raw = open(bin_, "rb").read()
        open(bin_, "wb").write(raw[:len(raw) // 2])
    elif kind == "short_idx":
        raw = open(idx, "rb").read()
        open(idx, "wb").write(raw[:-9])
    elif kind == "bad_magic":
        raw = open(idx, "rb").read()
        open(idx, "wb").write(b"NOTANIDX!" + raw[9:])
    elif kind == "float_tokens":
        raw = bytearray(open(idx, "rb").read())
        raw[17:18] = struct.pack("<B", 7)
        open(idx, "wb").write(bytes(raw))


@pytest.mark.parametrize("kind, file, fragment", [
    ("missing_bin", ".bin", "no such file"), ("short_bin", ".bin", "truncated"),
    ("short_idx", ".idx", "truncated"), ("bad_magic", ".idx", "bad magic"),
    ("float_tokens", ".idx", "not an integer type")])
def test_damaged_dataset_is_one_line_naming_the_file(tmp_path, kind, file, fragment):
    prefix = write_documents(tmp_path / "d", random_documents())
    _damage(prefix, kind)
    with pytest.raises(ConfigError) as info:
        source([prefix])
    message = str(info.value)
    assert message.startswith(f"--data-path={prefix}: {prefix}{file}") and fragment in message
    assert "\n" not in message


def test_too_short_and_out_of_vocabulary_data_are_refused(tmp_path):
    short = write_documents(tmp_path / "short", [np.arange(10)] * 1)
    with pytest.raises(ConfigError, match="fewer than --seq-length \\+ 1 = 17"):
        source([short])
    big = write_documents(tmp_path / "big", [np.arange(990, 1010)] * 3)
    with pytest.raises(ConfigError, match="token id 1009 is outside"):
        source([big])


def test_empty_folder_and_short_text_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "short.txt").write_text("abc")
    for data, fragment in ((tmp_path / "empty", "no text files"),
                           (tmp_path / "short.txt", "3 bytes of text, fewer than")):
        cfg = parse_config(SMALL + ["--data", str(data)])
        validate_config(cfg, 1, False)
        with pytest.raises(ConfigError, match=fragment):
            open_data_source(cfg, 1)


# ------------------------------------------------------------------------------ samples
def test_split_bounds_round_like_megatron_core():
    split = parse_split("969,30,1")
    bounds = [split_bounds(1000, split, part) for part in range(3)]
    assert bounds == [(0, 969), (969, 999), (999, 1000)]
    assert split_bounds(7, parse_split("1"), 0) == (0, 7)


def test_an_epoch_visits_every_window_of_the_shuffled_stream_once(tmp_path):
    docs = random_documents(count=30, seed=1)
    data = open_indexed(write_documents(tmp_path / "d", docs))
    samples = DocumentSamples(data, (0, 30), seq_length=8, seed=7)
    per_epoch = samples.samples_per_epoch
    assert per_epoch == (sum(len(d) for d in docs) - 1) // 8
    for epoch in range(2):
        doc_order, _, _ = samples._epoch(epoch)
        stream = np.concatenate([docs[i] for i in doc_order])
        windows = {tuple(stream[j * 8:j * 8 + 9]) for j in range(per_epoch)}
        seen = {tuple(samples.sample(epoch * per_epoch + k)) for k in range(per_epoch)}
        assert seen == windows
    assert not np.array_equal(samples._epoch(0)[0], samples._epoch(1)[0])


def test_samples_are_a_function_of_the_seed(tmp_path):
    data = open_indexed(write_documents(tmp_path / "d", random_documents(seed=2)))
    first = [DocumentSamples(data, (0, 40), 8, seed=3).sample(k) for k in range(20)]
    again = [DocumentSamples(data, (0, 40), 8, seed=3).sample(k) for k in range(20)]
    other = [DocumentSamples(data, (0, 40), 8, seed=4).sample(k) for k in range(20)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_blend_keeps_every_prefix_within_one_sample_of_its_weight():
    weights = [0.3, 0.7, 0.0, 1.0]
    dataset_of, index_in = blend_order(weights, 1000)
    shares = np.asarray(weights) / sum(weights)
    for n in range(1, 1001):
        counts = np.bincount(dataset_of[:n], minlength=4)
        assert np.all(np.abs(counts - shares * n) <= 1.0), n
    for dataset in range(4):
        assert index_in[dataset_of == dataset].tolist() == list(range((dataset_of ==
                                                                       dataset).sum()))


def test_global_samples_go_to_ranks_in_megatron_order(tmp_path):
    """Microbatch m of step s covers W * B consecutive global samples, rank r the B after r*B;
    the rank is the global rank, so the expert-parallel split does not enter."""
    prefix = write_documents(tmp_path / "d", random_documents(count=80, seed=6))
    world = 2
    data = source([prefix], world=world)
    assert isinstance(data, IndexedData)
    for step in (1, 3):
        for mb in range(2):
            for rank in range(world):
                tokens, labels = data.batch(step, rank, mb, 2, 16)
                first = (((step - 1) * 2 + mb) * world + rank) * 2
                for b in range(2):
                    window = data.samples.sample(first + b)
                    assert tokens[b].tolist() == window[:-1].tolist()
                    assert labels[b].tolist() == window[1:].tolist()


def test_weighted_blend_draws_from_both_prefixes(tmp_path):
    a = write_documents(tmp_path / "a", [np.full(40, 1)] * 20)
    b = write_documents(tmp_path / "b", [np.full(40, 2)] * 20)
    data = source(["0.25", a, "0.75", b], world=1)
    tokens = np.concatenate([data.batch(step, 0, mb, 2, 16)[0].numpy().ravel()
                             for step in (1, 2, 3) for mb in (0, 1)])
    assert set(np.unique(tokens)) == {1, 2}
    assert np.mean(tokens == 2) == pytest.approx(0.75, abs=0.1)
    assert "a 25%" in data.description and "b 75%" in data.description


# ------------------------------------------------------------------------------ tokenizers
def test_null_tokenizer_follows_megatron_core():
    tokenizer = build_tokenizer("NullTokenizer", 256)
    assert (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    assert tokenizer.encode("1 2  255") == [1, 2, 255]
    with pytest.raises(TokenizerError, match="256"):
        tokenizer.encode("256")


def test_mock_data_takes_the_tokenizer_vocabulary():
    cfg = parse_config(SMALL + ["--mock-data"] + NULL_TOKENIZER)
    validate_config(cfg, 1, False)
    data = open_data_source(cfg, 1)
    assert data.vocab_size == 1001
    assert int(data.batch(1, 0, 0, 2, 16)[0].max()) < 1001


def test_hugging_face_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the 'hf' extra is not installed")
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.save(str(tmp_path / "tokenizer.json"))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (tokenizer.vocab_size, tokenizer.eod) == (4, 1)
    assert tokenizer.encode("hello world nope") == [2, 3, 0]
    (tmp_path / "text.txt").write_text("hello world " * 40)
    prefix = str(tmp_path / "hf")
    assert convert_data.main(["--input", str(tmp_path / "text.txt"), "--output-prefix", prefix,
                              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                              str(tmp_path), "--append-eod"]) == 0
    assert open_indexed(prefix).sequence(0)[-3:].tolist() == [2, 3, 1]
    cfg = parse_config(SMALL + ["--data-path", prefix, "--split", "1", "--tokenizer-type",
                                "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)])
    validate_config(cfg, 1, False)
    assert open_data_source(cfg, 1).vocab_size == 4
    with pytest.raises(TokenizerError, match="no such tokenizer file"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "none.json"))


def _bigram_chain_reference(data: SyntheticData, step, rank, microbatch, batch, seq):
    """The mock data's definition, token by token in Python: each row draws its choices and
    first token from a generator seeded by (seed, step, rank, microbatch), then follows the
    bigram table."""
    seed = (((data.seed * 1_000_003 + step) * 10_007 + rank) * 101 + microbatch) % (2**62)
    gen = torch.Generator().manual_seed(seed)
    choices = torch.randint(0, data.next_tokens.shape[1], (batch, seq), generator=gen).tolist()
    first = torch.randint(0, data.vocab_size, (batch,), generator=gen).tolist()
    table = data.next_tokens.tolist()
    rows = []
    for b in range(batch):
        row = [first[b]]
        for pos in range(seq):
            row.append(table[row[-1]][choices[b][pos]])
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def test_mock_data_is_the_bigram_chain_whether_made_alone_or_with_its_step():
    """A step's microbatches made together (one walk of the chain for all their rows, what the
    trainer asks for) equal each made alone, and both follow the chain's definition."""
    data = SyntheticData(50, seed=3)
    together = step_batches(data, 4, 1, 3, 2, 40)
    for mb, (tokens, labels) in enumerate(together):
        alone = data.batch(4, 1, mb, 2, 40)
        assert torch.equal(tokens, alone[0]) and torch.equal(labels, alone[1])
        rows = _bigram_chain_reference(data, 4, 1, mb, 2, 40)
        assert torch.equal(tokens, rows[:, :-1]) and torch.equal(labels, rows[:, 1:])
    assert not torch.equal(together[0][0], together[1][0])
    assert tokens.dtype == torch.int64 and tokens.shape == (2, 40)


def test_step_batches_asks_other_sources_one_microbatch_at_a_time():
    class OneAtATime:
        def __init__(self):
            self.calls = []

        def batch(self, step, rank, microbatch, batch, seq):
            self.calls.append(microbatch)
            return torch.full((batch, seq), microbatch), torch.zeros(batch, seq)

    source = OneAtATime()
    batches = step_batches(source, 2, 0, 3, 1, 4)
    assert source.calls == [0, 1, 2] and [int(t[0, 0]) for t, _ in batches] == [0, 1, 2]


class _CountingSource:
    """A source that records which steps were made, on which thread, and fails at step 5."""

    def __init__(self):
        self.inner, self.made = SyntheticData(64, seed=3), []

    def batch(self, step, rank, microbatch, batch, seq):
        import threading
        self.made.append((step, threading.current_thread().name))
        if step == 5:
            raise ValueError("step 5's batch is broken")
        return self.inner.batch(step, rank, microbatch, batch, seq)


def test_step_feed_gives_each_steps_batches_and_makes_the_next_one_ahead():
    source = _CountingSource()
    feed = StepFeed(source, rank=1, count=2, batch=2, seq=8)
    try:
        for step in (1, 2, 2, 3):  # step 2 asked twice (a rerun): made again, the same
            got = feed.batches(step)
            want = step_batches(source.inner, step, 1, 2, 2, 8)
            assert all(torch.equal(a, b) for pair in zip(got, want) for a, b in zip(*pair))
        feed._ahead[1].result()  # step 4, made on the worker before anyone asked
        worker_steps = {step for step, thread in source.made if thread.startswith("epoverlap")}
        assert {2, 3, 4} <= worker_steps
        feed.batches(4)
        with pytest.raises(ValueError, match="step 5's batch is broken"):
            feed.batches(5)  # the worker's error, raised when step 5 asks
    finally:
        feed.close()


def test_a_split_whose_valid_part_is_empty_names_a_split_that_holds_one_sample(tmp_path):
    """Mixtral's --split 99990,8,2 on 40 documents leaves the valid part no document: the line
    names --split in document counts whose valid part (the last documents) holds one sample,
    and that split evaluates."""
    prefix = write_documents(tmp_path / "d", [np.arange(10)] * 40)  # 10 tokens each
    evaluate = ["--eval-interval", "2", "--eval-iters", "1"]
    with pytest.raises(ConfigError) as info:
        source([prefix], ["--split", "99990,8,2", *evaluate])
    message = str(info.value)
    assert "its valid split (documents [40, 40) by --split 99990,8,2) has 0 tokens" in message
    assert message.endswith("the valid part needs one sample: --split 38,2,0 (document counts: "
                            "its last 2 of 40 documents) would hold one"), message
    assert source([prefix], ["--split", "38,2,0", *evaluate]).validation is not None
