"""The default data set: stdlib corpus -> sentencepiece tokenizer -> indexed datasets, cached.

`prepare_default_data()` builds, once per (Python version, corpus size, vocabulary size), into
`{cache_dir}/stdlib-py{X}{Y}-{max_chars}c-v{vocab_size}/`: the corpus, the tokenizer, GPT data
(one sequence per file) and BERT data (one per sentence), and `manifest.json`, written last.
`cache_dir` defaults to `$MEGATRON_2BW_DATA_CACHE`, else `<repo>/data/cache/default`.

Invariants: the build happens in a temporary directory renamed into place only when complete,
under a file lock, so concurrent callers (several ranks) build once and an interrupted build
is never taken for a finished one; a larger `max_chars` keeps the default's tokenizer and
starts with the default's documents.

Run `python -m megatron_2bw.data.default` to build and print the flags that use it.
The files: docs/data.md, "The default data set".
"""

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

from megatron_2bw.data.corpus import DEFAULT_MAX_CHARS, build_corpus
from megatron_2bw.data.preprocess import preprocess_jsonl
from megatron_2bw.data.tokenizer import train_sentencepiece

DEFAULT_VOCAB_SIZE = 4096
GPT_TOKENIZER_TYPE = "GPTSentencePieceTokenizer"
BERT_TOKENIZER_TYPE = "SentencePieceTokenizer"
_REPO_ROOT = Path(__file__).resolve().parents[2]


class DefaultData(NamedTuple):
    """Paths for `--data-path` and `--tokenizer-model`."""

    data_prefix: str
    tokenizer_model: str


def default_cache_dir() -> Path:
    """`$MEGATRON_2BW_DATA_CACHE` if set, else `<repo>/data/cache/default`."""
    override = os.environ.get("MEGATRON_2BW_DATA_CACHE")
    return Path(override) if override else _REPO_ROOT / "data" / "cache" / "default"


def prepare_default_data(
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_chars: int = DEFAULT_MAX_CHARS,
    split_sentences: bool = False,
) -> DefaultData:
    """Build the default data if it is not cached yet; return its paths.

    `split_sentences=False` gives the document-level GPT dataset (use with
    GPTSentencePieceTokenizer); `True` the sentence-level BERT dataset (use with
    SentencePieceTokenizer). Both share one tokenizer model.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    manifest = {
        "python": sys.version.split()[0],
        "max_chars": max_chars,
        "vocab_size": vocab_size,
    }
    v = sys.version_info
    target = cache_dir / f"stdlib-py{v.major}{v.minor}-{max_chars}c-v{vocab_size}"
    if not _is_complete(target, manifest):
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(cache_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _is_complete(target, manifest):
                _build(target, manifest)
    level = "sentence" if split_sentences else "document"
    return DefaultData(str(target / f"stdlib_text_{level}"), str(target / "tokenizer.model"))


def _is_complete(target: Path, manifest: dict) -> bool:
    """True when `target` has a manifest with these parameters and every file it lists has the
    size it records."""
    try:
        recorded = json.loads((target / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if {k: recorded.get(k) for k in manifest} != manifest:
        return False
    files = recorded.get("files") or {}
    return bool(files) and all(
        (target / name).is_file() and (target / name).stat().st_size == size
        for name, size in files.items()
    )


def _build(target: Path, manifest: dict) -> None:
    """Build everything in a temporary sibling directory, then rename it to `target`."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        corpus = str(tmp / "corpus.jsonl")
        build_corpus(corpus, max_chars=manifest["max_chars"])
        model = train_sentencepiece(_tokenizer_corpus(corpus, manifest["max_chars"], tmp),
                                    str(tmp / "tokenizer"), manifest["vocab_size"])
        (tmp / "tokenizer_corpus.jsonl.part").unlink(missing_ok=True)
        prefix = str(tmp / "stdlib")
        preprocess_jsonl(corpus, prefix, GPT_TOKENIZER_TYPE, model, append_eod=True)
        preprocess_jsonl(corpus, prefix, BERT_TOKENIZER_TYPE, model, split_sentences=True)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        digest = hashlib.sha256(Path(corpus).read_bytes()).hexdigest()
        (tmp / "manifest.json").write_text(
            json.dumps({**manifest, "corpus_sha256": digest, "files": files}, indent=1))
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenizer_corpus(corpus: str, max_chars: int, tmp: Path) -> str:
    """The JSONL the tokenizer learns from: `corpus` itself up to the default size, else a
    sibling file with the default-size corpus (a prefix of `corpus`), so every size shares the
    default's vocabulary."""
    if max_chars <= DEFAULT_MAX_CHARS:
        return corpus
    prefix = tmp / "tokenizer_corpus.jsonl.part"
    build_corpus(prefix, max_chars=DEFAULT_MAX_CHARS)
    return str(prefix)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help="see default_cache_dir()")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS,
                        help="corpus size in characters; beyond the default the installed "
                             "packages' sources and docs follow the standard library")
    args = parser.parse_args(argv)
    uses = (("GPT", GPT_TOKENIZER_TYPE, False), ("BERT", BERT_TOKENIZER_TYPE, True))
    for name, tokenizer_type, sentences in uses:
        data = prepare_default_data(args.cache_dir, args.vocab_size, args.max_chars, sentences)
        print(
            f"{name}: --data-path {data.data_prefix} --tokenizer-type {tokenizer_type} "
            f"--tokenizer-model {data.tokenizer_model}"
        )


if __name__ == "__main__":
    main()
