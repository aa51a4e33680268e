"""BERT pretraining: pretrain_bert_2bw.py end to end, and exactness against single-process
references.

Checks that flush and 2bw runs learn (the masked-LM loss falls from ~ln(512)), that every
schedule's weights and logged losses equal the single-process reference of its update rule
(synchronous or 2BW's 1-stale) and lie far from the other rule's, with the tied output layer
equal to the word embeddings; that a GPT tokenizer type fails in one line; and that a
checkpoint from before [BOS]/[EOS] joined the vocabulary loads with one warning (refused in
one line under the distributed optimizer).
The cases and tolerances: docs/testing.md, "What each test module checks", test_bert.py.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_2bw.logparse import parse_log
from tests import dist

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-6
DISTINCT = 1e-3
LOSS_TOLERANCE = 1e-5
ITERS = 5

TRAIN_ITERS = 30
VOCAB = 512


# ---- 1. learning, end to end --------------------------------------------------------------------

@dataclass(frozen=True)
class SentenceData:
    data_prefix: str
    tokenizer_model: str
    index_cache: str


@pytest.fixture(scope="module")
def sentence_data(tmp_path_factory) -> SentenceData:
    """Standard-library source text (200 kB) -> 512-piece BPE -> sentence-level .bin/.idx."""
    from megatron_2bw.data.corpus import build_corpus
    from megatron_2bw.data.preprocess import preprocess_jsonl
    from megatron_2bw.data.tokenizer import train_sentencepiece

    root = tmp_path_factory.mktemp("bert_data")
    corpus = str(root / "corpus.jsonl")
    assert build_corpus(corpus, max_chars=200_000) > 0
    model = train_sentencepiece(corpus, str(root / "tokenizer"), VOCAB)
    prefix = preprocess_jsonl(corpus, str(root / "bert"), "SentencePieceTokenizer", model,
                              split_sentences=True)["text"]
    return SentenceData(prefix, model, str(root / "index-cache"))


def _train_flags(data: SentenceData, schedule: str) -> list[str]:
    return [*dist.tiny_training_flags(seq_length=64, train_iters=TRAIN_ITERS),
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
            "--data-path", data.data_prefix, "--tokenizer-model", data.tokenizer_model,
            "--data-cache-path", data.index_cache]


@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_bert_pretraining_reduces_masked_lm_loss(sentence_data, schedule):
    result = dist.torchrun(["pretrain_bert_2bw.py", *_train_flags(sentence_data, schedule)],
                           nproc=2, timeout=240)
    assert result.returncode == 0, f"exit code {result.returncode}:\n{result.tail(60)}"
    assert f"training {schedule} schedule on 2 cpu processes: TP=1 PP=2 DP=1" in result.output
    log = parse_log(result.output)
    losses = {record.iteration: record.loss for record in log.iterations}
    validation = {record.iteration: record.loss for record in log.valid()}
    assert sorted(losses) == list(range(1, TRAIN_ITERS + 1)), result.tail()
    first = losses[1]
    last = sum(losses[i] for i in range(TRAIN_ITERS - 2, TRAIN_ITERS + 1)) / 3
    print(f"\n{schedule}: lm loss {first:.3f} -> {last:.3f} (mean of the last 3), "
          f"validation {validation.get(TRAIN_ITERS)}")
    # a fresh model predicts ~uniformly over the vocabulary at the masked positions
    assert abs(first - math.log(VOCAB)) < 0.3, first
    assert last < first - 0.6, f"{schedule}: lm loss went from {first:.3f} to only {last:.3f}"
    assert list(validation) == [TRAIN_ITERS], result.tail()
    assert validation[TRAIN_ITERS] < first - 0.5, validation


# ---- 2. exactness against single-process references ---------------------------------------------

@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    m: int
    dp: int = 1
    binary_head: bool = True

    @property
    def name(self) -> str:
        return (f"{self.schedule}-d{self.pp}-m{self.m}-w{self.dp}"
                f"{'' if self.binary_head else '-no-binary-head'}")

    @property
    def world(self) -> int:
        return self.pp * self.dp

    def reference(self, rule: str | None = None) -> str:
        rule = rule or ("2bw" if self.schedule == "2bw" else "sync")
        return f"{rule}-m{self.m}-w{self.dp}{'' if self.binary_head else '-no-binary-head'}"

    def run(self) -> dict:
        return {"name": self.name, "schedule": self.schedule, "pp": self.pp, "m": self.m,
                "iters": ITERS, "binary_head": self.binary_head}


SYNC_CASES = [Case(s, pp=2, m=4) for s in ("flush", "gpipe", "naive", "megatron")]
TWOBW_CASES = [Case("2bw", pp=2, m=4), Case("2bw", pp=2, m=2, binary_head=False),
               Case("2bw", pp=4, m=4), Case("2bw", pp=2, m=4, dp=2)]


def _spec(out: Path) -> dict:
    reference, groups = {}, {}
    for case in SYNC_CASES + TWOBW_CASES:
        for rule in ("sync", "2bw"):
            reference[case.reference(rule)] = {"rule": rule, "microbatches": case.m,
                                               "iterations": ITERS, "replicas": case.dp,
                                               "binary_head": case.binary_head}
        group = groups.setdefault(f"world{case.world}",
                                  {"world": case.world, "timeout_s": 120, "runs": []})
        group["runs"].append(case.run())
    return {"out": str(out), "init": str(out / "init.pt"), "timeout_minutes": 1.0,
            "reference": reference, "groups": groups}


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bert_exact")
    (out / "spec.json").write_text(json.dumps(_spec(out), indent=1))
    result = dist.python([str(REPO / "tests" / "bert_worker.py"), str(out / "spec.json")],
                         timeout=300, PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.tail(60)
    summary = json.loads((out / "launch.json").read_text())
    for name, group in summary.items():
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / name).glob("rank*.log")))
        assert not group["timed_out"] and all(c == 0 for c in group["exit_codes"]), \
            f"{name}: {group}\n{logs}"
    print("\nlauncher: " + ", ".join(f"{name} {group['seconds']:.1f} s"
                                     for name, group in summary.items()))
    return out


def _gather(out: Path, case: Case) -> tuple[dict, dict]:
    """{name: tensor} of data-parallel replica 0 under PP=1 names, and {replica: losses}."""
    shards = [torch.load(p) for p in sorted((out / case.name).glob("rank*.pt"))]
    assert len(shards) == case.world, f"{case.name}: {len(shards)} of {case.world} ranks wrote"
    replicas: dict = {}
    for shard in shards:
        replicas.setdefault(shard["dp"], {}).update(shard["params"])
    for weights in replicas.values():
        tied = weights.pop("tied:output_layer.weight")
        assert torch.equal(tied, weights["embedding.word_embeddings.weight"]), \
            f"{case.name}: the last stage's tied output layer left the word embeddings"
    for dp in range(1, case.dp):
        for name, tensor in replicas[0].items():
            assert torch.equal(tensor, replicas[dp][name]), f"{case.name}: replica {dp}, {name}"
    return replicas[0], {s["dp"]: s["losses"] for s in shards if s["losses"]}


def relative_error(weights: dict, reference: dict) -> float:
    assert sorted(weights) == sorted(reference), sorted(set(weights) ^ set(reference))
    diff = sum(float((weights[n].double() - reference[n].double()).norm()) ** 2 for n in reference)
    norm = sum(float(reference[n].double().norm()) ** 2 for n in reference)
    return math.sqrt(diff / norm)


def _check(out: Path, case: Case) -> None:
    weights, losses = _gather(out, case)
    ref = torch.load(out / f"{case.reference()}.pt")
    error = relative_error(weights, ref["weights"])
    other = "sync" if case.schedule == "2bw" else "2bw"
    distance = relative_error(weights, torch.load(out / f"{case.reference(other)}.pt")["weights"])
    print(f"\n{case.name}: relative error {error:.2e} against {case.reference()} "
          f"(the {other} rule: {distance:.2e})")
    assert error <= TOLERANCE, f"{case.name}: relative error {error:.3g} > {TOLERANCE}"
    assert distance > DISTINCT, f"{case.name}: only {distance:.3g} from the {other} reference"
    assert sorted(losses) == list(range(case.dp))
    for replica, seen in losses.items():
        assert len(seen) == ITERS
        for key, expected in (("lm loss", ref["lm_losses"]), ("sop loss", ref["sop_losses"])):
            if key == "sop loss" and not case.binary_head:
                assert all(key not in step for step in seen)
                continue
            got = [step[key] for step in seen]
            want = [batch[replica] for batch in expected]
            assert max(abs(a - b) for a, b in zip(got, want)) < LOSS_TOLERANCE, \
                f"{case.name}: replica {replica} {key} {got}, reference {want}"


@pytest.mark.parametrize("case", SYNC_CASES, ids=lambda case: case.name)
def test_synchronous_schedules_equal_gradient_accumulation(exact_runs, case):
    _check(exact_runs, case)


@pytest.mark.parametrize("case", TWOBW_CASES, ids=lambda case: case.name)
def test_2bw_equals_one_stale_update(exact_runs, case):
    _check(exact_runs, case)


# ---- 3. flags -----------------------------------------------------------------------------------

def test_gpt_tokenizer_type_is_refused(sentence_data, capsys):
    """Refused before any process group: megatron-core's BERT dataset needs [CLS], [SEP] and
    [MASK] ids."""
    import pretrain_bert_2bw

    with pytest.raises(SystemExit) as exit_info:
        pretrain_bert_2bw.main([*dist.tiny_training_flags(seq_length=64, train_iters=4),
                                "--data-path", sentence_data.data_prefix,
                                "--tokenizer-model", sentence_data.tokenizer_model,
                                "--tokenizer-type", "GPTSentencePieceTokenizer"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: --tokenizer-type: BERT needs a tokenizer "
                                               "with cls, sep, mask tokens: use "
                                               "SentencePieceTokenizer")


def test_bert_flags():
    import pretrain_bert_2bw
    from megatron_2bw.arguments import FlagError, parse_args

    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "64", "--max-position-embeddings", "64", "--lr", "1e-3"]
    args = parse_args([*model, "--mock-data", "--train-iters", "1"], world_size=1,
                      parser=pretrain_bert_2bw.parser())
    assert (args.bert_binary_head, args.mask_prob, args.short_seq_prob) == (True, 0.15, 0.1)
    assert args.tokenizer_type == "BertWordPieceLowerCase"  # Megatron-LM pretrain_bert.py's default
    args = parse_args([*model, "--mock-data", "--train-iters", "1", "--bert-no-binary-head"],
                      world_size=1,
                      parser=pretrain_bert_2bw.parser())
    assert not args.bert_binary_head
    with pytest.raises(FlagError,
                       match=r"--mask-prob: expected a finite number in \(0, 1\), got .1."):
        parse_args([*model, "--mock-data", "--train-iters", "1", "--mask-prob", "1"],
                   world_size=1, parser=pretrain_bert_2bw.parser())


def test_document_level_data_is_refused(sentence_data, tmp_path):
    """Documents of one sequence (GPT's preprocessing) give the binary head no sentence pair."""
    from megatron_2bw.data import bert
    from megatron_2bw.data.errors import DataError
    from megatron_2bw.data.preprocess import preprocess_jsonl
    from megatron_2bw.data.tokenizer import build_tokenizer

    corpus = str(Path(sentence_data.data_prefix).parent / "corpus.jsonl")
    documents = preprocess_jsonl(corpus, str(tmp_path / "doc"), "SentencePieceTokenizer",
                                 sentence_data.tokenizer_model)["text"]
    tokenizer = build_tokenizer("SentencePieceTokenizer", sentence_data.tokenizer_model)
    with pytest.raises(DataError, match="--data-path: no BERT sample fits in the train split"):
        bert.build_bert_datasets([documents], "90,10,0", 64, 1234, tokenizer, (16, 16, 0),
                                 cache_dir=str(tmp_path / "cache"))


def test_mock_bert_samples():
    from megatron_2bw.data.bert import MockBERTDataset

    dataset = MockBERTDataset(100, 16, 64, seed=7)
    for idx in range(100):
        s = dataset[idx]
        length = int(s["padding_mask"].sum())
        assert s["padding_mask"][:length].all() and not s["padding_mask"][length:].any()
        assert s["text"][0] == dataset.CLS and s["text"][length - 1] == dataset.SEP
        assert (s["text"][length:] == dataset.PAD).all()
        masked = s["loss_mask"] == 1
        assert masked.any() and (s["labels"][masked] >= dataset.FIRST_ID).all()
        assert (s["labels"][~masked] == -1).all() and not masked[length - 1]
        assert set(s["types"][:length].tolist()) == {0, 1}
        assert equal_samples(dataset[idx], s)
    assert {dataset[i]["is_random"] for i in range(100)} == {0, 1}


def equal_samples(a: dict, b: dict) -> bool:
    return all((a[k] == b[k]).all() if hasattr(a[k], "all") else a[k] == b[k] for k in a)


# ---- 4. checkpoints with the file-sized vocabulary ----------------------------------------------

def _bert_flags(data: Path, vocab: Path) -> list[str]:
    return ["pretrain_bert_2bw.py", "--cpu", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
            "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
            "--train-iters", "1", "--split", "949,50,1", "--eval-iters", "0",
            "--data-path", str(data / "bert" / "my-bert_text_sentence"),
            "--vocab-file", str(vocab), "--distributed-timeout-minutes", "1"]


def _saved_tensors(path: Path, keys: tuple[str, ...]) -> dict:
    """Whole tensors of a torch_dist checkpoint, read by torch's own reader."""
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(str(path))
    shapes = reader.read_metadata().state_dict_metadata
    tensors = {key: torch.empty(tuple(shapes[key].size)) for key in keys}
    load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def test_a_checkpoint_with_the_file_sized_vocabulary_loads(example_data, tmp_path):
    """The old rows, made as a run over the vocabulary file without its last two lines: 510 + 2
    = 512 rows, what the whole 512-line file gave before; resumed with the whole file: 514
    rows padded to 640 (a multiple of 128)."""
    full = example_data / "bert-vocab.txt"
    short = tmp_path / "short-vocab.txt"
    short.write_text("".join(full.read_text().splitlines(keepends=True)[:510]))
    old, new = tmp_path / "old", tmp_path / "new"
    done = dist.python([*_bert_flags(example_data, short), "--save", str(old)], WORLD_SIZE="1")
    assert done.returncode == 0, done.tail()
    done = dist.python([*_bert_flags(example_data, full), "--load", str(old), "--save", str(new),
                        "--save-interval", "100"], WORLD_SIZE="1")
    assert done.returncode == 0, done.tail()
    warning = (f" warning: {old}/iter_0000001 has a vocabulary of 512 rows, this run 640 (padded "
               f"to a multiple of --make-vocab-size-divisible-by 128 x TP 1): a BertWordPiece "
               f"checkpoint from before megatron-2bw added [BOS] and [EOS] to the vocabulary "
               f"file's tokens, as Megatron-LM does; loaded with rows 512..639 at zero")
    assert done.output.splitlines().count(warning) == 1, done.tail()
    keys = ("embedding.word_embeddings.weight", "output_layer.bias")
    before = _saved_tensors(old / "iter_0000001", keys)
    after = _saved_tensors(new / "iter_0000001", keys)
    for key in keys:
        assert before[key].shape[0] == 512 and after[key].shape[0] == 640
        assert torch.equal(after[key][:512], before[key]) and not after[key][512:].any(), key
    assert before["embedding.word_embeddings.weight"].std() > 0.01  # saved rows, not zeros

    from megatron.core import dist_checkpointing

    from megatron_2bw.training.checkpointing import CheckpointRefused, _check_vocabulary

    saved = dist_checkpointing.load_common_state_dict(str(old / "iter_0000001"))["args"]
    run = argparse.Namespace(**{**vars(saved), "padded_vocab_size": 640,
                                "use_distributed_optimizer": True})
    with pytest.raises(CheckpointRefused, match=r"^--load: .* has a vocabulary of 512 rows, this "
                       r"run 640 .*; the distributed optimizer's state cannot be resized: pass "
                       r"--no-load-optim to load the weights alone$"):
        _check_vocabulary(str(old), saved, run, load_optim=True, warn=print)
