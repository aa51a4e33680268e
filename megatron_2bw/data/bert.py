"""BERT datasets from `--data-path`/`--split` (megatron-core's masked word-piece dataset), and a
mock BERT dataset.

`build_bert_datasets` builds megatron-core `BERTMaskedWordPieceDataset`s (or `BlendedDataset`s)
over sentence-level indexed data with Megatron-LM's pretrain_bert.py settings, collectively
like `gpt.build_gpt_datasets`; `build_mock_bert_datasets` gives random `MockBERTDataset`s for
`--mock-data`; `check_bert_tokenizer` checks BERT's special tokens.

Invariants: every sample is a dict of `seq_length` int64 arrays as megatron-core yields it
(text, types, labels, loss_mask, padding_mask, is_random, truncated); a tokenizer without
BERT's special tokens, or a split that must give samples but holds no document of enough
sentences, raises DataError before anything is built.

The API and the sample fields: docs/data.md, "BERT datasets".
"""

from __future__ import annotations

from typing import Callable

import numpy
import torch

from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron_2bw.data import gpt
from megatron_2bw.data.errors import DataError

__all__ = ["build_bert_datasets", "build_mock_bert_datasets", "check_bert_tokenizer",
           "MockBERTDataset"]

_SPECIAL_TOKENS = ("cls", "sep", "mask", "pad")


def check_bert_tokenizer(tokenizer) -> None:
    """Raise DataError naming `--tokenizer-type` unless `tokenizer` has [CLS], [SEP], [MASK]
    and [PAD] ids (megatron-core's BERT dataset reads them)."""
    missing = []
    for name in _SPECIAL_TOKENS:
        try:
            value = getattr(tokenizer, name)
        except Exception:  # megatron-core's GPT-mode sentencepiece raises NameError here
            value = None
        if value is None or (isinstance(value, int) and value < 0):
            missing.append(name)
    if missing:
        raise DataError("--tokenizer-type", f"BERT needs a tokenizer with {', '.join(missing)} "
                        "tokens: use SentencePieceTokenizer")


def build_bert_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    tokenizer,
    num_samples: tuple[int, int, int],
    *,
    binary_head: bool = True,
    masking_probability: float = 0.15,
    short_sequence_probability: float = 0.1,
    cache_dir: str | None = None,
    is_built_on_rank: Callable[[], bool] | None = None,
) -> tuple:
    """Build the train, valid and test BERT datasets (see the module docstring).

    With `binary_head` a sample holds at least two sentences (A and B), so documents of one
    sentence are never used; without it, A may be the whole sample and B empty.
    """
    check_bert_tokenizer(tokenizer)
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=gpt.blend_from_flags(data_path, split),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        masking_probability=masking_probability,
        short_sequence_probability=short_sequence_probability,
        masking_max_ngram=3,
        masking_do_full_word=False,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=binary_head,
    )
    prefixes, _ = config.blend
    for prefix in prefixes:
        check_splits_have_samples(prefix, split, num_samples, binary_head)
    return gpt.build_datasets(BERTMaskedWordPieceDataset, config, num_samples, is_built_on_rank)


# megatron-core's sample mapping (datasets/helpers.cpp) skips documents of several sentences
# that hold one longer than this.
_LONG_SENTENCE = 512


def check_splits_have_samples(prefix: str, split: str, num_samples: tuple[int, int, int],
                              binary_head: bool) -> None:
    """DataError unless every split that must give samples holds a document megatron-core's
    sample mapping can use (without one, its mapping loops over ~2^31 epochs finding nothing)."""
    min_sentences = 2 if binary_head else 1
    dataset = IndexedDataset(prefix)
    starts = numpy.asarray(dataset.document_indices, dtype=numpy.int64)
    sentences = numpy.diff(starts)
    long_before = numpy.concatenate(
        [[0], numpy.cumsum(numpy.asarray(dataset.sequence_lengths) > _LONG_SENTENCE)])
    has_long = long_before[starts[1:]] > long_before[starts[:-1]]
    usable = (sentences >= min_sentences) & ((sentences == 1) | ~has_long)
    ranges = gpt.split_document_ranges(split, len(sentences))
    for name, docs, wanted in zip(("train", "valid", "test"), ranges, num_samples):
        if docs is None or wanted == 0:
            continue
        begin, end = docs
        if not usable[begin:end].any():
            need = "two sentences" if min_sentences == 2 else "one sentence"
            raise DataError("--data-path", f"no BERT sample fits in the {name} split of {prefix}:"
                            f" each needs a document of at least {need} (sentence-level data "
                            "comes from tools/preprocess_data.py --split-sentences)")


