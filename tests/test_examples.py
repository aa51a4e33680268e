"""Megatron-LM's example launch scripts, shrunk (scripts/examples/), run through bash on 2 CPU
processes (Mixtral's on 4: pipeline 2 x expert parallel 2) as a user runs them: each exits 0
and its training loss falls.

The loss reference is derived, not recorded: the first iteration's loss is ln(vocabulary rows)
and the mean of the last two logged losses must be at least 4% below the first (weights that
never change stay within 1%). BERT's run is also held to Megatron-LM's TensorBoard tags and
checkpoint contents (core_v0.16.1), and the runs are under strict NCCL mode. Guards: the
examples' own flags train under 2bw. Why lr 1e-2, the measured drops and the data:
docs/testing.md, "What each test module checks", test_examples.py.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from megatron_2bw.logparse import parse_log
from tests import dist as launch

EXAMPLES = launch.REPO / "scripts" / "examples"
VOCAB = 512  # prepare_data.VOCAB_SIZE
MIN_RELATIVE_DROP = 0.04
FASTER = ["--lr", "1e-2"]
FP16_FASTER = [*FASTER, "--initial-loss-scale", "4096"]
# tokenizer.py build_tokenizer: _vocab_size_with_padding(512 + [BOS] + [EOS]) at
# --make-vocab-size-divisible-by 128 x TP 1
BERT_ROWS = 640
HIDDEN, MAX_POSITIONS = 64, 32  # the BERT example's --hidden-size, --max-position-embeddings
# training_log with the example's flags: learning_rate is not None, batch-size, each key of
# pretrain_bert.py's loss dict, --log-loss-scale-to-tensorboard's default, grad_norm is not
# None; each also '<tag> vs samples'. evaluate_and_print_results: '<key> validation' (+ vs
# samples) for each key.
BERT_TAGS = {f"{tag}{suffix}" for tag in (
    "learning-rate", "batch-size", "lm loss", "sop loss", "loss-scale", "grad-norm",
    "lm loss validation", "sop loss validation") for suffix in ("", " vs samples")}
# pretrain_bert.py's model_provider: BertModel(vocab_size=args.padded_vocab_size,
# max_sequence_length=args.max_position_embeddings, num_tokentypes=2 and add_binary_head with
# the binary head, tied output layer): the tensors whose shape those choose
BERT_SHAPES = {"embedding.word_embeddings.weight": (BERT_ROWS, HIDDEN),
               "output_layer.bias": (BERT_ROWS,),
               "embedding.position_embeddings.weight": (MAX_POSITIONS, HIDDEN),
               "embedding.tokentype_embeddings.weight": (2, HIDDEN),
               "binary_head.weight": (2, HIDDEN), "pooler.dense.weight": (HIDDEN, HIDDEN)}


def _strict_runs(port: int) -> set[int]:
    """The ranks that recorded collectives of the launch on ``port`` (strict mode's records;
    the run key starts with MASTER_PORT)."""
    ranks = set()
    for path in Path(os.environ["MEGATRON_2BW_STRICT_DIR"]).glob("comm-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["run"].startswith(f"{port}-"):
                ranks.add(record["rank"])
    return ranks


def _run_example(script: str, args: list[str], schedule: str, ranks: int = 2,
                 **env: str) -> launch.Launch:
    """``bash scripts/examples/<script> args`` (`_run_example_at`)."""
    return _run_example_at(EXAMPLES / script, args, schedule, ranks, **env)


def _run_example_at(script: Path, args: list[str], schedule: str, ranks: int = 2,
                    **env: str) -> launch.Launch:
    """``bash <script> args`` from the repository root, on a free port, with the test
    environment (one thread per process, strict mode); its torchrun forks the ranks
    (``launch.script_env``: the launcher is not what these tests check)."""
    port = launch.free_port()
    done = launch._run(["bash", str(script), *args], launch.script_env(
        MASTER_PORT=str(port), SCHEDULE=schedule, **env), timeout=240)
    assert done.returncode == 0, done.tail(60)
    if os.environ.get("MEGATRON_2BW_STRICT", "1") != "0":
        assert _strict_runs(port) == set(range(ranks)), "strict mode did not reach the launch"
    return done


def _assert_loss_falls(done: launch.Launch, iterations: int, rows: int = VOCAB) -> None:
    log = parse_log(done.output)
    losses = [r.loss for r in log.iterations]
    assert [r.iteration for r in log.iterations] == list(range(1, iterations + 1)), done.tail()
    assert losses[0] == pytest.approx(math.log(rows), rel=0.02), losses
    last_two = (losses[-1] + losses[-2]) / 2
    assert last_two <= (1 - MIN_RELATIVE_DROP) * losses[0], losses


@pytest.mark.parametrize("schedule", ["2bw"])
def test_gpt3_175b_shrunk(example_data, tmp_path, schedule):
    done = _run_example("train_gpt3_175b_distributed.sh", [
        str(tmp_path / "checkpoints"), str(tmp_path / "tensorboard"),
        str(example_data / "gpt2-vocab.json"), str(example_data / "gpt2-merges.txt"),
        str(example_data / "gpt3" / "my-gpt3_text_document"), *FP16_FASTER], schedule)
    _assert_loss_falls(done, 8)
    assert any(r.global_batch_size == 4 for r in parse_log(done.output).iterations), \
        "--rampup-batch-size 4 2 16 starts at 4 samples per batch"
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "8"


@pytest.mark.parametrize("schedule", ["2bw"])
def test_bert_340m_shrunk(example_data, tmp_path, schedule):
    done = _run_example("train_bert_340m_distributed.sh", [
        str(tmp_path / "checkpoints"), str(tmp_path / "tensorboard"),
        str(example_data / "bert-vocab.txt"), str(example_data / "bert" / "my-bert_text_sentence"),
        *FP16_FASTER], schedule)
    _assert_loss_falls(done, 8, rows=BERT_ROWS)
    assert f"training {schedule} schedule on 2 cpu processes: TP=1 PP=2 DP=1" in done.output
    assert set(_tensorboard_tags(tmp_path / "tensorboard")) == BERT_TAGS
    assert " sop loss: " in done.output and " sop loss value: " in done.output, done.tail()
    _assert_bert_checkpoint(tmp_path / "checkpoints" / "iter_0000008")


def _tensorboard_tags(directory: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return events.Tags()["scalars"]


def _assert_bert_checkpoint(path: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from tests.test_export_hf import MEGATRON_COMMON_KEYS

    common = dist_checkpointing.load_common_state_dict(str(path))
    assert MEGATRON_COMMON_KEYS <= set(common), sorted(common)
    args = common["args"]
    assert (args.padded_vocab_size, args.tokenizer_type, args.bert_binary_head) == \
        (BERT_ROWS, "BertWordPieceLowerCase", True)  # pretrain_bert.py's default type
    metadata = load_sharded_metadata(str(path))
    shapes = {key: tuple(metadata[key].global_shape) for key in BERT_SHAPES}
    assert shapes == BERT_SHAPES


@pytest.mark.parametrize("schedule", ["2bw"])
def test_llama3_8b_shrunk(example_data, tmp_path, schedule):
    done = _run_example("train_llama3_8b_h100_fp8.sh", [
        str(tmp_path / "checkpoints"), str(tmp_path / "tensorboard"),
        str(example_data / "llama3-tokenizer"), str(example_data / "llama3" / "my-llama3_text_document"),
        *FASTER, "--decoupled-lr", "1e-2"], schedule, DATA_CACHE_PATH=str(tmp_path / "cache"))
    _assert_loss_falls(done, 8)  # --train-samples 64 at 8 per batch


# training_log's tags with the Mixtral example's flags: those of test_llama3's run less the
# decoupled schedule's, plus track_moe_metrics' (no "vs samples" variant)
MOE_TAGS = {"load_balancing_loss"}


@pytest.mark.parametrize("schedule", ["2bw"])
def test_mixtral_8x7b_shrunk(tiny_gpt_data, tmp_path, schedule):
    """Megatron-LM's Mixtral example (8 experts, top-2, aux loss, alltoall, grouped GEMM,
    the distributed optimizer with both overlaps, bf16) on 4 processes, PP = 2 x EP = 2: its
    loss falls, and the log line and TensorBoard hold the load-balancing loss as Megatron-LM's
    training_log writes them. Llama2Tokenizer over the session's sentencepiece model (the
    dataset was tokenized by GPTSentencePieceTokenizer: megatron-core gives both the same
    ids); its 12 documents need --split 8,2,0 for a validation split (the original's
    99990,8,2 assumes a large corpus)."""
    done = _run_example("train_mixtral_8x7b_distributed.sh", [
        str(tmp_path / "checkpoints"), tiny_gpt_data.tokenizer_model, tiny_gpt_data.data_prefix,
        "--lr", "1e-2", "--data-cache-path", tiny_gpt_data.index_cache, "--split", "8,2,0"],
        schedule, ranks=4)
    _assert_loss_falls(done, 8, rows=tiny_gpt_data.vocab_size)
    assert "training " + schedule + " schedule on 4 cpu processes: TP=1 PP=2 DP=2" in done.output
    assert "note: --moe-grouped-gemm has no effect on CPU" in done.output
    lines = [line for line in done.output.splitlines() if " consumed samples: " in line]
    assert lines and all(" load_balancing_loss: " in line for line in lines), lines[-1:]
    assert MOE_TAGS <= set(_tensorboard_tags(tmp_path / "checkpoints" / "tensorboard"))


@pytest.mark.parametrize("variant,layout", [
    ("dense", "TP=2 PP=2 DP=2"), ("moe", "TP=1 PP=2 DP=4")])
def test_the_readmes_recommended_command(tiny_gpt_data, tmp_path, variant, layout):
    """scripts/train_recommended.sh as the README gives it (bf16, dist_muon, ef, 2bw, a
    Llama-style model; dense at TP=2 x PP=2 x DP=2, MoE at PP=2 x EP=2 x DP=4) on 8 processes:
    each exits 0, its loss falls and it saves its last iteration; the README names the script
    with both variants."""
    readme = (launch.REPO / "README.md").read_text()
    command = "bash scripts/train_recommended.sh"
    assert command in readme and f"MOE=1 {command}" in readme
    done = _run_example_at(launch.REPO / "scripts" / "train_recommended.sh", [
        str(tmp_path / "checkpoints"), tiny_gpt_data.tokenizer_model, tiny_gpt_data.data_prefix,
        "--lr", "1e-2", "--data-cache-path", tiny_gpt_data.index_cache, "--split", "8,2,0"],
        "2bw", ranks=8, **({"MOE": "1"} if variant == "moe" else {}))
    _assert_loss_falls(done, 8, rows=tiny_gpt_data.vocab_size)
    assert f"training 2bw schedule on 8 cpu processes: {layout}" in done.output
    assert "state sharded by layer over the data-parallel ranks" in done.output
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "8"
