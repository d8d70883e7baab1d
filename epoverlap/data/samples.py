"""Training samples from indexed datasets: the split, epochs, shuffling and the blend.

Owns how `--data-path`, `--split` and `--seed` turn into the token window of every global
sample, as pure functions of those inputs (no state carried from step to step):

- Split (`split_bounds`; the flag syntax is `config.parse_split`): `--split 969,30,1` cuts a
  dataset's documents into consecutive train / valid / test ranges in those proportions (each
  bound rounded to the nearest document, as Megatron-core does); training reads the train
  range.
- Samples (`DocumentSamples`): in epoch e the train documents are concatenated in an order
  shuffled from (seed, dataset, e); sample j of the epoch is the window of seq_length + 1
  tokens starting at token j * seq_length (windows overlap by the one token that is both the
  last label of one sample and the first input of the next, and may cross documents). The
  samples of an epoch are visited in a second shuffled order, then the next epoch begins.
- Blend (`BlendedSamples`): global sample i goes to the dataset whose share is furthest
  behind its weight at i (each dataset's k-th sample sits at time (k + 1/2) / weight and all
  are merged in time order, ties to the earlier dataset), so after any n samples each
  dataset has had weight * n of them within one. Weights default to the datasets' train
  sample counts. Each dataset keeps its own epochs.

Shape legend: S sequences (documents), L tokens per sample (seq_length + 1).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from epoverlap.data.indexed import IndexedTokens


def split_bounds(num_documents: int, split: Sequence[float], part: int = 0) -> tuple[int, int]:
    """Document range [begin, end) of split `part` (0 train, 1 valid, 2 test)."""
    edges = np.concatenate([[0.0], np.cumsum(split)])
    return (int(round(edges[part] * num_documents)), int(round(edges[part + 1] * num_documents)))


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


class DocumentSamples:
    """The GPT samples of one dataset's document range (see the module docstring)."""

    def __init__(self, data: IndexedTokens, documents: tuple[int, int], seq_length: int,
                 seed: int, dataset_index: int = 0):
        self.data, self.seq_length = data, seq_length
        self.first_doc, self.end_doc = documents
        self.key = (seed, dataset_index)
        self.doc_lengths_S = data.sequence_lengths[self.first_doc:self.end_doc].astype(np.int64)
        self.num_tokens = int(self.doc_lengths_S.sum())
        self.samples_per_epoch = max(self.num_tokens - 1, 0) // seq_length
        self._epochs: dict[int, tuple] = {}  # the last two epochs used

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, cumulative token ends in that order, sample order) of `epoch`."""
        if epoch not in self._epochs:
            doc_order_S = _rng(*self.key, epoch, 0).permutation(self.doc_lengths_S.size)
            ends_S = np.cumsum(self.doc_lengths_S[doc_order_S])
            sample_order = _rng(*self.key, epoch, 1).permutation(self.samples_per_epoch)
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (doc_order_S, ends_S, sample_order)
        return self._epochs[epoch]

    def sample(self, index: int) -> np.ndarray:
        """Tokens [L] int64 of this dataset's `index`-th sample (any index >= 0)."""
        if self.samples_per_epoch == 0:
            raise ValueError(f"{self.data.prefix}: {self.num_tokens} tokens, fewer than "
                             f"seq_length + 1 = {self.seq_length + 1}")
        epoch, within = divmod(index, self.samples_per_epoch)
        doc_order_S, ends_S, sample_order = self._epoch(epoch)
        start = int(sample_order[within]) * self.seq_length
        return self._window(doc_order_S, ends_S, start, self.seq_length + 1)

    def _window(self, doc_order_S, ends_S, start: int, length: int) -> np.ndarray:
        pieces, slot = [], int(np.searchsorted(ends_S, start, side="right"))
        offset = start - (int(ends_S[slot - 1]) if slot else 0)
        while length > 0:
            document = self.first_doc + int(doc_order_S[slot])
            piece = self.data.sequence(document)[offset:offset + length]
            pieces.append(piece)
            length -= piece.size
            slot, offset = slot + 1, 0
        return np.concatenate(pieces).astype(np.int64)


def blend_order(weights: Sequence[float], total: int) -> tuple[np.ndarray, np.ndarray]:
    """For global samples 0..total-1: (dataset index, that dataset's sample index). Each [total]."""
    weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    times, owners = [], []
    for dataset, weight in enumerate(weights):
        if weight <= 0:
            continue
        count = int(np.ceil(weight * total)) + 1
        times.append((np.arange(count) + 0.5) / weight)
        owners.append(np.full(count, dataset, dtype=np.int64))
    order = np.argsort(np.concatenate(times), kind="stable")[:total]
    dataset_of = np.concatenate(owners)[order]
    index_in = np.zeros(total, dtype=np.int64)
    for dataset in range(weights.size):
        mask = dataset_of == dataset
        index_in[mask] = np.arange(int(mask.sum()))
    return dataset_of, index_in


class BlendedSamples:
    """Global sample i -> tokens [L]: the blend over datasets, each with its own epochs."""

    def __init__(self, datasets: Sequence[DocumentSamples], weights: Optional[Sequence[float]],
                 total_samples: int):
        self.datasets = list(datasets)
        if weights is None:
            weights = [d.samples_per_epoch for d in self.datasets]
        self.weights = [float(w) for w in weights]
        self.total_samples = total_samples
        self.dataset_of, self.index_in = blend_order(self.weights, total_samples)

    def sample(self, index: int) -> np.ndarray:
        if not 0 <= index < self.total_samples:
            raise IndexError(f"global sample {index}: the run has {self.total_samples}")
        return self.datasets[int(self.dataset_of[index])].sample(int(self.index_in[index]))
