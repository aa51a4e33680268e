"""Tokenizer libraries read from `--vocab-file` (and `--merge-file`), offline.

megatron-core 0.16.1 builds `GPT2BPETokenizer` and `BertWordPiece*` through HuggingFace's
`AutoTokenizer.from_pretrained`, which needs the hub. `GPT2BPE` (byte-level BPE) and
`WordPiece` implement megatron-core's `MegatronTokenizerTextAbstract` from the files alone,
with the algorithms of Megatron-LM's `gpt2_tokenization.py` and `bert_tokenization.py`, and are
wrapped by megatron-core's `MegatronTokenizerText` (megatron_2bw/data/tokenizer.py).

Invariants: GPT-2 decoding is exact (`ids_to_text(text_to_ids(t)) == t`); the WordPiece
vocabulary is Megatron-LM's `_BertWordPieceTokenizer`'s (the file's tokens, then `[BOS]`,
`[EOS]` and the extra ids, each unless the file holds it); bad files raise DataError naming
the flag, with one line.

The algorithms: docs/data.md, "Tokenizers".
"""

import functools
import json
import unicodedata

import regex

from megatron.core.tokenizers.text.libraries.abstract_tokenizer import (
    MegatronTokenizerTextAbstract)
from megatron_2bw.data.errors import DataError

ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenizer (openai/gpt-2 src/encoder.py; Megatron-LM gpt2_tokenization.py).
GPT2_SPLIT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Megatron-LM appends these to a BERT vocabulary file's tokens (_BertWordPieceTokenizer,
# core_v0.16.1)
BERT_ADDED = ("[BOS]", "[EOS]")
MAX_WORD_CHARS = 200  # BERT: longer words become [UNK]


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes map to themselves, the other 68
    to chr(256), chr(257), ... in byte order, so no byte maps to whitespace or a control."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


class _VocabLibrary(MegatronTokenizerTextAbstract):
    """Shared part: a token -> id vocabulary, its inverse (built once), and named special ids
    (`specials[name]` is None where the vocabulary has no such token)."""

    def __init__(self, vocab: dict[str, int], specials: dict[str, int | None]) -> None:
        self._vocab = vocab
        self._inv_vocab = {i: token for token, i in vocab.items()}
        self.specials = specials

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [self._vocab[token] for token in tokens]

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._inv_vocab[i] for i in ids]

    def text_to_ids(self, text: str) -> list[int]:
        return self.tokens_to_ids(self.text_to_tokens(text))

    def ids_to_text(self, ids: list[int]) -> str:
        return self.tokens_to_text(self.ids_to_tokens(ids))

    def add_special_tokens(self, special_tokens) -> None:
        raise NotImplementedError("the vocabulary is fixed by --vocab-file (and --vocab-extra-ids)")

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return []

    cls_id = property(lambda self: self.specials.get("cls"))
    sep_id = property(lambda self: self.specials.get("sep"))
    pad_id = property(lambda self: self.specials.get("pad"))
    mask_id = property(lambda self: self.specials.get("mask"))
    unk_id = property(lambda self: self.specials.get("unk"))
    bos_id = property(lambda self: self.specials.get("bos"))
    eos_id = property(lambda self: self.specials.get("eos"))
    eod = property(lambda self: self.specials.get("eos"))


