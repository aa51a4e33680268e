"""JSONL documents -> Megatron indexed datasets, as Megatron-LM's tools/preprocess_data.py.

For each `--json-keys` key, `preprocess_jsonl` writes `{output_prefix}_{key}_{level}.bin/.idx`
with megatron-core's `IndexedDatasetBuilder`, `level` being `document`, or `sentence` with
`--split-sentences`. One `.idx` sequence is one sentence (or the whole document); one `.idx`
document is one JSON line. With `--append-eod` the tokenizer's `eod` ends each document.

Invariants:
- Ids are stored as uint16 when the vocabulary has fewer than 65500 ids, else int32
  (`DType.optimal_dtype`, Megatron's rule).
- `"".join(split_sentences(text)) == text` for any text that is not blank, so detokenizing
  the sentences of a document in order gives the document back.
- Documents with no tokens are skipped; every stored sequence has at least one token.
- Both files are written under temporary names and renamed, `.idx` last, when complete.
"""

import contextlib
import json
import multiprocessing
import os
import re
import sys
import time
from typing import Iterable, Iterator

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer import TokenizerSpec

# A sentence ends at a newline, or at ., ! or ? followed by spaces (kept with the sentence).
_SENTENCE_END = re.compile(r"\n|(?<=[.!?])[ \t]+")


def split_sentences(text: str) -> list[str]:
    """Split `text` into lines, and lines into sentences, keeping every character.

    Whitespace-only pieces are glued to the sentence before them (or, at the start, after),
    so no sentence is blank. Code splits mostly into lines; prose into sentences.
    """
    pieces, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        pieces.append(text[start : match.end()])
        start = match.end()
    pieces.append(text[start:])
    sentences, pending = [], ""
    for piece in pieces:
        if piece.strip():
            sentences.append(pending + piece)
            pending = ""
        elif sentences:
            sentences[-1] += piece
        else:
            pending += piece
    return sentences


class DocumentEncoder:
    """Turns one JSON line into, per key, (token ids, sentence lengths)."""

    def __init__(
        self, tokenizer, json_keys: tuple[str, ...], append_eod: bool, split: bool, input_path: str
    ) -> None:
        self.tokenizer = tokenizer
        self.json_keys = json_keys
        self.append_eod = append_eod
        self.split = split
        self.input_path = input_path

    def encode(self, numbered_line: tuple[int, str]) -> dict[str, tuple[list[int], list[int]]]:
        lineno, line = numbered_line
        record = self._parse(lineno, line)
        return {key: self._encode_text(record[key]) for key in self.json_keys}

    def _parse(self, lineno: int, line: str) -> dict:
        where = f"{self.input_path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError("--input", f"{where} is not valid JSON ({err})") from err
        if not isinstance(record, dict):
            raise DataError("--input", f"{where} is not a JSON object")
        for key in self.json_keys:
            if not isinstance(record.get(key), str):
                raise DataError("--json-keys", f"{where} has no string field {key!r}")
        return record

    def _encode_text(self, text: str) -> tuple[list[int], list[int]]:
        ids, lengths = [], []
        for sentence in split_sentences(text) if self.split else [text]:
            sentence_ids = self.tokenizer.tokenize(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and self.append_eod:
            ids.append(self.tokenizer.eod)
            lengths[-1] += 1
        return ids, lengths


_worker_encoder: DocumentEncoder | None = None


def _init_worker(spec: TokenizerSpec, *encoder_args) -> None:
    """Pool initializer: each worker process builds its tokenizer once."""
    global _worker_encoder
    _worker_encoder = DocumentEncoder(spec.build(), *encoder_args)


def _encode_in_worker(numbered_line: tuple[int, str]):
    return _worker_encoder.encode(numbered_line)


def _numbered_lines(input_path: str) -> Iterator[tuple[int, str]]:
    with open(input_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, line


def preprocess_jsonl(
    input_path: str,
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    json_keys: Iterable[str] = ("text",),
    append_eod: bool = False,
    split_sentences: bool = False,
    workers: int = 1,
    vocab_size: int | None = None,
    log_interval: int | None = None,
    **tokenizer_files,
) -> dict[str, str]:
    """Tokenize `input_path` (one JSON object per line) into indexed datasets.

    Returns `{key: dataset prefix}`; each prefix is what `--data-path` takes. `workers > 1`
    tokenizes in a process pool; the output is identical for any number of workers. Every
    `log_interval` documents a progress line goes to stderr.
    `tokenizer_files` are TokenizerSpec's other fields (`vocab_file`, `merge_file`,
    `vocab_extra_ids`).
    """
    if not os.path.isfile(input_path):
        raise DataError("--input", f"{input_path} does not exist")
    spec = TokenizerSpec(tokenizer_type, tokenizer_model, vocab_size, **tokenizer_files)
    tokenizer = spec.build()
    level = "sentence" if split_sentences else "document"
    prefixes = {key: f"{output_prefix}_{key}_{level}" for key in json_keys}
    encoder_args = (tuple(prefixes), append_eod, split_sentences, input_path)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    start = time.time()
    with _atomic_builders(prefixes, dtype) as builders:
        docs = _encode_all(spec, tokenizer, encoder_args, input_path, workers)
        for count, doc in enumerate(docs, start=1):
            for key, (ids, lengths) in doc.items():
                if ids:
                    builders[key].add_document(ids, lengths)
            if log_interval and count % log_interval == 0:
                rate = count / max(time.time() - start, 1e-9)
                print(f"processed {count} documents ({rate:.0f} docs/s)", file=sys.stderr)
    return prefixes


def _encode_all(spec, tokenizer, encoder_args, input_path: str, workers: int):
    """Yield encoded documents in input order, in this process or in a pool of `workers`."""
    if workers <= 1:
        encoder = DocumentEncoder(tokenizer, *encoder_args)
        yield from map(encoder.encode, _numbered_lines(input_path))
        return
    initargs = (spec, *encoder_args)
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        yield from pool.imap(_encode_in_worker, _numbered_lines(input_path), chunksize=32)


@contextlib.contextmanager
def _atomic_builders(prefixes: dict[str, str], dtype):
    """Yield one `IndexedDatasetBuilder` per key, writing under temporary names; when the body
    completes, rename the files into place, `.bin` first and `.idx` last. Temporary files are
    removed in every case."""
    suffix = f"tmp{os.getpid()}"
    tmp = {key: (f"{p}.bin.{suffix}", f"{p}.idx.{suffix}") for key, p in prefixes.items()}
    builders = {key: IndexedDatasetBuilder(tmp[key][0], dtype=dtype) for key in prefixes}
    try:
        yield builders
        for key, prefix in prefixes.items():
            builders[key].finalize(tmp[key][1])
            os.replace(tmp[key][0], f"{prefix}.bin")
            os.replace(tmp[key][1], f"{prefix}.idx")
    finally:
        for key in prefixes:
            builders[key].data_file.close()
            for path in tmp[key]:
                if os.path.exists(path):
                    os.remove(path)
