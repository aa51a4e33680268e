"""Data pipeline: corpus, tokenizer, indexed datasets, GPT datasets, samplers, bad inputs.

The independent references are the original text (round trips through the tokenizer and the
.bin/.idx files), a token stream concatenated here from the raw documents (GPT windows), and
index arithmetic written out here (data-parallel slices). The corpus and tokenizer are built
once per session, small, in a temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy
import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron_2bw.data import DataError
from megatron_2bw.data import default as default_data
from megatron_2bw.data.corpus import build_corpus, stdlib_root
from megatron_2bw.data.gpt import PretrainingSampler, build_gpt_datasets, make_data_iterator
from megatron_2bw.data.indexed import check_indexed_dataset
from megatron_2bw.data.preprocess import preprocess_jsonl, split_sentences
from megatron_2bw.data.tokenizer import build_tokenizer, padded_vocab_size, train_sentencepiece
from tests.dist import spawn

CORPUS_CHARS = 400_000
VOCAB = 1024
SEQ = 32
GPT = "GPTSentencePieceTokenizer"
BERT = "SentencePieceTokenizer"


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session")
def corpus(workdir) -> str:
    path = str(workdir / "corpus.jsonl")
    build_corpus(path, max_chars=CORPUS_CHARS)
    return path


@pytest.fixture(scope="session")
def texts(corpus) -> list[str]:
    with open(corpus, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="session")
def model(corpus, workdir) -> str:
    return train_sentencepiece(corpus, str(workdir / "tok"), VOCAB)


@pytest.fixture(scope="session")
def tokenizer(model):
    return build_tokenizer(GPT, model)


@pytest.fixture(scope="session")
def gpt_prefix(corpus, model, workdir) -> str:
    return preprocess_jsonl(corpus, str(workdir / "gpt"), GPT, model, append_eod=True)["text"]


@pytest.fixture(scope="session")
def train_set(gpt_prefix, tokenizer, workdir):
    train, valid, test = build_gpt_datasets(
        [gpt_prefix], "1", SEQ, 1234, tokenizer, (500, 0, 0), cache_dir=str(workdir / "index-cache")
    )
    assert valid is None and test is None
    return train


# ---- corpus -------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_capped(tmp_path, texts):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    build_corpus(first, max_chars=CORPUS_CHARS)
    build_corpus(second, max_chars=CORPUS_CHARS)
    assert first.read_bytes() == second.read_bytes()
    assert 0 < sum(map(len, texts)) <= CORPUS_CHARS
    assert all(text.strip() for text in texts)


def test_corpus_documents_are_whole_stdlib_files(texts):
    documents = {text.encode("utf-8") for text in texts}
    sizes = {len(document) for document in documents}
    sources = set()
    for dirpath, dirnames, filenames in os.walk(stdlib_root()):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "test", "tests")]
        paths = (Path(dirpath, name) for name in filenames if name.endswith(".py"))
        sources.update(p.read_bytes() for p in paths if p.stat().st_size in sizes)
    assert documents <= sources


def _documents(path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_a_corpus_larger_than_the_stdlib_goes_on_with_megatron_core(tmp_path):
    """Past the whole standard library (the stdlib-only corpus, as the default is built) a
    larger size takes megatron-core's own source files next, the stdlib's documents first and
    unchanged."""
    build_corpus(tmp_path / "stdlib.jsonl", max_chars=10**9, root=stdlib_root())
    stdlib = _documents(tmp_path / "stdlib.jsonl")
    build_corpus(tmp_path / "larger.jsonl", max_chars=sum(map(len, stdlib)) + 300_000)
    larger = _documents(tmp_path / "larger.jsonl")
    assert larger[:len(stdlib)] == stdlib
    extra = larger[len(stdlib):]
    assert 0 < sum(map(len, extra)) <= 300_000
    core = Path(sysconfig.get_paths()["purelib"]) / "megatron" / "core"
    sources = {p.read_bytes() for p in core.rglob("*.py") if "tests" not in p.parts}
    assert {text.encode("utf-8") for text in extra} <= sources


def test_a_larger_default_corpus_keeps_the_default_tokenizer(tmp_path, monkeypatch):
    """A corpus larger than the default learns its tokenizer from the default-size corpus (its
    own prefix): the same vocabulary as the default build's, the default's documents first."""
    monkeypatch.setattr(default_data, "DEFAULT_MAX_CHARS", 60_000)
    default = default_data.prepare_default_data(tmp_path, vocab_size=512, max_chars=60_000)
    larger = default_data.prepare_default_data(tmp_path, vocab_size=512, max_chars=150_000)
    vocab = [Path(d.tokenizer_model).with_suffix(".vocab").read_text() for d in (default, larger)]
    assert vocab[0] == vocab[1]
    documents = [_documents(Path(d.tokenizer_model).with_name("corpus.jsonl"))
                 for d in (default, larger)]
    assert len(documents[1]) > len(documents[0])
    assert documents[1][:len(documents[0])] == documents[0]


# ---- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_round_trips_text(tokenizer, texts):
    for text in texts[:20] + ["x\n\n\tindented  twice\r\n  é ☯ 𝔘\n"]:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_tokenizer_training_is_deterministic(corpus, model, tmp_path):
    again = build_tokenizer(GPT, train_sentencepiece(corpus, str(tmp_path / "again"), VOCAB))
    assert again.inv_vocab == build_tokenizer(GPT, model).inv_vocab


def test_special_ids_for_gpt_and_bert(model, tokenizer):
    assert (tokenizer.pad, tokenizer.eod, tokenizer.vocab_size) == (0, 2, VOCAB)
    bert = build_tokenizer(BERT, model)
    assert (bert.pad, bert.eod, bert.cls, bert.sep, bert.mask) == (0, 2, 3, 4, 5)
    pieces = [bert.inv_vocab[i] for i in (0, 2, 3, 4, 5)]
    assert pieces == ["[PAD]", "[EOD]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(bert.inv_vocab) == bert.vocab_size == VOCAB


def test_null_tokenizer(tmp_path):
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (null.eod, null.vocab_size, null.tokenize("5 6 7")) == (100, 101, [5, 6, 7])
    (tmp_path / "n.jsonl").write_text('{"text": "1 2 3"}\n{"text": "99"}\n')
    jsonl, prefix = str(tmp_path / "n.jsonl"), str(tmp_path / "n")
    prefixes = preprocess_jsonl(jsonl, prefix, "NullTokenizer", append_eod=True, vocab_size=100)
    dataset = IndexedDataset(prefixes["text"])
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3, 100], [99, 100]]


@pytest.mark.parametrize(
    "size, divisor, tp, padded", [(4096, 128, 1, 4096), (4097, 128, 2, 4352), (1000, 128, 1, 1024)]
)
def test_padded_vocab_size(size, divisor, tp, padded):
    assert padded_vocab_size(size, divisor, tp) == padded


# ---- indexed datasets ---------------------------------------------------------------------


def test_documents_round_trip_through_indexed_dataset(gpt_prefix, tokenizer, texts):
    dataset = IndexedDataset(gpt_prefix)
    assert dataset.index.dtype == numpy.uint16
    assert len(dataset.document_indices) - 1 == len(dataset) == len(texts)
    for i, text in enumerate(texts):
        ids = dataset[i].tolist()
        assert ids[-1] == tokenizer.eod
        assert tokenizer.detokenize(ids[:-1]) == text
    summary = check_indexed_dataset(gpt_prefix)
    assert summary.num_tokens == sum(len(dataset[i]) for i in range(len(dataset)))


def test_sentences_round_trip_and_workers_agree(corpus, model, tokenizer, texts, workdir):
    def sentences(workers: int) -> str:
        prefix = str(workdir / f"s{workers}")
        prefixes = preprocess_jsonl(
            corpus, prefix, BERT, model, split_sentences=True, workers=workers
        )
        return prefixes["text"]

    one, two = sentences(1), sentences(2)
    assert one.endswith("_text_sentence")
    for ext in (".bin", ".idx"):
        assert Path(one + ext).read_bytes() == Path(two + ext).read_bytes()
    dataset = IndexedDataset(one)
    bounds = dataset.document_indices
    assert len(bounds) - 1 == len(texts) and len(dataset) > 5 * len(texts)
    for doc, text in enumerate(texts):
        sentences = [dataset[s].tolist() for s in range(bounds[doc], bounds[doc + 1])]
        assert all(sentences) and "".join(tokenizer.detokenize(s) for s in sentences) == text


@pytest.mark.parametrize(
    "text", ["One. Two!  Three?\n\n  four\n", "\n\n  lead", "a.b c", "x\n", " \n "]
)
def test_split_sentences_keeps_every_character(text):
    sentences = split_sentences(text)
    assert all(s.strip() for s in sentences)
    assert "".join(sentences) == (text if text.strip() else "")


# ---- GPT datasets and iterators -----------------------------------------------------------


def test_gpt_samples_are_consecutive_windows_of_the_token_stream(train_set, gpt_prefix):
    documents = IndexedDataset(gpt_prefix)
    stream = numpy.concatenate([documents[d] for d in train_set.document_index])
    assert sorted(train_set.shuffle_index.tolist()) == list(range(len(train_set)))
    assert len(train_set) >= 500
    for i in range(0, len(train_set), 7):
        start = int(train_set.shuffle_index[i]) * SEQ
        window = torch.from_numpy(stream[start : start + SEQ + 1].astype(numpy.int64))
        sample = train_set[i]
        assert torch.equal(sample["tokens"], window[:-1])
        assert torch.equal(sample["labels"], window[1:])
        assert torch.equal(sample["position_ids"], torch.arange(SEQ))
        assert bool(sample["loss_mask"].all())


def test_data_parallel_slices_partition_each_step():
    mbs, dp, consumed, total = 2, 3, 4, 41
    samplers = [PretrainingSampler(total, consumed, mbs, rank, dp) for rank in range(dp)]
    steps = list(zip(*samplers))
    assert len(steps) == (total - consumed) // (mbs * dp)
    for step, batches in enumerate(steps):
        start = consumed + step * mbs * dp
        assert sum(batches, []) == list(range(start, start + mbs * dp))


def test_iterators_give_each_rank_its_slice_and_resume(train_set):
    mbs, dp = 2, 2
    ranks = [make_data_iterator(train_set, mbs, rank, dp) for rank in range(dp)]
    for step in range(3):
        expected = torch.stack([train_set[i]["tokens"] for i in range(step * 4, step * 4 + 4)])
        assert torch.equal(torch.cat([next(it)["tokens"] for it in ranks]), expected)
    resumed = make_data_iterator(train_set, mbs, 1, dp, consumed_samples=3 * mbs * dp)
    assert torch.equal(next(resumed)["tokens"], next(ranks[1])["tokens"])


def test_cyclic_iterator_starts_over(train_set):
    tail = len(train_set) - 2 * 4
    iterator = make_data_iterator(train_set, 2, 0, 2, consumed_samples=tail, cyclic=True)
    batches = [next(iterator)["tokens"] for _ in range(3)]
    assert torch.equal(batches[2], batches[0])
    with pytest.raises(ValueError, match="no complete step"):
        make_data_iterator(train_set, 2, 0, 2, consumed_samples=len(train_set) - 3)


def test_weighted_blend_builds(gpt_prefix, tokenizer, workdir):
    train, valid, _ = build_gpt_datasets(
        ["0.3", gpt_prefix, "0.7", gpt_prefix], "90,10,0", SEQ, 7, tokenizer, (64, 16, 0),
        cache_dir=str(workdir / "index-cache"),
    )
    assert len(train) >= 64 and len(valid) >= 16
    assert train[0]["tokens"].shape == (SEQ,)


def _first_batch_on_rank(rank: int, world_size: int, prefix: str, model: str, cache: str):
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    tokenizer = build_tokenizer(GPT, model)
    train, _, _ = build_gpt_datasets([prefix], "1", SEQ, 1234, tokenizer, (64, 0, 0), cache)
    tokens = next(make_data_iterator(train, 2, rank, world_size))["tokens"]
    torch.distributed.destroy_process_group()
    return tokens


def test_builds_in_a_gloo_process_group(gpt_prefix, model, train_set, tmp_path):
    """Rank 0 builds the index caches, then rank 1 loads them; each gets its slice."""
    tokens = spawn(_first_batch_on_rank, 2, gpt_prefix, model, str(tmp_path), out_dir=tmp_path)
    assert torch.equal(torch.cat(tokens), torch.stack([train_set[i]["tokens"] for i in range(4)]))


# ---- bad inputs ---------------------------------------------------------------------------


def _copy_dataset(prefix: str, target: Path) -> str:
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, str(target) + ext)
    return str(target)


def _overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path: str, nbytes: int) -> None:
    os.truncate(path, os.path.getsize(path) - nbytes)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: os.remove(p + ".idx"), "not found"),
        (lambda p: _overwrite(p + ".idx", 0, b"NOTANIDX"), "bad magic header"),
        (lambda p: _truncate(p + ".idx", 8), "truncated or corrupt"),
        (lambda p: _truncate(p + ".bin", 2), "truncated or from different runs"),
        (lambda p: _overwrite(p + ".idx", 9, b"\x07"), "index version"),
        (lambda p: _overwrite(p + ".idx", 34, b"\xff\xff\xff\x7f"), "offsets do not match"),
    ],
)
def test_damaged_dataset_raises_data_error(damage, message, gpt_prefix, tokenizer, tmp_path):
    prefix = _copy_dataset(gpt_prefix, tmp_path / "copy")
    damage(prefix)
    with pytest.raises(DataError, match=f"^--data-path: .*{message}"):
        build_gpt_datasets([prefix], "1", SEQ, 1, tokenizer, (8, 0, 0), cache_dir=str(tmp_path))


def test_prefix_with_extension_gets_a_hint(gpt_prefix):
    with pytest.raises(DataError, match="without .bin/.idx"):
        check_indexed_dataset(gpt_prefix + ".bin")


@pytest.mark.parametrize(
    "data_path, split, flag",
    [
        (["0.5", "{p}", "oops", "{p}"], "1", "--data-path"),
        ([], "1", "--data-path"),
        (["{p}"], "99,1,x", "--split"),
        (["{p}"], "0,0", "--split"),
        (["{p}"], "1..2", "--split"),
        (["{p}"], "'99,x'", "--split"),
    ],
)
def test_bad_flags_raise_data_error(data_path, split, flag, gpt_prefix, tokenizer):
    paths = [item.format(p=gpt_prefix) for item in data_path]
    with pytest.raises(DataError, match=f"^{flag}: "):
        build_gpt_datasets(paths, split, SEQ, 1, tokenizer, (8, 0, 0))


def test_a_quoted_split_cuts_as_megatron_lm_reads_it():
    """Megatron-LM's launch scripts pass `--split '99,1,0'` with the quotes in the value;
    megatron-core reads the numbers only, so the documents are cut 99 / 1 / 0 of 100."""
    from megatron_2bw.data.gpt import check_split, split_document_ranges

    check_split("'99,1,0'")
    assert split_document_ranges("'99,1,0'", 100) == [(0, 99), (99, 100), None]


def test_bad_tokenizer_raises_data_error(tmp_path):
    with pytest.raises(DataError, match="^--tokenizer-model: .*does not exist"):
        build_tokenizer(GPT, str(tmp_path / "missing.model"))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="^--tokenizer-model: .*not a sentencepiece model"):
        build_tokenizer(GPT, str(tmp_path / "junk.model"))
    with pytest.raises(DataError, match="^--tokenizer-type: "):
        build_tokenizer("TikTokenizer", str(tmp_path / "junk.model"))
    with pytest.raises(DataError, match="^--vocab-size: "):
        build_tokenizer("NullTokenizer")


def test_bad_tokenizer_training_input_raises_data_error(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a b"}\n{"body": "c"}\n')
    with pytest.raises(DataError, match="^--input: .*in.jsonl:2 is not a JSON object"):
        train_sentencepiece(str(tmp_path / "in.jsonl"), str(tmp_path / "tok"), 64)
    with pytest.raises(DataError, match="^--input: .*does not exist"):
        train_sentencepiece(str(tmp_path / "missing.jsonl"), str(tmp_path / "tok"), 64)


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "ok"}', "{broken"], "^--input: .*:2 is not valid JSON"),
        (['{"body": "x"}'], "^--json-keys: .*:1 has no"),
    ],
)
@pytest.mark.parametrize("n", [1, 2])
def test_bad_jsonl_raises_data_error_and_leaves_no_files(lines, message, n, model, tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        preprocess_jsonl(str(tmp_path / "in.jsonl"), str(tmp_path / "o"), GPT, model, workers=n)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


# ---- default data -------------------------------------------------------------------------


def test_default_data_is_built_once_and_rebuilt_when_incomplete(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_2BW_DATA_CACHE", str(tmp_path))
    data = default_data.prepare_default_data(vocab_size=512, max_chars=100_000)
    check_indexed_dataset(data.data_prefix)
    stamp = os.stat(data.tokenizer_model).st_mtime_ns
    assert default_data.prepare_default_data(vocab_size=512, max_chars=100_000) == data
    assert os.stat(data.tokenizer_model).st_mtime_ns == stamp
    sentences = default_data.prepare_default_data(
        vocab_size=512, max_chars=100_000, split_sentences=True
    )
    check_indexed_dataset(sentences.data_prefix)

    _truncate(data.data_prefix + ".bin", 2)
    rebuilt = default_data.prepare_default_data(vocab_size=512, max_chars=100_000)
    assert check_indexed_dataset(rebuilt.data_prefix).num_tokens > 0


def test_interrupted_default_build_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(default_data, "train_sentencepiece", interrupted)
    with pytest.raises(KeyboardInterrupt):
        default_data.prepare_default_data(tmp_path, vocab_size=512, max_chars=100_000)
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_mock_datasets_built_once_per_process_give_megatron_cores_samples(monkeypatch):
    """--mock-data's indices are kept per process and description: a second build of the same
    splits reads them (no new ordering), and every split's samples (first, middle and last
    ones) equal those of megatron-core's own MockGPTDataset built afresh."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    from megatron_2bw.data import gpt

    counts = (40, 8, 0)
    ours = gpt.build_mock_gpt_datasets(64, 1234, 128, counts)
    kept = dict(gpt._MOCK_INDICES)
    again = gpt.build_mock_gpt_datasets(64, 1234, 128, counts)
    assert all(a.shuffle_index is b.shuffle_index for a, b in zip(ours, again) if a is not None)
    assert gpt._MOCK_INDICES.keys() == kept.keys()
    monkeypatch.setattr(gpt, "_mock_dataset_class", lambda: MockGPTDataset)
    theirs = gpt.build_mock_gpt_datasets(64, 1234, 128, counts)
    assert [d is None for d in ours] == [d is None for d in theirs] == [False, False, True]
    for mine, reference in zip(ours[:2], theirs[:2]):
        assert len(mine) == len(reference)
        for i in [*range(50), len(mine) // 2, len(mine) - 1]:
            for key, value in reference[i].items():
                assert numpy.array_equal(numpy.asarray(mine[i][key]), numpy.asarray(value)), \
                    (i, key)
