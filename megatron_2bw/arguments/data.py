"""Data and tokenizer flags; `_validate_data` fills the tokenizer type and checks that the
data and tokenizer files exist before any process group starts."""

from __future__ import annotations

import argparse
import os

from megatron_2bw.arguments.common import _COUNT, _NONNEG, _require
from megatron_2bw.data.tokenizer_types import (FILE_FLAGS, TOKENIZER_INPUTS, TOKENIZER_TYPES,
                                               missing_tokenizer_input, tokenizer_type)


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefix, or a blend 'weight prefix weight prefix ...'")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default=None, type=tokenizer_type, metavar="TYPE",
                   help=", ".join(TOKENIZER_TYPES) + "; default: Megatron-LM's per script "
                        "(GPT2BPETokenizer for GPT, BertWordPieceLowerCase for BERT), or the "
                        "SentencePiece type when only --tokenizer-model is given")
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model file, or a HuggingFace tokenizer folder")
    g.add_argument("--vocab-file", default=None,
                   help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)")
    g.add_argument("--merge-file", default=None, help="merges.txt (GPT2BPETokenizer)")
    g.add_argument("--vocab-extra-ids", type=_NONNEG, default=0,
                   help="BertWordPiece*: append <extra_id_0> ... <extra_id_{N-1}> to the vocab")
    g.add_argument("--vocab-size", type=_COUNT, default=None, help="for NullTokenizer")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=_NONNEG, default=2, help="data loader workers")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read the .bin files instead of memory-mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="no attention mask in the batches (the causal mask is implied)")
    g.add_argument("--mock-data", action="store_true",
                   help="random tokens instead of --data-path (smoke tests)")


# Megatron-LM's entry scripts' `args_defaults` (core_v0.16.1): pretrain_gpt.py and
# pretrain_bert.py default --tokenizer-type (their only args_defaults).
_MEGATRON_LM_TOKENIZER = {"gpt": "GPT2BPETokenizer", "bert": "BertWordPieceLowerCase"}
# Where only --tokenizer-model is given (which Megatron-LM's default type does not read).
_SENTENCEPIECE_TOKENIZER = {"gpt": "GPTSentencePieceTokenizer", "bert": "SentencePieceTokenizer"}


def _default_tokenizer_type(args: argparse.Namespace) -> None:
    """Fill --tokenizer-type when not given: Megatron-LM's default for the entry script (BERT's
    parser sets ``tokenizer_defaults_of="bert"``, taken off the namespace here), or with
    --tokenizer-model and no --vocab-file, the script's SentencePiece type (a command
    Megatron-LM refuses)."""
    model = vars(args).pop("tokenizer_defaults_of", "gpt")
    if args.tokenizer_type is not None:
        return
    only_model_file = args.tokenizer_model is not None and args.vocab_file is None
    args.tokenizer_type = (_SENTENCEPIECE_TOKENIZER if only_model_file
                           else _MEGATRON_LM_TOKENIZER)[model]


def _validate_data(args: argparse.Namespace) -> None:
    """Data and tokenizer files must exist before any process group starts."""
    _default_tokenizer_type(args)
    if args.mock_data:
        args.vocab_size = args.vocab_size or 1024
        return
    _require(args.data_path is not None, "--data-path",
             "required (an indexed dataset prefix from tools/preprocess_data.py), or --mock-data")
    inputs = {"--tokenizer-model": args.tokenizer_model, "--vocab-file": args.vocab_file,
              "--merge-file": args.merge_file, "--vocab-size": args.vocab_size}
    missing = missing_tokenizer_input(args.tokenizer_type, inputs)
    _require(missing is None, missing, f"required with --tokenizer-type {args.tokenizer_type}")
    _require(args.vocab_extra_ids == 0 or args.tokenizer_type.startswith("BertWordPiece"),
             "--vocab-extra-ids", "only used with BertWordPieceLowerCase / BertWordPieceCase")
    for flag in TOKENIZER_INPUTS[args.tokenizer_type]:
        must_be_file = flag in FILE_FLAGS or args.tokenizer_type != "HuggingFaceTokenizer"
        if flag != "--vocab-size" and must_be_file:
            _require(os.path.isfile(inputs[flag]), flag, f"no such file: {inputs[flag]}")
