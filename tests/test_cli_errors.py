"""Bad command lines end with one clear error line naming the flag, before training starts,
with a non-zero exit code on every rank.

Most cases run ``pretrain_gpt_2bw.py`` as one plain process with WORLD_SIZE set (flag errors
come back in ~0.1 s; data errors after megatron-core's import); one case runs under
``torchrun --nproc-per-node 2`` and checks each rank's own log and exit code. Every bad command
line has a repaired twin that the same validator accepts, so each error is caused by the one
defect the case introduces.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from megatron_2bw.arguments import parse_args
from tests import dist as launch

SCRIPT = "pretrain_gpt_2bw.py"
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--cpu"]


def assert_one_error_line(result: launch.Launch, flag: str, *fragments: str) -> str:
    """Non-zero exit; the output ends with the only ``error:`` line, which starts with
    ``flag`` (and contains ``fragments``); no traceback; nothing trained."""
    output = result.output
    assert result.returncode != 0, f"exit code 0 for {result.command}:\n{result.tail()}"
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, f"expected one error line, got {errors}:\n{result.tail()}"
    assert lines[-1] == errors[0], f"the error is not the last line:\n{result.tail()}"
    assert errors[0].startswith(f"error: {flag}: "), f"{errors[0]!r} does not start with {flag}"
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    assert "Traceback" not in output, output[-3000:]
    assert not re.search(r"\btraining\b|iteration\s+\d+/", output), output[-3000:]
    return errors[0]


# ---- flag errors: caught by the validator before anything is imported ---------------------

_V_FLAGS = ["--pipeline-schedule", "zb-v", "--pipeline-model-parallel-size", "2",
            "--untie-embeddings-and-output-weights"]
_DUALPIPEV_FLAGS = ["--pipeline-schedule", "dualpipev"] + _V_FLAGS[2:]

FLAG_CASES = {
    # id: (bad flags, repaired flags, world size, flag named, fragments of the message)
    "layers-not-divisible-by-pipeline": (
        ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2"],
        2, "--num-layers", ["3 layers", "2 pipeline stages"]),
    "heads-not-divisible-by-tensor-parallel": (
        ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "48"],
        ["--tensor-model-parallel-size", "2", "--num-attention-heads", "4", "--hidden-size", "48"],
        2, "--num-attention-heads", ["3 heads", "tensor-parallel size 2"]),
    "global-batch-not-divisible": (
        ["--micro-batch-size", "3", "--global-batch-size", "8"],
        ["--micro-batch-size", "4", "--global-batch-size", "8"],
        2, "--global-batch-size", ["8", "micro batch (3)", "data-parallel size (2)"]),
    "world-size-not-tp-x-pp-x-dp": (
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"],
        2, "--tensor-model-parallel-size", ["world size 2", "tensor (2) x pipeline (2)"]),
    "world-size-odd": (
        ["--tensor-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "1"],
        3, "--tensor-model-parallel-size", ["world size 3"]),
    "moe-experts-not-divisible-by-expert-parallel": (
        ["--num-experts", "3", "--expert-model-parallel-size", "2", "--disable-bias-linear"],
        ["--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear"],
        2, "--expert-model-parallel-size", ["3 experts", "2 expert-parallel ranks"]),
    "moe-cuda-kernel-on-cpu": (
        ["--num-experts", "4", "--disable-bias-linear", "--moe-permute-fusion"],
        ["--num-experts", "4", "--disable-bias-linear"],
        1, "--moe-permute-fusion", ["CUDA kernel"]),
    "unknown-flag": (
        ["--no-such-flag", "3"],
        [],
        1, "--no-such-flag", ["unknown flag"]),
    "lr-not-finite": (
        ["--lr", "inf"],
        ["--lr", "1e-3"],
        1, "--lr", ["finite", "inf"]),
    "loss-scale-window-zero": (
        ["--loss-scale-window", "0"],
        ["--loss-scale-window", "1"],
        1, "--loss-scale-window", [">= 1", "got '0'"]),
    "hidden-size-zero": (
        ["--hidden-size", "0"],
        ["--hidden-size", "32"],
        1, "--hidden-size", [">= 1", "got '0'"]),
    "dropout-of-one": (
        ["--hidden-dropout", "1"],
        ["--hidden-dropout", "0.5"],
        1, "--hidden-dropout", ["[0, 1)", "got '1'"]),
    "invalid-value": (
        ["--num-layers", "four"],
        ["--num-layers", "4"],
        1, "--num-layers", ["'four'"]),
    # the V schedules: 2d chunks of layers, untied embeddings, DualPipeV's m >= 2d
    "v-layers-not-divisible-by-2d": (
        _V_FLAGS + ["--num-layers", "6"], _V_FLAGS + ["--num-layers", "8"],
        2, "--num-layers", ["6 layers", "4 model chunks"]),
    "v-tied-embeddings": (
        _V_FLAGS[:-1], _V_FLAGS, 2, "--untie-embeddings-and-output-weights", ["zb-v"]),
    # --optimizer muon as megatron-core builds it; --stale-weight-correction on 2bw's fp32 weights
    # dist_muon (also --optimizer muon --use-distributed-optimizer) all-gathers in its step
    "dist-muon-overlap-param-gather": (
        ["--optimizer", "muon", "--use-distributed-optimizer", "--overlap-grad-reduce",
         "--overlap-param-gather"],
        ["--optimizer", "muon", "--use-distributed-optimizer", "--overlap-grad-reduce"],
        2, "--overlap-param-gather", ["dist_muon", "all-gathers"]),
    "dist-muon-fp16": (["--optimizer", "dist_muon", "--fp16"], ["--optimizer", "dist_muon"],
                       2, "--fp16", ["--optimizer muon", "--bf16"]),
    "muon-flag-without-muon": (
        ["--muon-momentum", "0.95"], ["--optimizer", "muon", "--muon-momentum", "0.95"],
        1, "--muon-momentum", ["only with --optimizer muon", "adam"]),
    "muon-fp16": (["--optimizer", "muon", "--fp16"], ["--optimizer", "muon", "--bf16"],
                  1, "--fp16", ["--optimizer muon", "--bf16"]),
    "muon-tp-mode-needs-emerging-optimizers": (
        ["--optimizer", "muon", "--muon-tp-mode", "duplicated"], ["--optimizer", "muon"],
        1, "--muon-tp-mode", ["emerging-optimizers", "blockwise"]),
    "correction-under-flush": (
        ["--pipeline-schedule", "flush", "--stale-weight-correction", "ef"],
        ["--pipeline-schedule", "2bw", "--stale-weight-correction", "ef"],
        1, "--stale-weight-correction", ["only with --pipeline-schedule 2bw", "flush"]),
    "correction-coeff-without-correction": (
        ["--pipeline-schedule", "2bw", "--stale-weight-correction-coeff", "2"],
        ["--pipeline-schedule", "2bw", "--stale-weight-correction", "dc",
         "--stale-weight-correction-coeff", "2"],
        1, "--stale-weight-correction-coeff", ["predict, dc or ef"]),
    "correction-coeff-zero": (
        ["--pipeline-schedule", "2bw", "--stale-weight-correction", "dc",
         "--stale-weight-correction-coeff", "0"],
        ["--pipeline-schedule", "2bw", "--stale-weight-correction", "dc",
         "--stale-weight-correction-coeff", "2"],
        1, "--stale-weight-correction-coeff", ["got '0'"]),
    "dualpipev-fewer-than-2d-microbatches": (
        _DUALPIPEV_FLAGS + ["--global-batch-size", "6"],
        _DUALPIPEV_FLAGS + ["--global-batch-size", "8"],
        2, "--global-batch-size", ["m >= 2 x pipeline depth = 4", "= 3"]),
}


@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_flag_error(tiny_gpt_data, case):
    bad, repaired, world, flag, fragments = FLAG_CASES[case]
    data = tiny_gpt_data.flags()
    parse_args([*TINY, *repaired, *data], world_size=world)  # the repaired twin is valid
    result = launch.python([SCRIPT, *TINY, *bad, *data], timeout=60, WORLD_SIZE=str(world))
    assert_one_error_line(result, flag, *fragments)


@pytest.mark.parametrize("schedule", ["2bw", "pipedream", "pipemare"])
@pytest.mark.parametrize("recipe", ["e4m3", "hybrid"])
def test_low_precision_weights_are_refused_where_two_versions_live(schedule, recipe):
    """transformer-engine caches a weight's FP8/FP4 copy at a batch's first microbatch; on
    CUDA a schedule whose look-ahead forwards read another version than the batch's backwards
    would overwrite it. The schedules with one version per batch accept the recipe, and on the
    CPU (no transformer-engine layers, the recipe has no effect) every schedule does."""
    from megatron_2bw.arguments import low_precision_refusal

    problem = low_precision_refusal(schedule, recipe, on_cuda=True)
    assert problem is not None and problem.startswith(f"not with --pipeline-schedule {schedule}:")
    assert "first microbatch" in problem and "look-ahead" in problem
    assert low_precision_refusal(schedule, None, on_cuda=True) is None
    assert low_precision_refusal(schedule, recipe, on_cuda=False) is None
    for accepted in ("flush", "gpipe", "zb-h1", "naive", "megatron"):
        assert low_precision_refusal(accepted, recipe, on_cuda=True) is None


@pytest.mark.parametrize("flag, value", [("--fp8-format", "e4m3"), ("--fp4-format", "e2m1")])
def test_low_precision_recipes_parse_under_2bw_on_the_cpu(flag, value):
    """On the CPU the validator accepts the recipe under 2bw (Megatron-LM's FP8 Llama example
    runs there unchanged); the refusal is CUDA's (above)."""
    parse_args([*TINY, "--global-batch-size", "4", "--mock-data", "--pipeline-schedule", "2bw",
                flag, value], world_size=1)


