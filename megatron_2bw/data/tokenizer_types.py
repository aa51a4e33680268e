"""Megatron-LM's `--tokenizer-type` names that we build, and the flags each one reads.

No megatron-core import here: flag parsing (megatron_2bw/arguments/, tools/) checks these
before megatron-core is loaded.
"""

import argparse

# Megatron-LM's build_tokenizer (megatron/training/tokenizer/tokenizer.py and megatron-core's
# tokenizers/text/utils/build_tokenizer.py at core_v0.16.1): which input flags each type reads.
TOKENIZER_INPUTS = {
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    "BertWordPieceLowerCase": ("--vocab-file",),
    "BertWordPieceCase": ("--vocab-file",),
    "GPTSentencePieceTokenizer": ("--tokenizer-model",),
    "SentencePieceTokenizer": ("--tokenizer-model",),
    "Llama2Tokenizer": ("--tokenizer-model",),
    "HuggingFaceTokenizer": ("--tokenizer-model",),
    "NullTokenizer": ("--vocab-size",),
}
TOKENIZER_TYPES = tuple(TOKENIZER_INPUTS)
# Flags whose value must be an existing file (HuggingFace's --tokenizer-model is a folder or
# a name, checked when the tokenizer is built).
FILE_FLAGS = ("--vocab-file", "--merge-file")


def tokenizer_type(text: str) -> str:
    """argparse type for --tokenizer-type: one of TOKENIZER_TYPES, else one line listing them."""
    if text not in TOKENIZER_INPUTS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not supported; use one of {', '.join(TOKENIZER_TYPES)}")
    return text


def missing_tokenizer_input(tokenizer_type_name: str, values: dict[str, object]) -> str | None:
    """The first flag `tokenizer_type_name` needs that `values` ({flag: value}) lacks, or None."""
    for flag in TOKENIZER_INPUTS[tokenizer_type_name]:
        if values.get(flag) is None:
            return flag
    return None
