"""Train a sentencepiece tokenizer on JSONL documents.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix data/tok --vocab-size 4096

writes `data/tok.model` and `data/tok.vocab`; use `--tokenizer-type GPTSentencePieceTokenizer`
(GPT) or `SentencePieceTokenizer` (BERT) with `--tokenizer-model data/tok.model`.

Bad input (a missing or unparsable file, a bad flag, a vocabulary the text cannot fill) ends the
tool with one `error:` line and exit code 2; flags and files are checked before megatron-core
is imported.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.cli import (ToolError, ToolParser, existing_file, main_guard,  # noqa: E402
                              nonneg_int, output_prefix, positive_int)


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=existing_file, required=True,
                        help="JSONL file, one JSON object per line")
    parser.add_argument("--model-prefix", type=output_prefix, required=True,
                        help="writes {prefix}.model, .vocab")
    parser.add_argument("--vocab-size", type=positive_int, required=True)
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    parser.add_argument("--input-sentence-size", type=positive_int, default=300_000,
                        help="lines sampled")
    parser.add_argument("--seed", type=nonneg_int, default=1234)
    parser.add_argument("--num-threads", type=positive_int, default=2)
    return parser.parse_args(argv)


def _train(args: argparse.Namespace) -> str:
    """The trained model's path; sentencepiece's own refusals (RuntimeError: a vocabulary
    larger than the text allows, unusable text) become a ToolError naming the flag."""
    from megatron_2bw.data.tokenizer import train_sentencepiece

    try:
        return train_sentencepiece(
            args.input,
            args.model_prefix,
            args.vocab_size,
            json_key=args.json_key,
            model_type=args.model_type,
            input_sentence_size=args.input_sentence_size,
            seed=args.seed,
            num_threads=args.num_threads,
        )
    except RuntimeError as err:
        message = " ".join(str(err).split())
        flag = "--vocab-size" if "vocabulary size" in message.lower() else "--input"
        raise ToolError(flag, f"sentencepiece refused {args.input}: {message}") from None


@main_guard
def main(argv=None) -> None:
    """Train on --input and write {--model-prefix}.model and .vocab."""
    args = parse_args(argv)
    start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    model = _train(args)
    print(f"{model} ({args.vocab_size} pieces) in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