# flag, bad value, a valid value, the interval the message must state
RANGE_CASES = [
    ("--num-layers", "-2", "2", ">= 1"), ("--num-attention-heads", "0", "2", ">= 1"),
    ("--ffn-hidden-size", "0", "64", ">= 1"), ("--seq-length", "0", "8", ">= 1"),
    ("--max-position-embeddings", "-1", "128", ">= 1"),
    ("--make-vocab-size-divisible-by", "0", "64", ">= 1"),
    ("--attention-dropout", "-0.1", "0", "[0, 1)"), ("--init-method-std", "0", "0.01", "(0, inf)"),
    ("--micro-batch-size", "0", "1", ">= 1"), ("--global-batch-size", "-4", "8", ">= 1"),
    ("--train-iters", "0", "1", ">= 1"), ("--lr", "-1e-3", "1e-4", "(0, inf)"),
    ("--lr", "nan", "1e-4", "(0, inf)"), ("--min-lr", "-1", "0", "[0, inf)"),
    ("--lr-warmup-iters", "-1", "0", ">= 0"), ("--lr-decay-iters", "0", "1", ">= 1"),
    ("--weight-decay", "-0.1", "0", "[0, inf)"), ("--clip-grad", "inf", "0", "[0, inf)"),
    ("--adam-beta1", "1", "0.5", "[0, 1)"), ("--adam-beta2", "1.5", "0.95", "[0, 1)"),
    ("--adam-eps", "0", "1e-6", "(0, inf)"), ("--seed", "-5", "0", ">= 0"),
    ("--loss-scale", "0", "128", "(0, inf)"), ("--initial-loss-scale", "-1", "1024", "(0, inf)"),
    ("--min-loss-scale", "0", "1", "(0, inf)"), ("--hysteresis", "0", "1", ">= 1"),
    ("--vocab-size", "0", "128", ">= 1"), ("--log-interval", "0", "1", ">= 1"),
    ("--eval-interval", "-1", "1", ">= 1"), ("--eval-iters", "-1", "0", ">= 0"),
    ("--save-interval", "0", "1", ">= 1"), ("--exit-interval", "0", "1", ">= 1"),
    ("--distributed-timeout-minutes", "nan", "0.5", "(0, inf)"),
    ("--tensor-model-parallel-size", "0", "1", ">= 1"),
    ("--pipeline-model-parallel-size", "-1", "1", ">= 1"),
]