class GPT2BPE(_VocabLibrary):
    """GPT-2 byte-level BPE from `vocab.json` and `merges.txt`."""

    def __init__(self, vocab_file: str, merges_file: str) -> None:
        vocab = read_gpt2_vocab(vocab_file)
        self.ranks = read_gpt2_merges(merges_file, vocab)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        eod = vocab[ENDOFTEXT]
        super().__init__(vocab, {"eos": eod, "bos": eod, "unk": eod})
        self._cache: dict[str, tuple[str, ...]] = {}

    def bpe(self, word: str) -> tuple[str, ...]:
        """Merge adjacent symbols of `word`, always the pair of lowest rank first (all its
        non-overlapping occurrences, left to right), until no pair has a rank."""
        if word in self._cache:
            return self._cache[word]
        parts = tuple(word)
        while len(parts) > 1:
            best = min(zip(parts, parts[1:]), key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = tuple(merged)
        self._cache[word] = parts
        return parts

    def text_to_tokens(self, text: str) -> list[str]:
        tokens = []
        for piece in GPT2_SPLIT.findall(text):
            tokens.extend(self.bpe("".join(self.byte_encoder[b] for b in piece.encode("utf-8"))))
        return tokens

    def tokens_to_text(self, tokens: list[str]) -> str:
        data = bytearray(self.byte_decoder[char] for char in "".join(tokens))
        return data.decode("utf-8", errors="replace")


def read_gpt2_vocab(vocab_file: str) -> dict[str, int]:
    """vocab.json: a JSON object {token: id} with unique ids, every byte symbol and
    `<|endoftext|>`; DataError naming --vocab-file otherwise."""
    def bad(why: str) -> DataError:
        return DataError("--vocab-file", f"{vocab_file} is not a GPT-2 vocab.json ({why})")

    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise bad(f"not JSON: {str(err).splitlines()[0]}") from err
    if not isinstance(vocab, dict) or not all(
            isinstance(t, str) and type(i) is int and i >= 0 for t, i in vocab.items()):
        raise bad("expected a JSON object of token -> non-negative integer id")
    if len(set(vocab.values())) != len(vocab):
        raise bad("two tokens share an id")
    if ENDOFTEXT not in vocab:
        raise bad(f"no {ENDOFTEXT} token")
    missing = [c for c in bytes_to_unicode().values() if c not in vocab]
    if missing:
        raise bad(f"{len(missing)} of the 256 byte-level symbols are missing, e.g. {missing[0]!r}")
    return vocab


def read_gpt2_merges(merges_file: str, vocab: dict[str, int]) -> dict[tuple[str, str], int]:
    """merges.txt: an optional `#version` line, then one merge `a b` per line, rank = order;
    each merge's result must be in the vocabulary. DataError naming --merge-file otherwise."""
    ranks = {}
    try:
        with open(merges_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as err:
        raise DataError("--merge-file", f"{merges_file} is not UTF-8 text ({err.reason})") from err
    for lineno, line in enumerate(lines, start=1):
        if not line.strip() or (lineno == 1 and line.startswith("#version")):
            continue
        pair = tuple(line.split(" "))
        if len(pair) != 2 or not all(pair):
            raise DataError("--merge-file", f"{merges_file}:{lineno} is not a BPE merge "
                            f"(two symbols separated by one space): {line[:60]!r}")
        if pair[0] + pair[1] not in vocab:
            raise DataError("--merge-file", f"{merges_file}:{lineno}: the merge result "
                            f"{pair[0] + pair[1]!r} is not in --vocab-file")
        ranks.setdefault(pair, len(ranks))
    if not ranks:
        raise DataError("--merge-file", f"{merges_file} holds no merges")
    return ranks


class WordPiece(_VocabLibrary):
    """BERT's WordPiece from a `vocab.txt` (one token per line), with Megatron-LM's ids: the
    file's tokens, then [BOS], [EOS] and the extra ids (see the module docstring)."""

    def __init__(self, vocab_file: str, lower_case: bool, vocab_extra_ids: int = 0) -> None:
        vocab = read_wordpiece_vocab(vocab_file)
        extra = [f"<extra_id_{n}>" for n in range(vocab_extra_ids)]
        for token in (*BERT_ADDED, *extra):
            vocab.setdefault(token, len(vocab))
        self.lower_case = lower_case
        self.extra_ids = [vocab[token] for token in extra]
        names = ("pad", "unk", "cls", "sep", "mask", "bos", "eos")
        specials = {name: vocab[token] for name, token in zip(names, BERT_SPECIALS + BERT_ADDED)}
        super().__init__(vocab, specials)

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return list(self.extra_ids)

    def text_to_tokens(self, text: str) -> list[str]:
        return [piece for word in basic_tokenize(text, self.lower_case)
                for piece in self.word_pieces(word)]

    def word_pieces(self, word: str) -> list[str]:
        """Greedy longest match from the left; `##` marks a piece inside a word; a word with
        no full cover (or over MAX_WORD_CHARS) is one [UNK]."""
        if len(word) > MAX_WORD_CHARS:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self._vocab:
                    break
            else:
                return ["[UNK]"]
            pieces.append(piece)
            start = end
        return pieces

    def tokens_to_text(self, tokens: list[str]) -> str:
        """BERT's convert_tokens_to_string with its clean-up of spaces before punctuation."""
        text = " ".join(tokens).replace(" ##", "").strip()
        for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                              (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                              (" 're", "'re")):
            text = text.replace(before, after)
        return text


def read_wordpiece_vocab(vocab_file: str) -> dict[str, int]:
    """vocab.txt: one token per line (stripped, id = line number - 1), each once, holding BERT's
    special tokens; DataError naming --vocab-file otherwise (a repeated token would make
    Megatron-LM's ids collide: its reader keeps the last line's id and counts the token once)."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            tokens = [line.strip() for line in f.read().split("\n")]
    except UnicodeDecodeError as err:
        raise DataError("--vocab-file", f"{vocab_file} is not UTF-8 text ({err.reason})") from err
    if tokens and tokens[-1] == "":
        tokens.pop()  # the final newline
    if tokens[:1] == ["{"]:
        raise DataError("--vocab-file",
                        f"{vocab_file} is not a BERT vocab.txt (it looks like JSON)")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in vocab:
            raise DataError("--vocab-file", f"{vocab_file}:{index + 1} repeats {token!r} of line "
                                            f"{vocab[token] + 1}: each token must be on one line")
        vocab[token] = index
    missing = [token for token in BERT_SPECIALS if token not in vocab]
    if missing:
        raise DataError("--vocab-file", f"{vocab_file} is not a BERT vocab.txt "
                                        f"(no {', '.join(missing)})")
    return vocab


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
    """BERT's BasicTokenizer: drop NUL/U+FFFD/controls, whitespace -> space, spaces around CJK
    ideographs, split on whitespace, lower-case and strip accents (NFD, drop Mn) if asked,
    and make every punctuation character a word of its own."""
    chars = []
    for char in text:
        if char in ("\0", "\ufffd") or _is_control(char):
            continue
        chars.append(f" {char} " if _is_cjk(ord(char)) else " " if _is_space(char) else char)
    words = []
    for word in "".join(chars).split():
        if lower_case:
            word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                           if unicodedata.category(c) != "Mn")
        words.extend(regex.findall(r"\p{P}|[!-/:-@\[-`{-~]|[^\p{P}!-/:-@\[-`{-~]+", word))
    return words


def _is_space(char: str) -> bool:
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    return char not in "\t\n\r" and unicodedata.category(char) in ("Cc", "Cf")


def _is_cjk(cp: int) -> bool:
    return any(low <= cp <= high for low, high in (
        (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))
