"""Tokenizers: sentencepiece training and Megatron-LM's `--tokenizer-type` names.

`train_sentencepiece` learns a byte-fallback BPE model whose ids are fixed for the special
pieces (0 [PAD], 1 <unk>, 2 [EOD], 3 [CLS], 4 [SEP], 5 [MASK], 6 "\\n"), so GPT and BERT
datasets share one model. `build_tokenizer` (or `TokenizerSpec(...).build()`) returns
megatron-core tokenizer objects (`MegatronTokenizerText` over a text library) for every
`--tokenizer-type` in `tokenizer_types.TOKENIZER_TYPES`.

Invariants: `detokenize(tokenize(text)) == text` for any text without special pieces
(identity normalization, whitespace kept); every tokenizer carries what `GPTDataset` and
`BERTMaskedWordPieceDataset` read (`eod`, `pad`, `vocab_size`, `unique_identifiers`,
`tokenize`, `detokenize`; BERT's types also `cls`, `sep`, `mask`, `inv_vocab`).

More: docs/data.md, "Tokenizers".
"""

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Iterator

import sentencepiece

from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase
from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText
from megatron_2bw.data import vocab_tokenizers
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer_types import (FILE_FLAGS, TOKENIZER_INPUTS, TOKENIZER_TYPES,
                                               missing_tokenizer_input)

PAD, EOD, CLS, SEP, MASK = "[PAD]", "[EOD]", "[CLS]", "[SEP]", "[MASK]"
NEWLINE = "\n"
# Megatron-LM's legacy sentencepiece tokenizer reads these names for BERT's special ids.
BERT_SPECIAL_TOKENS = {
    "pad_token": PAD,
    "eos_token": EOD,
    "cls_token": CLS,
    "sep_token": SEP,
    "mask_token": MASK,
}
MAX_LINE_BYTES = 16384


def read_documents(input_jsonl: str, json_key: str = "text") -> Iterator[str]:
    """Yield field `json_key` of each non-blank line; DataError naming the line if it is not
    a JSON object with a string there."""
    with open(input_jsonl, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[json_key]
            except (ValueError, KeyError, TypeError):
                text = None
            if not isinstance(text, str):
                where = f"{input_jsonl}:{lineno}"
                raise DataError("--input", f"{where} is not a JSON object with string {json_key!r}")
            yield text


def iter_training_lines(input_jsonl: str, json_key: str = "text") -> Iterator[str]:
    """Yield the non-blank lines of every document; sentencepiece treats each as a sentence.

    Newlines never reach the trainer: "\\n" is a user-defined piece of its own.
    """
    for text in read_documents(input_jsonl, json_key):
        yield from (line for line in text.split(NEWLINE) if line.strip())


def train_sentencepiece(
    input_jsonl: str,
    model_prefix: str,
    vocab_size: int,
    json_key: str = "text",
    model_type: str = "bpe",
    input_sentence_size: int = 300_000,
    seed: int = 1234,
    num_threads: int = 2,
) -> str:
    """Train a sentencepiece model on the documents of `input_jsonl`; return the `.model` path.

    At most `input_sentence_size` lines, sampled with `seed`, are used, which keeps training of
    an 8 MB corpus to a few seconds (BPE). Lines over `MAX_LINE_BYTES` are skipped by the
    trainer. Writes `{model_prefix}.model` and `{model_prefix}.vocab`.
    """
    if not os.path.isfile(input_jsonl):
        raise DataError("--input", f"{input_jsonl} does not exist")
    # Read everything once first: an error raised inside the trainer's iterator would come back
    # as a RuntimeError.
    if sum(1 for text in read_documents(input_jsonl, json_key) if text.strip()) == 0:
        raise DataError("--input", f"{input_jsonl} has no text under {json_key!r}")
    sentencepiece.set_random_generator_seed(seed)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter_training_lines(input_jsonl, json_key),
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        max_sentence_length=MAX_LINE_BYTES,
        # Keep the text as it is: code needs its whitespace back after decoding.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        byte_fallback=True,
        character_coverage=0.9999,
        pad_id=0,
        pad_piece=PAD,
        unk_id=1,
        bos_id=-1,
        eos_id=2,
        eos_piece=EOD,
        control_symbols=[CLS, SEP, MASK],
        user_defined_symbols=[NEWLINE],
        num_threads=num_threads,
        minloglevel=2,
    )
    return f"{model_prefix}.model"