@pytest.mark.parametrize("flag,bad,good,interval", RANGE_CASES,
                         ids=[f"{c[0][2:]}={c[1]}" for c in RANGE_CASES])
def test_numeric_flag_out_of_range(flag, bad, good, interval):
    """Every numeric flag is range-checked by the parser, naming the flag, the interval and the
    value; the same flag with a valid value parses."""
    from megatron_2bw.arguments import FlagError

    base = [*TINY, "--mock-data", "--save", "/tmp/unused"]
    parse_args([*base, f"{flag}={good}"], world_size=1)
    with pytest.raises(FlagError) as error:
        parse_args([*base, f"{flag}={bad}"], world_size=1)
    assert str(error.value).startswith(f"{flag}: "), error.value
    assert interval in str(error.value) and bad in str(error.value), error.value


def _a_file(tmp_path) -> str:
    path = tmp_path / "a-file"
    path.write_text("")
    return str(path)


# id: (extra flags given tmp_path, script, flag named, fragments); each found by trying what a
# new user would (scripts/try_bad_inputs.py) and a traceback, a crash or a hang before
LATE_CASES = {
    "tensorboard-dir-below-a-file": (lambda t: ["--tensorboard-dir", _a_file(t) + "/tb"],
                                     SCRIPT, "--tensorboard-dir", ["is a file, not a folder"]),
    "data-cache-below-a-file": (lambda t: ["--data-cache-path", _a_file(t) + "/cache"],
                                SCRIPT, "--data-cache-path", ["is a file, not a folder"]),
    "load-a-file": (lambda t: ["--load", _a_file(t)], SCRIPT, "--load",
                    ["is a file; --load takes the checkpoint directory"]),
    "train-iters-beyond-any-run": (lambda t: ["--train-iters", "10" * 15], SCRIPT,
                                   "--train-iters", ["samples exceed"]),
    "bert-seq-length-4": (lambda t: ["--seq-length", "4"], "pretrain_bert_2bw.py",
                          "--seq-length", ["BERT needs at least 5", "got 4"]),
    "hidden-size-beyond-memory": (lambda t: ["--hidden-size", "4000000000000"], SCRIPT,
                                  "--num-layers/--hidden-size", ["cannot be allocated here"]),
    "num-layers-beyond-an-index": (lambda t: ["--num-layers", "1" * 25], SCRIPT,
                                   "--num-layers/--hidden-size", ["cannot be allocated here"]),
}


