"""Tokenize JSONL documents into a Megatron indexed dataset (Megatron-LM's flag names).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod

writes `data/my_text_document.bin/.idx` (`_sentence` with --split-sentences); pass
`--data-path data/my_text_document` to training. Every flag of Megatron-LM's
tools/preprocess_data.py (core_v0.16.1) is accepted.

Invariants: documents are always written in input order, so --partitions and
--keep-sequential-samples give the same bytes as one partition; sentence splitting keeps every
character; bad input ends the tool with one `error:` line and exit code 2, flags and files
checked before megatron-core is imported.
More (GPT-2 BPE files, sentences): docs/data.md, "Preprocessing".
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.cli import (ToolError, ToolParser, existing_file, main_guard,  # noqa: E402
                              output_prefix, positive_int, reading)
from megatron_2bw.data.tokenizer_types import (TOKENIZER_TYPES, missing_tokenizer_input,  # noqa: E402
                                               tokenizer_type)


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=existing_file, required=True,
                       help="JSONL file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    group.add_argument(
        "--split-sentences", action="store_true", help="one sequence per sentence or line"
    )
    group.add_argument("--keep-newlines", action="store_true",
                       help="accepted: sentence splitting always keeps newlines")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=tokenizer_type, required=True, metavar="TYPE",
                       help=", ".join(TOKENIZER_TYPES))
    group.add_argument("--vocab-file", type=existing_file, default=None,
                       help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)")
    group.add_argument("--merge-file", type=existing_file, default=None,
                       help="merges.txt (GPT2BPETokenizer)")
    group.add_argument("--tokenizer-model", default=None,
                       help="sentencepiece .model file, or a HuggingFace tokenizer folder")
    group.add_argument("--vocab-size", type=positive_int, default=None, help="for NullTokenizer")
    group = parser.add_argument_group("tokenization process")
    group.add_argument("--append-eod", action="store_true", help="end each document with eod")
    group.add_argument("--lang", default="english",
                       help="accepted (Megatron-LM's NLTK language); the splitter here is "
                            "rule-based and language-independent")
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", type=output_prefix, required=True,
        help="writes {prefix}_{key}_{document|sentence}.bin/.idx"
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=positive_int, default=1, help="tokenizer processes")
    group.add_argument("--partitions", type=positive_int, default=1,
                       help="accepted and equivalent: the input is read as one stream and "
                            "written in order, so the output bytes equal --partitions 1")
    group.add_argument("--log-interval", type=positive_int, default=1000,
                       help="print progress every N documents (to stderr)")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="accepted: documents are always written in input order")
    args = parser.parse_args(argv)
    missing = missing_tokenizer_input(args.tokenizer_type, {
        "--vocab-file": args.vocab_file, "--merge-file": args.merge_file,
        "--tokenizer-model": args.tokenizer_model, "--vocab-size": args.vocab_size})
    if missing:
        raise ToolError(missing, f"required with --tokenizer-type {args.tokenizer_type}")
    return args


@main_guard
def main(argv=None) -> None:
    """Tokenize --input into one dataset per --json-keys key and check what was written."""
    args = parse_args(argv)
    start = time.time()
    from megatron_2bw.data.indexed import check_indexed_dataset
    from megatron_2bw.data.preprocess import preprocess_jsonl

    with reading("--input", args.input):  # e.g. NullTokenizer text that is not integer ids
        prefixes = preprocess_jsonl(
            args.input,
            args.output_prefix,
            args.tokenizer_type,
            args.tokenizer_model,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            split_sentences=args.split_sentences,
            workers=args.workers,
            vocab_size=args.vocab_size,
            log_interval=args.log_interval,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
        )
    for key, prefix in prefixes.items():
        summary = check_indexed_dataset(prefix, "--output-prefix")
        if summary.num_documents == 0:
            for suffix in (".bin", ".idx"):
                os.remove(prefix + suffix)
            raise ToolError("--input", f"{args.input} has no text under --json-keys {key!r}")
        print(
            f"{key}: {prefix}.bin/.idx  {summary.num_documents} documents, {summary.num_sequences} "
            f"sequences, {summary.num_tokens} tokens ({summary.dtype.__name__})"
        )
    print(f"done in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