class SentencePieceTextTokenizer(MegatronTokenizerText):
    """megatron-core's sentencepiece text tokenizer with `inv_vocab` built once.

    megatron-core's wrapper rebuilds the whole id -> piece map on each `inv_vocab` access, and
    BERT's masking reads `inv_vocab[token_id]` once per token. The vocabulary is fixed after
    construction, so caching it is safe.
    """

    @functools.cached_property
    def inv_vocab(self) -> dict[int, str]:
        return self._tokenizer.inv_vocab


@dataclass(frozen=True)
class TokenizerSpec:
    """The flags that make a tokenizer (Megatron-LM's names); picklable, so worker processes
    can build their own."""

    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_extra_ids: int = 0

    @classmethod
    def from_args(cls, args) -> "TokenizerSpec":
        return cls(*(getattr(args, field.name, None) or field.default for field in fields(cls)))

    def build(self) -> MegatronTokenizerBase:
        return build_tokenizer(**asdict(self))


class VocabFileTokenizer(MegatronTokenizerText):
    """megatron-core's text tokenizer over one of our offline libraries (`config["library"]`
    names a key of VOCAB_LIBRARIES; the keyword arguments go to its constructor)."""

    def _restore_model(self, **kwargs):
        return VOCAB_LIBRARIES[self.library](**kwargs)