class MockBERTDataset(torch.utils.data.Dataset):
    """Random BERT samples, each a pure function of (seed, index), in the layout of the module
    docstring: random ids in [FIRST_ID, vocab_size), A and B at least one token each, a random
    amount of padding, masking as BERT's (15% of A and B; of those 80% [MASK], 10% a random id,
    10% unchanged), and A/B swapped at random when `binary_head`."""

    PAD, CLS, SEP, MASK = 0, 1, 2, 3
    FIRST_ID = 4

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int,
                 binary_head: bool = True, masking_probability: float = 0.15):
        if seq_length < 5:
            raise ValueError(f"a mock BERT sample needs seq_length >= 5, got {seq_length}")
        if vocab_size <= self.FIRST_ID:
            raise ValueError(f"a mock BERT vocabulary needs more than {self.FIRST_ID} ids")
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.binary_head, self.masking_probability = seed, binary_head, masking_probability

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        rng = numpy.random.RandomState((self.seed * 1_000_003 + idx) % 2**32)
        s = self.seq_length
        length = rng.randint(max(5, s // 2), s + 1)  # [CLS] A [SEP] B [SEP]
        length_a = rng.randint(1, length - 3)
        length_b = length - 3 - length_a
        a, b = (rng.randint(self.FIRST_ID, self.vocab_size, n) for n in (length_a, length_b))
        is_random = bool(self.binary_head and rng.random_sample() < 0.5)
        if is_random:
            a, b = b, a
        tokens = numpy.concatenate([[self.CLS], a, [self.SEP], b, [self.SEP]]).astype(numpy.int64)
        types = numpy.zeros(s, dtype=numpy.int64)
        types[len(a) + 2:length] = 1

        content = numpy.concatenate([numpy.arange(1, len(a) + 1),
                                     numpy.arange(len(a) + 2, length - 1)])
        n_masked = max(1, int(round(len(content) * self.masking_probability)))
        positions = numpy.sort(rng.choice(content, n_masked, replace=False))
        labels = numpy.full(s, -1, dtype=numpy.int64)
        labels[positions] = tokens[positions]
        for position in positions:
            draw = rng.random_sample()
            if draw < 0.8:
                tokens[position] = self.MASK
            elif draw < 0.9:
                tokens[position] = rng.randint(self.FIRST_ID, self.vocab_size)
        loss_mask = numpy.zeros(s, dtype=numpy.int64)
        loss_mask[positions] = 1
        padding_mask = numpy.zeros(s, dtype=numpy.int64)
        padding_mask[:length] = 1
        text = numpy.full(s, self.PAD, dtype=numpy.int64)
        text[:length] = tokens
        return {"text": text, "types": types, "labels": labels, "is_random": int(is_random),
                "padding_mask": padding_mask, "loss_mask": loss_mask, "truncated": 0}


def build_mock_bert_datasets(seq_length: int, seed: int, vocab_size: int,
                             num_samples: tuple[int, int, int], *, binary_head: bool = True,
                             masking_probability: float = 0.15) -> tuple:
    """(train, valid, test) mock datasets of the requested sizes (None where a size is 0);
    each split draws from its own seed."""
    return tuple(
        MockBERTDataset(n, seq_length, vocab_size, seed + 7919 * i, binary_head,
                        masking_probability) if n > 0 else None
        for i, n in enumerate(num_samples))
