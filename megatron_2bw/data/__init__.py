"""Data pipeline: corpus, tokenizer, indexed datasets and GPT data iterators.

Modules (import them directly; this package only re-exports `DataError`):
- `corpus`     the default corpus, built from the Python standard library's sources
- `tokenizer`  sentencepiece training, Megatron `--tokenizer-type` tokenizers, vocab padding
- `preprocess` JSONL -> Megatron `.bin`/`.idx` indexed datasets (used by tools/preprocess_data.py)
- `indexed`    eager checks of `.bin`/`.idx` pairs before megatron-core opens them
- `default`    builds and caches the default corpus, tokenizer and dataset
- `gpt`        megatron-core GPT datasets from `--data-path`/`--split`, per-rank data iterators
"""

from megatron_2bw.data.errors import DataError

__all__ = ["DataError"]
