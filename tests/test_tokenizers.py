"""Megatron-LM's --tokenizer-type names from small tokenizer files written here, offline.

References are computed by hand in the comments (merges applied step by step, ids looked up in
the vocabularies written below), never by the code under test.
"""

from __future__ import annotations

import json
import re

import numpy
import pytest

from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer import build_tokenizer
from tests import dist as launch

ENDOFTEXT = "<|endoftext|>"
# Ranks 0..7; each merge's result gets id 256 + rank, <|endoftext|> gets 264.
MERGES = ["l l", "h e", "he ll", "\u0120 w", "o r", "\u0120w or", "hell o", "e l"]
EOD_ID = 264
# "hello world" -> GPT-2 pieces "hello", " world" -> byte symbols "hello", "Ġworld".
#   hello: h e l l o -> (l l, rank 0) h e ll o -> (h e, 1) he ll o -> (he ll, 2) hell o
#          -> (hell o, 6) hello = 262
#   Ġworld: Ġ w o r l d -> (Ġ w, 3) Ġw o r l d -> (o r, 4) Ġw or l d -> (Ġw or, 5) Ġwor l d
#          = 261, 'l' = 108, 'd' = 100 (byte ids = byte values)
HELLO_WORLD_IDS = [262, 261, 108, 100]
# "hell": h e l l -> (l l, 0) h e ll -> (h e, 1) he ll -> (he ll, 2) hell = 258; taking
# (e l, 7) first would end at h el l.
HELL_IDS = [258]
# "lll": both (l l) pairs have rank 0; merged left to right, without overlap: ll l.
LLL_IDS = [256, 108]
# "é" is UTF-8 C3 A9 -> two byte symbols, ids 0xC3 and 0xA9.
E_ACUTE_IDS = [0xC3, 0xA9]

BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "##s", "sat", ",",
              "un", "##aff", "##able", "!", "cafe", "."]
# "The cats sat, unaffable! Café." lower-cased, accents stripped, punctuation split:
#   the | cat ##s | sat | , | un ##aff ##able | ! | cafe | .
BERT_LOWER_IDS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
# Cased: "The" and "Café" have no pieces in the vocabulary -> [UNK] (1).
BERT_CASED_IDS = [1, 6, 7, 8, 9, 10, 11, 12, 13, 1, 15]
# Megatron-LM core_v0.16.1, megatron/training/tokenizer/tokenizer.py: _BertWordPieceTokenizer
# loads the file (bert_tokenization.load_vocab: id = line number - 1, vocab_size = len(vocab)),
# then add_token("[BOS]"), add_token("[EOS]") give each the next id, len(vocab), and after them
# add_additional_special_tokens appends <extra_id_0>, <extra_id_1>, ...; eod is eos.
BERT_BOS_ID, BERT_EOS_ID = 16, 17
BERT_VOCAB_SIZE = 18  # 16 lines + [BOS] + [EOS]
BERT_EXTRA_IDS = [18, 19]  # --vocab-extra-ids 2: vocab_size 20
# "[BOS] the cat [EOS]": the basic tokenizer splits the brackets off (punctuation), so the text
# "[BOS]" is "[" "bos" "]", none of them (but "the", "cat") in the vocabulary.
BRACKETED_IDS = [1, 1, 1, 5, 6, 1, 1, 1]
# build_tokenizer: padded_vocab_size = _vocab_size_with_padding(vocab_size), the vocabulary
# rounded up to a multiple of --make-vocab-size-divisible-by x TP:
# (divisible-by, TP, extra ids) -> padded size
BERT_PADDED = {(128, 1, 0): 128, (128, 2, 0): 256, (8, 2, 0): 32, (8, 1, 2): 24, (4, 1, 0): 20}


