"""Build, offline, the tokenizer files and indexed datasets the shrunk Megatron-LM examples in
scripts/examples/ read, into one directory:

    python scripts/examples/prepare_data.py [DIR]        # DIR defaults to data/cache/examples

GPT-2 BPE files and GPT2BPETokenizer data (train_gpt3_*.sh), a lower-case WordPiece vocabulary
and sentence-level data (train_bert_*.sh), a local HuggingFace tokenizer folder and its data
(train_llama3_*.sh); the tokenizers trained on the standard-library corpus by the `tokenizers`
package, the datasets written by megatron_2bw.data.preprocess.

Invariant: a directory that already holds everything (its `manifest.json`, written last) is
kept; every example's defaults point at data/cache/examples.

The files one by one: docs/data.md, "The Megatron-LM examples' data".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_2bw.data.corpus import DEFAULT_MAX_FILE_BYTES, iter_documents, stdlib_root  # noqa: E402
from megatron_2bw.data.preprocess import preprocess_jsonl  # noqa: E402

CORPUS_CHARS = 150_000
DOCUMENT_CHARS = 80
"""Lines are joined into documents of at least this many characters: ~940 documents, so
the examples' --split 949,50,1 gives the test split one (it needs more than 500)."""
VOCAB_SIZE = 512
ENDOFTEXT = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MANIFEST = {"corpus_chars": CORPUS_CHARS, "vocab_size": VOCAB_SIZE, "version": 1,
            "python": sys.version.split()[0]}  # the corpus is this Python's stdlib


def write_corpus(path: Path) -> int:
    """CORPUS_CHARS of standard-library source as JSONL, one document per run of lines of at
    least DOCUMENT_CHARS characters; returns the document count."""
    count, lines = 0, []
    with open(path, "w", encoding="utf-8") as out:
        for text in iter_documents(stdlib_root(), CORPUS_CHARS, DEFAULT_MAX_FILE_BYTES):
            for line in text.splitlines(keepends=True):
                lines.append(line)
                if sum(map(len, lines)) >= DOCUMENT_CHARS:
                    out.write(json.dumps({"text": "".join(lines)}) + "\n")
                    count, lines = count + 1, []
    return count


def documents(corpus: Path):
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train_gpt2_bpe(corpus: Path, out: Path) -> tuple[str, str]:
    """A byte-level BPE of VOCAB_SIZE ids with <|endoftext|>, written as GPT-2's vocab.json and
    merges.txt (out/gpt2-vocab.json, out/gpt2-merges.txt)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(documents(corpus), vocab_size=VOCAB_SIZE, min_frequency=2,
                            special_tokens=[ENDOFTEXT], show_progress=False)
    vocab, merges = bpe.save_model(str(out), "gpt2")  # gpt2-vocab.json, gpt2-merges.txt
    return vocab, merges


def train_bert_wordpiece(corpus: Path, out: Path) -> str:
    """A lower-case WordPiece vocabulary of VOCAB_SIZE pieces with BERT's special tokens
    (out/bert-vocab.txt, one piece a line)."""
    from tokenizers import BertWordPieceTokenizer

    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(documents(corpus), vocab_size=VOCAB_SIZE,
                                  special_tokens=BERT_SPECIALS, show_progress=False)
    (vocab,) = wordpiece.save_model(str(out), "bert")  # bert-vocab.txt
    return vocab


def huggingface_folder(vocab: str, merges: str, folder: Path) -> str:
    """A local AutoTokenizer folder over the byte-level BPE (GPT2Tokenizer, eos <|endoftext|>)
    standing in for Llama-3's tokenizer (a byte-level BPE of the same kind)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_bytes(Path(vocab).read_bytes())
    (folder / "merges.txt").write_bytes(Path(merges).read_bytes())
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": ENDOFTEXT,
              "bos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def prepare(out: Path) -> Path:
    """Build everything into ``out`` unless its manifest says it is there; return ``out``."""
    manifest = out / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()) == MANIFEST:
        return out
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.jsonl"
    write_corpus(corpus)
    vocab, merges = train_gpt2_bpe(corpus, out)
    preprocess_jsonl(str(corpus), str(out / "gpt3" / "my-gpt3"), "GPT2BPETokenizer",
                     vocab_file=vocab, merge_file=merges, append_eod=True)
    bert_vocab = train_bert_wordpiece(corpus, out)
    preprocess_jsonl(str(corpus), str(out / "bert" / "my-bert"), "BertWordPieceLowerCase",
                     vocab_file=bert_vocab, split_sentences=True)
    folder = huggingface_folder(vocab, merges, out / "llama3-tokenizer")
    preprocess_jsonl(str(corpus), str(out / "llama3" / "my-llama3"), "HuggingFaceTokenizer",
                     folder, append_eod=True)
    manifest.write_text(json.dumps(MANIFEST))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    out = prepare(Path(argv[0] if argv else REPO / "data" / "cache" / "examples"))
    print(f"example data in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
