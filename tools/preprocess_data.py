"""Tokenize JSONL documents into a Megatron indexed dataset (Megatron-LM's flag names).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod

writes `data/my_text_document.bin/.idx` (`_sentence` with --split-sentences); pass
`--data-path data/my_text_document` to training.

Bad input (a missing or unparsable file, a bad flag) ends the tool with one `error:` line and
exit code 2; flags and files are checked before megatron-core is imported.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.cli import (ToolError, ToolParser, existing_file, main_guard,  # noqa: E402
                              output_prefix, positive_int, reading)


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=existing_file, required=True,
                       help="JSONL file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    group.add_argument(
        "--split-sentences", action="store_true", help="one sequence per sentence or line"
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, metavar="TYPE",
                       help="GPTSentencePieceTokenizer, SentencePieceTokenizer or NullTokenizer "
                            "(checked by megatron_2bw.data.tokenizer.build_tokenizer)")
    group.add_argument("--tokenizer-model", type=existing_file, default=None,
                       help="sentencepiece .model file")
    group.add_argument("--vocab-size", type=positive_int, default=None, help="for NullTokenizer")
    group.add_argument("--append-eod", action="store_true", help="end each document with eod")
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", type=output_prefix, required=True,
        help="writes {prefix}_{key}_{document|sentence}.bin/.idx"
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=positive_int, default=1, help="tokenizer processes")
    return parser.parse_args(argv)


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