def gpt2_byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> symbol table (openai/gpt-2 encoder.py, bytes_to_unicode), written out:
    printable Latin-1 bytes are themselves, the other 68 become chr(256 + n) in byte order."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    table, n = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + n)
            n += 1
    assert table[ord(" ")] == "\u0120" and len(set(table.values())) == 256
    return table


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    vocab = {symbol: byte for byte, symbol in gpt2_byte_symbols().items()}
    for rank, merge in enumerate(MERGES):
        vocab[merge.replace(" ", "")] = 256 + rank
    vocab[ENDOFTEXT] = EOD_ID
    (root / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (root / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n",
                                     encoding="utf-8")
    return root


def gpt2(files):
    return build_tokenizer("GPT2BPETokenizer", vocab_file=str(files / "vocab.json"),
                           merge_file=str(files / "merges.txt"))


def test_gpt2_bpe_ids_round_trip_and_eod(gpt2_files):
    tokenizer = gpt2(gpt2_files)
    assert tokenizer.tokenize("hello world") == HELLO_WORLD_IDS
    assert tokenizer.tokenize("hell") == HELL_IDS
    assert tokenizer.tokenize("lll") == LLL_IDS
    assert tokenizer.tokenize("é") == E_ACUTE_IDS
    assert tokenizer.eod == EOD_ID and tokenizer.vocab_size == 265
    for text in ("hello world", "héllo wörld!\n\tdef f(x):  return x  \n", "日本 ☃ 'll 123"):
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_bert_wordpiece_ids_specials_and_extra_ids(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(BERT_VOCAB) + "\n", encoding="utf-8")
    text = "The cats sat, unaffable! Café."
    lower = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(vocab))
    assert lower.tokenize(text) == BERT_LOWER_IDS
    assert lower.tokenize("[BOS] the cat [EOS]") == BRACKETED_IDS
    assert (lower.cls, lower.sep, lower.mask, lower.pad) == (2, 3, 4, 0)
    assert (lower.bos, lower.eos, lower.eod) == (BERT_BOS_ID, BERT_EOS_ID, BERT_EOS_ID)
    assert lower.detokenize(BERT_LOWER_IDS) == "the cats sat, unaffable! cafe."
    assert lower.vocab_size == len(lower.inv_vocab) == BERT_VOCAB_SIZE
    assert (lower.inv_vocab[7], lower.inv_vocab[BERT_BOS_ID], lower.inv_vocab[BERT_EOS_ID]) == \
        ("##s", "[BOS]", "[EOS]")
    cased = build_tokenizer("BertWordPieceCase", vocab_file=str(vocab), vocab_extra_ids=2)
    assert cased.tokenize(text) == BERT_CASED_IDS
    assert cased.vocab_size == BERT_VOCAB_SIZE + 2
    assert cased.additional_special_tokens_ids == BERT_EXTRA_IDS
    assert (cased.bos, cased.eos) == (BERT_BOS_ID, BERT_EOS_ID)


@pytest.mark.parametrize("divisible_by, tp, extra_ids", sorted(BERT_PADDED))
def test_bert_padded_vocab_size_is_megatron_lms(tmp_path, divisible_by, tp, extra_ids):
    """The embedding's rows the training scripts compute from the flags (entry.padded_vocab)."""
    from megatron_2bw import entry
    from megatron_2bw.arguments import parse_args

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(BERT_VOCAB) + "\n", encoding="utf-8")
    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--seq-length", "16", "--max-position-embeddings", "16", "--lr", "1e-3",
                       "--train-iters", "2", "--micro-batch-size", "1", "--data-path", "x",
                       "--tokenizer-type", "BertWordPieceCase", "--vocab-file", str(vocab),
                       "--vocab-extra-ids", str(extra_ids), "--tensor-model-parallel-size",
                       str(tp), "--make-vocab-size-divisible-by", str(divisible_by)],
                      world_size=tp)
    tokenizer = build_tokenizer("BertWordPieceCase", vocab_file=str(vocab),
                                vocab_extra_ids=extra_ids)
    assert entry.padded_vocab(args, tokenizer) == BERT_PADDED[divisible_by, tp, extra_ids]


def test_bert_vocabulary_that_holds_bos_keeps_its_id_and_a_repeated_token_is_refused(tmp_path):
    """add_token adds only what the file lacks: [BOS] keeps the file's id, [EOS] comes next."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join([*BERT_VOCAB, "[BOS]"]) + "\n", encoding="utf-8")
    tokenizer = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(vocab))
    assert (tokenizer.bos, tokenizer.eos, tokenizer.vocab_size) == (16, 17, 18)
    vocab.write_text("\n".join([*BERT_VOCAB, "cat"]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"^--vocab-file: .*vocab.txt:17 repeats 'cat' of line 7"
                                        r": each token must be on one line$"):
        build_tokenizer("BertWordPieceLowerCase", vocab_file=str(vocab))


def test_huggingface_tokenizer_folder(gpt2_files, tmp_path):
    """A local HuggingFace folder (GPT-2 files + tokenizer_config.json) loads through
    megatron-core's HuggingFace library and gives the hand-computed ids."""
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (folder / name).write_bytes((gpt2_files / name).read_bytes())
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": ENDOFTEXT,
              "bos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", str(folder))
    assert tokenizer.tokenize("hello world") == HELLO_WORLD_IDS
    assert tokenizer.tokenize("hell") == HELL_IDS
    assert tokenizer.tokenize("lll") == LLL_IDS
    assert tokenizer.eod == EOD_ID
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"^--tokenizer-model: .*empty holds no tokenizer files"):
        build_tokenizer("HuggingFaceTokenizer", str(empty))