@pytest.mark.parametrize("case", list(LATE_CASES))
def test_late_failures_are_one_line(case, tmp_path):
    extra, script, flag, fragments = LATE_CASES[case]
    result = launch.python([script, *TINY, "--mock-data", *extra(tmp_path)], timeout=120,
                           WORLD_SIZE="1")
    assert_one_error_line(result, flag, *fragments)


def test_a_nan_blend_weight_is_one_line(tiny_gpt_data):
    from megatron_2bw.data.errors import DataError
    from megatron_2bw.data.gpt import parse_data_path

    prefix = tiny_gpt_data.data_prefix
    assert parse_data_path(["0.5", prefix, "1", prefix])[1] == [0.5, 1.0]
    for weight in ("nan", "inf"):
        with pytest.raises(DataError, match="finite weights > 0"):
            parse_data_path([weight, prefix, "1", prefix])


def test_missing_data_path(tiny_gpt_data):
    tokenizer = ["--tokenizer-model", tiny_gpt_data.tokenizer_model]
    parse_args([*TINY, *tokenizer, "--data-path", tiny_gpt_data.data_prefix], world_size=1)
    result = launch.python([SCRIPT, *TINY, *tokenizer], timeout=60, WORLD_SIZE="1")
    assert_one_error_line(result, "--data-path", "required")


