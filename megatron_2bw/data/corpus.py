"""The default corpus: the Python standard library's own source code.

Every machine that runs this package has the standard library, so the demo needs no download.
`build_corpus` writes one JSON line `{"text": <file contents>}` per `.py` file.

Invariants:
- Files are visited in sorted order of their POSIX path relative to the stdlib root, and only
  their bytes are read, so two builds with the same Python version write identical bytes.
- Test suites (`test`, `tests`, `idle_test` directories), `site-packages`, `__pycache__`,
  files over `max_file_bytes` and files that are not UTF-8 are skipped.
- The corpus holds whole files only; it stops before the file that would take the total text
  over `max_chars`.
"""

import json
import os
import sysconfig
from pathlib import Path
from typing import Iterator

DEFAULT_MAX_CHARS = 8_000_000
DEFAULT_MAX_FILE_BYTES = 256_000
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def iter_source_files(root: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Iterator[Path]:
    """Yield the `.py` files under `root` that belong in the corpus, in sorted relative order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        if path.stat().st_size <= max_file_bytes:
            yield path


def iter_documents(root: Path, max_chars: int, max_file_bytes: int) -> Iterator[str]:
    """Yield the texts of the corpus files, at most `max_chars` characters in all."""
    total = 0
    for path in iter_source_files(root, max_file_bytes):
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

    `root` defaults to the standard library of the running interpreter.
    """
    root = Path(root) if root is not None else stdlib_root()
    count = 0
    with open(output_jsonl, "w", encoding="utf-8", newline="\n") as out:
        for text in iter_documents(root, max_chars, max_file_bytes):
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            count += 1
    return count