@pytest.mark.parametrize("vocab_text, merges_text, flag, detail", [
    ("not json", None, "--vocab-file", "is not a GPT-2 vocab.json"),
    ('["a"]', None, "--vocab-file", "token -> non-negative integer id"),
    ('{"a": 0}', None, "--vocab-file", "no <|endoftext|> token"),
    (None, "#version: 0.2\nl l\nbad-line\n", "--merge-file", r"merges.txt:3 is not a BPE merge"),
    (None, "x y\n", "--merge-file", "merge result 'xy' is not in --vocab-file"),
])
def test_bad_gpt2_files_raise_one_line(gpt2_files, tmp_path, vocab_text, merges_text, flag,
                                       detail):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(vocab_text or (gpt2_files / "vocab.json").read_text(encoding="utf-8"),
                     encoding="utf-8")
    merges.write_text(merges_text or "l l\n", encoding="utf-8")
    with pytest.raises(DataError, match=f"^{flag}: .*{detail}") as error:
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    assert "\n" not in str(error.value)


def test_missing_inputs_and_unsupported_types(tmp_path):
    with pytest.raises(DataError, match="^--merge-file: required with --tokenizer-type GPT2BPE"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"))
    with pytest.raises(DataError, match="^--vocab-file: .*v.json does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"),
                        merge_file=str(tmp_path / "m.txt"))
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(DataError, match=r"^--vocab-file: .*not a BERT vocab.txt"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "vocab.json"))
    with pytest.raises(DataError, match="^--tokenizer-type: 'TikTokenizer' is not supported; "
                                        "use one of GPT2BPETokenizer, "):
        build_tokenizer("TikTokenizer")


def test_training_flags_name_the_missing_file(gpt2_files, tmp_path):
    from megatron_2bw.arguments import FlagError, parse_args

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--lr", "1e-3",
            "--train-iters", "2", "--micro-batch-size", "4", "--data-path", "x",
            "--tokenizer-type", "GPT2BPETokenizer"]
    vocab = ["--vocab-file", str(gpt2_files / "vocab.json")]
    with pytest.raises(FlagError, match="^--merge-file: required with --tokenizer-type"):
        parse_args([*base, *vocab], world_size=1)
    with pytest.raises(FlagError, match="^--merge-file: no such file: .*nope.txt$"):
        parse_args([*base, *vocab, "--merge-file", str(tmp_path / "nope.txt")], world_size=1)
    with pytest.raises(FlagError, match="^--tokenizer-type: 'TikTokenizer' is not supported"):
        parse_args([*base[:-1], "TikTokenizer"], world_size=1)
    with pytest.raises(FlagError, match="^--vocab-extra-ids: only used with BertWordPiece"):
        parse_args([*base, *vocab, "--merge-file", str(gpt2_files / "merges.txt"),
                    "--vocab-extra-ids", "2"], world_size=1)


@pytest.fixture(scope="module")
def gpt2_dataset(gpt2_files, tmp_path_factory):
    """tools/preprocess_data.py with Megatron-LM's flags over 200 documents "hello world"."""
    root = tmp_path_factory.mktemp("gpt2_data")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": "hello world"}) + "\n" for _ in range(200)))
    result = launch.python([
        "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(root / "hw"),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(gpt2_files / "vocab.json"),
        "--merge-file", str(gpt2_files / "merges.txt"), "--append-eod", "--workers", "2",
        "--partitions", "2", "--keep-sequential-samples", "--log-interval", "50",
        "--json-keys", "text", "--lang", "english", "--keep-newlines"], timeout=120)
    assert result.returncode == 0, result.tail()
    assert "processed 200 documents" in result.output, result.tail()
    return str(root / "hw_text_document")


def test_preprocess_writes_reference_ids(gpt2_dataset):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(gpt2_dataset)
    assert len(dataset) == 200 and dataset.document_indices.tolist() == list(range(201))
    for i in (0, 199):
        assert dataset[i].tolist() == [*HELLO_WORLD_IDS, EOD_ID]
    assert dataset[0].dtype == numpy.uint16


def test_training_runs_with_gpt2_bpe(gpt2_files, gpt2_dataset, tmp_path):
    result = launch.python([
        "pretrain_gpt_2bw.py", "--cpu", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
        "--lr", "1e-3", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--train-iters", "2", "--eval-iters", "0",
        "--log-interval", "1", "--split", "1,0,0", "--data-path", gpt2_dataset,
        "--data-cache-path", str(tmp_path / "cache"),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(gpt2_files / "vocab.json"),
        "--merge-file", str(gpt2_files / "merges.txt")], timeout=180, WORLD_SIZE="1")
    assert result.returncode == 0, result.tail()
    assert re.search(r"iteration\s+2/\s+2 \|", result.output), result.tail()