VOCAB_LIBRARIES = {"gpt2-bpe": vocab_tokenizers.GPT2BPE, "wordpiece": vocab_tokenizers.WordPiece}
# Files that make a local HuggingFace tokenizer folder loadable by AutoTokenizer.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                      "tokenizer.model")


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    *,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_extra_ids: int = 0,
) -> MegatronTokenizerBase:
    """Build a tokenizer as Megatron-LM's `--tokenizer-type` and its file flags would, through
    megatron-core's tokenizer package (`MegatronTokenizerText` over a text library).

    - `GPT2BPETokenizer`: byte-level BPE from `vocab_file` (vocab.json) and `merge_file`
      (merges.txt); `eod` is `<|endoftext|>`.
    - `BertWordPieceLowerCase` / `BertWordPieceCase`: WordPiece from `vocab_file` (vocab.txt)
      with Megatron-LM's ids: `cls`, `sep`, `mask`, `pad` from the file, then `[BOS]` (`bos`),
      `[EOS]` (`eos` and `eod`) and `vocab_extra_ids` ids `<extra_id_N>` after the file's.
    - `GPTSentencePieceTokenizer`, `Llama2Tokenizer` (megatron-core builds both alike: no bos
      is added): plain sentencepiece encoding; `eod` is the model's eos piece.
    - `SentencePieceTokenizer`: megatron-core's legacy mode with BERT's special tokens
      (`cls`, `sep`, `mask`, `pad`, `eod`); like Megatron-LM, literal "[CLS]" etc. in the text
      encode to the special ids, and `detokenize` strips outer whitespace. Other text gets the
      same ids as with `GPTSentencePieceTokenizer`.
    - `HuggingFaceTokenizer`: megatron-core's AutoTokenizer wrapper over `tokenizer_model`, a
      local folder (or a name already in the HuggingFace cache); needs `pip install .[hf]`.
    - `NullTokenizer`: ids written as decimal text, `vocab_size` ids plus `eod = vocab_size`.
    Missing or bad inputs raise DataError naming the flag.
    """
    _check_tokenizer_inputs(tokenizer_type, {
        "--tokenizer-model": tokenizer_model, "--vocab-size": vocab_size,
        "--vocab-file": vocab_file, "--merge-file": merge_file})
    if tokenizer_type == "NullTokenizer":
        null = {"library": "null"}
        return MegatronTokenizer.from_pretrained(metadata_path=null, vocab_size=vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        config = {"library": "gpt2-bpe", "model_type": "gpt"}
        return VocabFileTokenizer(vocab_file, config, vocab_file=vocab_file, merges_file=merge_file)
    if tokenizer_type.startswith("BertWordPiece"):
        config = {"library": "wordpiece", "model_type": "bert"}
        lower_case = tokenizer_type == "BertWordPieceLowerCase"
        return VocabFileTokenizer(vocab_file, config, vocab_file=vocab_file,
                                  lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "HuggingFaceTokenizer":
        return build_huggingface_tokenizer(tokenizer_model)
    check_sentencepiece_model(tokenizer_model)
    config = {"library": "sentencepiece"}
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTextTokenizer(
            tokenizer_model,
            {**config, "model_type": "bert"},
            legacy=True,
            special_tokens=dict(BERT_SPECIAL_TOKENS),
        )
    return SentencePieceTextTokenizer(tokenizer_model, {**config, "model_type": "gpt"})


def _check_tokenizer_inputs(tokenizer_type: str, flags: dict) -> None:
    """Raise DataError naming the flag unless ``tokenizer_type`` is supported and every input
    it needs is given (``flags``: flag -> value), its files existing."""
    if tokenizer_type not in TOKENIZER_TYPES:
        known = ", ".join(TOKENIZER_TYPES)
        raise DataError("--tokenizer-type", f"{tokenizer_type!r} is not supported; use one of {known}")
    missing = missing_tokenizer_input(tokenizer_type, flags)
    if missing:
        raise DataError(missing, f"required with --tokenizer-type {tokenizer_type}")
    for flag in FILE_FLAGS:
        if flag in TOKENIZER_INPUTS[tokenizer_type]:
            check_file(flag, flags[flag])


def check_file(flag: str, path: str) -> None:
    """Raise DataError naming `flag` unless `path` is an existing file."""
    if not os.path.exists(path):
        raise DataError(flag, f"{path} does not exist")
    if not os.path.isfile(path):
        raise DataError(flag, f"{path} is a folder, expected a file")


def build_huggingface_tokenizer(name_or_folder: str) -> MegatronTokenizerBase:
    """megatron-core's HuggingFace library with Megatron-LM's defaults (slow tokenizer, no
    special tokens added to the ids); DataError naming --tokenizer-model if it cannot load."""
    if os.path.isfile(name_or_folder):
        raise DataError("--tokenizer-model", f"{name_or_folder} is a file; HuggingFaceTokenizer "
                        "takes a tokenizer folder (or a name in the HuggingFace cache)")
    if os.path.isdir(name_or_folder) and not any(
            os.path.isfile(os.path.join(name_or_folder, name)) for name in HF_TOKENIZER_FILES):
        raise DataError("--tokenizer-model", f"{name_or_folder} holds no tokenizer files "
                        f"({', '.join(HF_TOKENIZER_FILES)})")
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise DataError("--tokenizer-type", "HuggingFaceTokenizer needs the transformers "
                        "package: pip install -e .[hf]") from err
    huggingface = {"library": "huggingface", "model_type": "default"}
    try:
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=name_or_folder, metadata_path=huggingface,
            additional_special_tokens=[], use_fast=False, trust_remote_code=False,
            include_special_tokens=False)
    except (ValueError, OSError) as err:
        detail = " ".join(str(err).split())[:300]
        raise DataError("--tokenizer-model", f"{name_or_folder} is not a HuggingFace tokenizer "
                        f"({detail})") from err


def check_sentencepiece_model(tokenizer_model: str | None) -> None:
    """Raise DataError naming `--tokenizer-model` unless sentencepiece can load the file."""
    if not tokenizer_model:
        raise DataError("--tokenizer-model", "a sentencepiece model file is required")
    if not os.path.isfile(tokenizer_model):
        raise DataError("--tokenizer-model", f"{tokenizer_model} does not exist")
    try:
        sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
    except (OSError, RuntimeError) as err:
        detail = f"{tokenizer_model} is not a sentencepiece model ({err})"
        raise DataError("--tokenizer-model", detail) from err


def padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Megatron-LM's embedding size: `vocab_size` rounded up to a multiple of
    `make_vocab_size_divisible_by * tensor_model_parallel_size` (so each tensor-parallel shard
    of the embedding has the same, aligned number of rows)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple
