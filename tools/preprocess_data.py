"""Tokenize JSONL documents into a Megatron indexed dataset (Megatron-LM's flag names).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod

writes `data/my_text_document.bin/.idx` (`_sentence` with --split-sentences); pass
`--data-path data/my_text_document` to training.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.data import DataError  # noqa: E402
from megatron_2bw.data.indexed import check_indexed_dataset  # noqa: E402
from megatron_2bw.data.preprocess import preprocess_jsonl  # noqa: E402
from megatron_2bw.data.tokenizer import TOKENIZER_TYPES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    group.add_argument(
        "--split-sentences", action="store_true", help="one sequence per sentence or line"
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None, help="sentencepiece .model file")
    group.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    group.add_argument("--append-eod", action="store_true", help="end each document with eod")
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", required=True, help="writes {prefix}_{key}_{document|sentence}.bin/.idx"
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.time()
    try:
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
    except DataError as err:
        sys.exit(f"error: {err}")
    for key, prefix in prefixes.items():
        summary = check_indexed_dataset(prefix, "--output-prefix")
        print(
            f"{key}: {prefix}.bin/.idx  {summary.num_documents} documents, {summary.num_sequences} "
            f"sequences, {summary.num_tokens} tokens ({summary.dtype.__name__})"
        )
    print(f"done in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
