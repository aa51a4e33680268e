"""GPT datasets from `--data-path`/`--split`, and per-rank data iterators.

`build_gpt_datasets` builds megatron-core `GPTDataset`s (or `BlendedDataset`s for a weighted
blend) with `BlendedMegatronDatasetBuilder` (`build_datasets` for other dataset classes);
`make_data_iterator` yields a rank's microbatches as dicts of tensors; `blend_from_flags`
parses `--data-path`'s blend syntax and checks `--split` and every dataset.

Invariants: building is collective when a process group exists (rank 0 builds the index
caches, a barrier, then the others load them); the sample order is Megatron-LM's
MegatronPretrainingSampler (global indices in order from `consumed_samples`, in steps of
`micro_batch_size * data_parallel_size`, rank r taking positions [r*mbs, (r+1)*mbs)), so a
run resumed with the samples consumed continues at the same sample.

The API with its signatures: docs/data.md, "GPT datasets and data iterators".
"""

import contextlib
import functools
import re
from typing import Callable, Iterator

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed import check_indexed_dataset

_WEIGHT = r"\s*(\d+(\.\d*)?|\.\d+)\s*"
_SPLIT = re.compile(rf"^{_WEIGHT}(,{_WEIGHT}){{0,2}}$")


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's blend syntax: `PREFIX [PREFIX ...]` or `WEIGHT PREFIX [WEIGHT PREFIX ...]`."""
    if not data_path:
        raise DataError("--data-path", "no dataset prefix given")
    weights = [_as_float(item) for item in data_path[0::2]]
    if len(data_path) % 2 == 1 or all(w is None for w in weights):
        return list(data_path), None
    bad_weight = any(w is None or not 0 < w < float("inf") for w in weights)
    if bad_weight or any(_as_float(p) is not None for p in data_path[1::2]):
        expected = "PREFIX ... or WEIGHT PREFIX ... with finite weights > 0"
        raise DataError("--data-path", f"expected {expected}, got {data_path}")
    return list(data_path[1::2]), weights


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def check_split(split: str) -> None:
    """Raise DataError unless `split` is 1 to 3 comma-separated weights with a positive sum.
    Quotes around it are allowed: megatron-core reads only the numbers, and Megatron-LM's own
    launch scripts pass `--split '99,1,0'` with the quotes inside a bash array."""
    weights = split.strip().strip("'\"")
    if not _SPLIT.match(weights) or sum(float(w) for w in weights.split(",")) <= 0:
        raise DataError("--split", f"expected up to three weights like '969,30,1', got {split!r}")


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """The [begin, end) documents of the train, valid and test splits exactly as megatron-core's
    builder cuts them from `num_documents` (None for a split of weight 0)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if bounds is None else
            tuple(int(round(b * float(num_documents))) for b in bounds) for bounds in matrix]


def documents_needed(split: str, num_samples: tuple[int, int, int]) -> int:
    """The fewest documents for which every split asked for samples gets at least one."""
    def enough(n: int) -> bool:
        ranges = split_document_ranges(split, n)
        return all(r is None or wanted == 0 or r[1] > r[0]
                   for r, wanted in zip(ranges, num_samples))

    return next((n for n in range(1, 1_000_001) if enough(n)), 1_000_001)


MAX_EPOCHS = 10_000
"""More passes over a split than this are refused: megatron-core's GPTDataset builds its
document and sample indices over every epoch up front (memory and time in proportion)."""


def check_splits_have_tokens(prefix: str, split: str, num_samples: tuple[int, int, int],
                             seq_length: int) -> None:
    """DataError unless every split asked for samples holds tokens of `prefix`, enough that
    the samples need at most MAX_EPOCHS passes: megatron-core's GPTDataset repeats a split's
    tokens until they cover the samples asked for, and on a split of no tokens (too few
    documents for `--split`'s share) it repeats forever."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    lengths = numpy.asarray(dataset.sequence_lengths, dtype=numpy.int64)
    ranges = split_document_ranges(split, len(lengths))
    for name, docs, wanted in zip(("train", "valid", "test"), ranges, num_samples):
        if docs is None or wanted == 0:
            continue
        tokens = int(lengths[docs[0]:docs[1]].sum())
        if tokens == 0:
            raise DataError("--data-path", f"the {name} split of {prefix} holds no tokens: "
                            f"--split {split} gives it documents [{docs[0]}, {docs[1]}) of "
                            f"{len(lengths)}; it needs at least "
                            f"{documents_needed(split, num_samples)} documents (or a --split "
                            f"that gives the {name} split 0, or --eval-iters 0)")
        needed = wanted * seq_length + 1
        if needed > MAX_EPOCHS * tokens:
            raise DataError("--data-path", f"the {name} split of {prefix} holds {tokens} tokens; "
                            f"its {wanted} samples of --seq-length {seq_length} would pass over "
                            f"them {-(-needed // tokens)} times (at most {MAX_EPOCHS}): use a "
                            f"larger corpus or split, or fewer iterations")


def build_gpt_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    tokenizer,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    is_built_on_rank: Callable[[], bool] | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    mmap_bin_files: bool = True,
) -> tuple:
    """Build the train, valid and test GPT datasets (see the module docstring).

    Every prefix is checked with `check_indexed_dataset` first. `cache_dir` holds
    megatron-core's document/sample/shuffle index caches (by default next to the data).
    `num_samples` are the samples each split must provide; a split may hold more.
    """
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend_from_flags(data_path, split),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=mmap_bin_files,
    )
    for prefix in config.blend[0]:
        check_splits_have_tokens(prefix, split, num_samples, seq_length)
    return build_datasets(GPTDataset, config, num_samples, is_built_on_rank)