def test_missing_tokenizer_files(tiny_gpt_data):
    """No tokenizer flag at all: Megatron-LM's default for GPT, GPT2BPETokenizer, needs its files."""
    data = ["--data-path", tiny_gpt_data.data_prefix]
    result = launch.python([SCRIPT, *TINY, *data], timeout=60, WORLD_SIZE="1")
    assert_one_error_line(result, "--vocab-file", "required with --tokenizer-type GPT2BPETokenizer")


def test_nonexistent_tokenizer_model(tiny_gpt_data, tmp_path):
    missing = str(tmp_path / "no-such-tokenizer.model")
    result = launch.python([SCRIPT, *TINY, "--data-path", tiny_gpt_data.data_prefix,
                            "--tokenizer-model", missing], timeout=60, WORLD_SIZE="1")
    assert_one_error_line(result, "--tokenizer-model", missing)


# ---- data errors: caught by the data checks, still before any process group ---------------

def _copy_dataset(prefix: str, directory) -> str:
    copy = str(directory / "copy_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copyfile(prefix + suffix, copy + suffix)
    return copy


def _garbage_header(idx: str) -> None:
    with open(idx, "r+b") as f:
        f.write(b"not an index file at all")


def _truncated(idx: str) -> None:
    with open(idx, "rb") as f:
        content = f.read()
    with open(idx, "wb") as f:
        f.write(content[:-12])


def _missing_bin(idx: str) -> None:
    os.remove(idx[:-len(".idx")] + ".bin")


@pytest.mark.parametrize("damage", [_garbage_header, _truncated, _missing_bin],
                         ids=["garbage-header", "truncated", "missing-bin"])
def test_corrupt_indexed_dataset(tiny_gpt_data, tmp_path, damage):
    prefix = _copy_dataset(tiny_gpt_data.data_prefix, tmp_path)
    damage(prefix + ".idx")
    result = launch.python([SCRIPT, *TINY, "--data-path", prefix,
                            "--tokenizer-model", tiny_gpt_data.tokenizer_model],
                           timeout=120, WORLD_SIZE="1")
    line = assert_one_error_line(result, "--data-path")
    assert prefix in line, line


def test_splits_asked_for_no_samples_are_not_built(tiny_gpt_data):
    """The tiny corpus has 12 documents: --split 969,30,1 leaves the validation and test splits
    empty. With --eval-iters 0 they are asked for nothing and training runs (megatron-core's
    builder would build them anyway and repeat their zero tokens forever)."""
    result = launch.python([SCRIPT, *TINY, *tiny_gpt_data.flags(), "--eval-iters", "0",
                            "--log-interval", "1", "--split", "969,30,1"],
                           timeout=120, WORLD_SIZE="1")
    assert result.returncode == 0, result.tail()
    assert re.search(r"iteration +2/ +2", result.output), result.tail()


def test_token_ids_outside_the_vocabulary_are_one_line(tiny_gpt_data, tmp_path):
    """A .bin whose bytes were overwritten (every 50th token id 65535, well-formed index): the
    first batch holding one ends the run with one line naming --data-path, not the embedding's
    IndexError (a device-side assert on CUDA)."""
    import numpy

    prefix = _copy_dataset(tiny_gpt_data.data_prefix, tmp_path)
    tokens = numpy.memmap(prefix + ".bin", dtype=numpy.uint16, mode="r+")
    tokens[::50] = 65535
    tokens.flush()
    del tokens
    result = launch.python([SCRIPT, *TINY, "--data-path", prefix, "--eval-iters", "0",
                            "--tokenizer-model", tiny_gpt_data.tokenizer_model],
                           timeout=120, WORLD_SIZE="1")
    assert result.returncode == 2, result.tail()
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --data-path: a training batch holds token id 65535, outside the "
                      f"tokenizer's vocabulary of {tiny_gpt_data.vocab_size} (a damaged .bin "
                      f"file, or data tokenized with another tokenizer than --tokenizer-model)"]
    assert "Traceback" not in result.output, result.tail()


def test_tokenizer_model_that_is_not_sentencepiece(tiny_gpt_data, tmp_path):
    fake = tmp_path / "fake.model"
    fake.write_text("this is not a sentencepiece model\n")
    result = launch.python([SCRIPT, *TINY, "--data-path", tiny_gpt_data.data_prefix,
                            "--tokenizer-model", str(fake)], timeout=120, WORLD_SIZE="1")
    assert_one_error_line(result, "--tokenizer-model", str(fake))


def test_a_corpus_too_small_for_the_split_is_one_line(tiny_gpt_data, tmp_path):
    """40 documents and --split 969,30,1: megatron-core's builder gives the test split no
    documents and would repeat its zero tokens forever. Refused up front with the number of
    documents the split needs (the smallest n with round(0.999 n) < n, derived here)."""
    import json

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_2bw.data.gpt import check_splits_have_tokens
    from megatron_2bw.data.preprocess import preprocess_jsonl

    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: def f(x): return x + {i}\n"})
                              + "\n" for i in range(40)))
    prefix = preprocess_jsonl(str(corpus), str(tmp_path / "small"), "GPTSentencePieceTokenizer",
                              tiny_gpt_data.tokenizer_model, append_eod=True)["text"]
    needed = next(n for n in range(1, 10_000) if round(0.999 * n) < n)
    check_splits_have_tokens(prefix, "969,31,0", (8, 8, 0), 16)  # the repaired twin is served
    result = launch.python([SCRIPT, *TINY, "--data-path", prefix, "--split", "969,30,1",
                            "--tokenizer-model", tiny_gpt_data.tokenizer_model],
                           timeout=120, WORLD_SIZE="1")
    assert_one_error_line(result, "--data-path", "test split", "holds no tokens",
                          f"at least {needed} documents")
    # the same corpus, every split served, but a million iterations: 10 000+ passes refused
    dataset = IndexedDataset(prefix)  # alive while its memory-mapped lengths are read
    tokens = int(dataset.sequence_lengths[:39].astype("int64").sum())  # train: documents [0, 39)
    samples = 1_000_000 * 2
    result = launch.python([SCRIPT, *TINY, "--data-path", prefix, "--split", "969,31,0",
                            "--train-iters", "1000000", "--eval-iters", "0",
                            "--tokenizer-model", tiny_gpt_data.tokenizer_model],
                           timeout=120, WORLD_SIZE="1")
    assert_one_error_line(result, "--data-path", f"train split of {prefix} holds {tokens} tokens",
                          f"would pass over them {-(-(samples * 16 + 1) // tokens)} times")


# ---- under torchrun: every rank reports and fails on its own -------------------------------

_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def test_every_rank_fails_under_torchrun(tiny_gpt_data, tmp_path):
    """TP=2 x PP=2 on 2 processes. Each rank's own log (torchrun --redirects) holds exactly the
    one error line; torchrun reports each rank's exit code, none zero. The monitor interval
    gives both ranks time to fail by themselves before torchrun stops the rest."""
    logs = tmp_path / "logs"
    result = launch.torchrun(
        [SCRIPT, *TINY, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
         "2", *tiny_gpt_data.flags()], nproc=2, timeout=120,
        launcher_args=("--monitor-interval", "2", "--log-dir", str(logs), "--redirects", "3"))
    assert result.returncode != 0
    exit_codes = {int(rank): int(code) for rank, code in _FAILURE.findall(result.output)}
    assert set(exit_codes) == {0, 1}, result.tail(60)
    assert all(code != 0 for code in exit_codes.values()), exit_codes
    for rank in (0, 1):
        [stderr] = logs.glob(f"*/attempt_0/{rank}/stderr.log")
        [stdout] = logs.glob(f"*/attempt_0/{rank}/stdout.log")
        rank_log = launch.Launch([], exit_codes[rank], stdout.read_text() + stderr.read_text())
        assert_one_error_line(rank_log, "--tensor-model-parallel-size", "world size 2")
    # torchrun's own summary follows, but no frame of our code appears anywhere
    assert not re.search(r'File ".*(megatron_2bw|pretrain_gpt_2bw)', result.output)


