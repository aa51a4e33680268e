"""Train a sentencepiece tokenizer on JSONL documents.

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix data/tok --vocab-size 4096

writes `data/tok.model` and `data/tok.vocab`; use `--tokenizer-type GPTSentencePieceTokenizer`
(GPT) or `SentencePieceTokenizer` (BERT) with `--tokenizer-model data/tok.model`.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.data import DataError  # noqa: E402
from megatron_2bw.data.tokenizer import train_sentencepiece  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    parser.add_argument("--model-prefix", required=True, help="writes {prefix}.model, .vocab")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    parser.add_argument("--input-sentence-size", type=int, default=300_000, help="lines sampled")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-threads", type=int, default=2)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    try:
        model = train_sentencepiece(
            args.input,
            args.model_prefix,
            args.vocab_size,
            json_key=args.json_key,
            model_type=args.model_type,
            input_sentence_size=args.input_sentence_size,
            seed=args.seed,
            num_threads=args.num_threads,
        )
    except DataError as err:
        sys.exit(f"error: {err}")
    print(f"{model} ({args.vocab_size} pieces) in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
