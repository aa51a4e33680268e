"""The default corpus: the Python standard library's own source code, and for larger sizes
the installed packages' sources and documentation (no download needed).

`build_corpus` writes one JSON line `{"text": <file contents>}` per file, whole files only,
stopping before the file that would take the total over `max_chars`.

Invariants:
- Sources come in a fixed order (`corpus_files`: the standard library, megatron-core, every
  other `.py`, `.md` and `.rst` file under site-packages), files in sorted POSIX-path order.
- So a corpus of a given `max_chars` is a prefix of every larger one, and two builds write
  identical bytes on machines with the same Python minor version while `max_chars` stays
  within the standard library (`DEFAULT_MAX_CHARS` does).
- Test suites, nested `site-packages`, `__pycache__`, files over `max_file_bytes` and files
  that are not UTF-8 are skipped. The details: docs/data.md, "The default corpus".
"""

import json
import os
import sysconfig
from itertools import chain
from pathlib import Path
from typing import Iterable, Iterator

DEFAULT_MAX_CHARS = 8_000_000
DEFAULT_MAX_FILE_BYTES = 256_000
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_PINNED_PACKAGE = ("megatron", "core")
"""The site-packages folder taken right after the standard library: megatron-core's sources,
the same bytes wherever setup.py's pin holds."""
_DOC_SUFFIXES = (".py", ".md", ".rst")


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages_root() -> Path:
    """The running interpreter's site-packages (pure-Python packages)."""
    return Path(sysconfig.get_paths()["purelib"])


def iter_source_files(root: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                      suffixes: tuple[str, ...] = (".py",),
                      skip: Path | None = None) -> Iterator[Path]:
    """Yield the files under `root` ending in one of `suffixes` that belong in the corpus, in
    sorted relative order; the folder `skip` (already taken) is left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if d not in _SKIPPED_DIRS and Path(dirpath, d) != skip]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(suffixes))
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        if path.is_file() and path.stat().st_size <= max_file_bytes:
            yield path


def corpus_files(max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Iterator[Path]:
    """Every candidate file of the default corpus, in corpus order (see the module's
    invariants): the standard library, megatron-core, the rest of site-packages."""
    packages = site_packages_root()
    pinned = packages.joinpath(*_PINNED_PACKAGE)
    return chain(iter_source_files(stdlib_root(), max_file_bytes),
                 iter_source_files(pinned, max_file_bytes) if pinned.is_dir() else (),
                 iter_source_files(packages, max_file_bytes, _DOC_SUFFIXES, skip=pinned))


def iter_documents(root: Path | None, max_chars: int, max_file_bytes: int) -> Iterator[str]:
    """Yield the texts of the corpus files, at most `max_chars` characters in all: the `.py`
    files under `root`, or with `root=None` those of `corpus_files`."""
    files = corpus_files(max_file_bytes) if root is None else iter_source_files(root,
                                                                                max_file_bytes)
    yield from _capped_texts(files, max_chars)


def _capped_texts(files: Iterable[Path], max_chars: int) -> Iterator[str]:
    """The non-blank UTF-8 texts of `files`, stopping before the one that would take the total
    over `max_chars`."""
    total = 0
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        if total + len(text) > max_chars:
            return
        total += len(text)
        yield text


def build_corpus(
    output_jsonl: str | os.PathLike,
    max_chars: int = DEFAULT_MAX_CHARS,
    root: str | os.PathLike | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> int:
    """Write the corpus to `output_jsonl` and return the number of documents written.

    `root` (only its `.py` files) defaults to `corpus_files`: the standard library, then the
    installed packages where `max_chars` asks for more.
    """
    root = Path(root) if root is not None else None
    count = 0
    with open(output_jsonl, "w", encoding="utf-8", newline="\n") as out:
        for text in iter_documents(root, max_chars, max_file_bytes):
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            count += 1
    return count