def test_lr_warmup_fraction_is_megatron_lms():
    """--lr-warmup-fraction f warms up over f x --lr-decay-iters iterations (Megatron-LM's
    lr_warmup_steps = f x lr_decay_steps), linearly from 0 to --lr; with --lr-warmup-iters it
    is refused."""
    import torch

    from megatron_2bw.arguments import FlagError
    from megatron_2bw.training.build import build_scheduler

    args = parse_args([*TINY, "--mock-data", "--train-iters", "8", "--lr", "1e-3",
                       "--min-lr", "0", "--lr-decay-style", "linear",
                       "--lr-warmup-fraction", "0.25"],
                      world_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = build_scheduler(args, optimizer)
    rates = []
    for _ in range(8):
        scheduler.step(args.global_batch_size)  # it counts samples, as Megatron-LM's
        rates.append(optimizer.param_groups[0]["lr"])
    warmup = 0.25 * 8  # two iterations up, then linear decay to 0 at iteration 8
    expected = [1e-3 * step / warmup if step <= warmup else
                1e-3 * (1 - (step - warmup) / (8 - warmup)) for step in range(1, 9)]
    assert rates == pytest.approx(expected, abs=1e-12)
    with pytest.raises(FlagError, match="--lr-warmup-fraction: give"):
        parse_args([*TINY, "--mock-data", "--train-iters", "8", "--lr-warmup-fraction", "0.1",
                    "--lr-warmup-iters", "3"], world_size=1)


@pytest.mark.parametrize("flags, flag", [
    (["--train-iters", "4", "--lr-warmup-iters", "4"], "--lr-warmup-iters"),
    (["--train-iters", "8", "--lr-decay-iters", "3", "--lr-warmup-iters", "3"], "--lr-warmup-iters"),
    (["--train-samples", "64", "--lr-warmup-samples", "64"], "--lr-warmup-samples"),
])
def test_a_warm_up_as_long_as_the_decay_is_one_line(flags, flag):
    """megatron-core's scheduler asserts warm-up < decay steps: refused before it is built."""
    from megatron_2bw.arguments import FlagError, parse_args

    at = TINY.index("--train-iters")
    base = TINY[:at] + TINY[at + 2:]
    with pytest.raises(FlagError, match=f"^{flag}: .* must be fewer than"):
        parse_args([*base, "--mock-data", *flags], world_size=1)


def test_a_transformer_engine_attention_backend_on_the_cpu_is_one_line():
    """Megatron-LM's BERT example passes --attention-backend fused: on the CPU (no
    transformer_engine) one line says it is not used, and BERT trains (megatron-core's
    BertModel would assert on a fused backend with its own attention)."""
    result = launch.python(["pretrain_bert_2bw.py", *TINY, "--mock-data", "--eval-iters", "0",
                            "--log-interval", "1", "--attention-backend", "fused"],
                           timeout=120, WORLD_SIZE="1")
    assert result.returncode == 0, result.tail()
    assert " --attention-backend fused: a transformer_engine kernel, not used (this process " \
           "runs on the CPU; transformer_engine needs CUDA)" in result.output, result.tail()
    assert re.search(r"iteration +2/ +2", result.output), result.tail()