def blend_from_flags(data_path: list[str], split: str) -> tuple[list[str], list[float] | None]:
    """Parse `--data-path`, check `--split` and every dataset; return megatron-core's blend."""
    prefixes, weights = parse_data_path(data_path)
    check_split(split)
    for prefix in prefixes:
        check_indexed_dataset(prefix, "--data-path")
    return prefixes, weights


def build_datasets(
    dataset_cls: type,
    config,
    num_samples: tuple[int, int, int],
    is_built_on_rank: Callable[[], bool] | None = None,
) -> tuple:
    """(train, valid, test) of `dataset_cls` from `BlendedMegatronDatasetBuilder`; collective
    over the world group when one exists, and usable without one. A split asked for no samples
    is not built (None): megatron-core would build it anyway, and an empty one forever."""
    config.split_matrix = [None if wanted == 0 else bounds
                           for bounds, wanted in zip(config.split_matrix, num_samples)]
    builder = BlendedMegatronDatasetBuilder(
        dataset_cls, list(num_samples), is_built_on_rank or (lambda: True), config
    )
    with _process_group_of_one():
        return tuple(builder.build())


@contextlib.contextmanager
def _process_group_of_one() -> Iterator[None]:
    """Give megatron-core a process group while it builds, if the caller has none.

    megatron-core's `BlendedDataset` calls `torch.distributed.get_rank()` when it writes its
    index cache, without checking `is_initialized()`. An in-memory world of one (gloo) makes
    that call valid; it is destroyed on exit. With an existing group this does nothing.
    """
    if torch.distributed.is_initialized():
        yield
        return
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def train_valid_test_num_samples(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> tuple[int, int, int]:
    """Megatron-LM's sample counts: every training step, every evaluation (one per
    `eval_interval` steps plus one at the end) and one test pass, each of `eval_iters` batches."""
    evaluations = train_iters // eval_interval + 1
    return (
        train_iters * global_batch_size,
        evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    )


class PretrainingSampler(torch.utils.data.Sampler):
    """Batches of sample indices for one data-parallel rank (Megatron's pretraining sampler).

    Invariants: for each step, the batches of ranks 0..dp-1 are disjoint and together are the
    `micro_batch_size * data_parallel_size` consecutive indices starting at
    `consumed_samples + step * micro_batch_size * data_parallel_size`; an incomplete last step
    is dropped.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data-parallel rank {data_parallel_rank} not in [0, {data_parallel_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.offset = data_parallel_rank * micro_batch_size
        self.step = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return max(self.total_samples - self.consumed_samples, 0) // self.step

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(len(self)):
            start = self.consumed_samples + i * self.step + self.offset
            yield list(range(start, start + self.micro_batch_size))


def make_data_iterator(
    dataset,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_samples: int = 0,
    cyclic: bool = False,
    num_workers: int = 0,
) -> Iterator[dict[str, torch.Tensor]] | None:
    """Iterator over this rank's micro-batches of `dataset`, or None when `dataset` is None.

    With `cyclic`, the iterator starts over (at `consumed_samples`) when the dataset is used up,
    as Megatron's validation iterator does. Worker processes ignore SIGTERM and SIGINT: a signal
    to the whole job is the rank's to handle (it saves), and the workers end with the rank.
    """
    if dataset is None:
        return None
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
    )
    if len(sampler) == 0:
        raise ValueError(
            f"no complete step left: {len(dataset)} samples, {consumed_samples} consumed, "
            f"{micro_batch_size} x {data_parallel_size} (micro batch x data parallel) per step"
        )
    from megatron_2bw.runtime.lifetime import ignore_stop_signals

    loader = torch.utils.data.DataLoader(  # workers end with their rank, not with a signal
        dataset, batch_sampler=sampler, num_workers=num_workers,
        persistent_workers=num_workers > 0, worker_init_fn=ignore_stop_signals,
    )
    return _cycle(loader) if cyclic else iter(loader)


def _cycle(loader: torch.utils.data.DataLoader) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield from loader


_MOCK_INDICES: dict[str, tuple] = {}
"""Mock datasets' (document, sample, shuffle) indices by description hash, newest last."""
_MOCK_INDICES_KEPT = 6
"""Two configurations' three splits (each split's arrays are ~150 MB at sequence length 16)."""


@functools.cache
def _mock_dataset_class():
    """megatron-core's `MockGPTDataset`, its indices built once per process and description:
    they are a pure function of it (seed, sequence length, split, samples), and building them
    orders megatron-core's 100,000 mock documents (~1 s per split at sequence length 16), while
    a process that trains several times (the planner's measurements, a test's runs) asks for
    the same ones again. The builder's collectives run as before."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    class OncePerProcessMockGPTDataset(MockGPTDataset):
        def _build_document_sample_shuffle_indices(self):
            key = self.unique_description_hash
            if key not in _MOCK_INDICES:
                while len(_MOCK_INDICES) >= _MOCK_INDICES_KEPT:
                    _MOCK_INDICES.pop(next(iter(_MOCK_INDICES)))
                _MOCK_INDICES[key] = super()._build_document_sample_shuffle_indices()
            return _MOCK_INDICES[key]

    return OncePerProcessMockGPTDataset


def build_mock_gpt_datasets(seq_length: int, seed: int, vocab_size: int,
                            num_samples: tuple[int, int, int]) -> tuple:
    """megatron-core's `MockGPTDataset` splits (`--mock-data`): synthetic token sequences of a
    `NullTokenizer` vocabulary, for smoke tests, benchmarks and profiling without data files
    (the same samples as megatron-core's; their indices kept per process, `_mock_dataset_class`)."""
    from megatron_2bw.data.tokenizer import build_tokenizer

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=None,
        split="969,30,1",
        tokenizer=build_tokenizer("NullTokenizer", vocab_size=vocab_size - 1),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    return build_datasets(_mock_dataset_class(), config, num_samples)
