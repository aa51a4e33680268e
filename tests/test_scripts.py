"""The launchers in scripts/: every dry run prints a command that our own flag validation accepts
for its layout (world size = the torchrun/srun nodes x processes per node it prints).

No training: each script runs with DRY_RUN=1 (it only prints), the printed flags after the
pretrain script go through the entry script's parser and ``validate_args``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_2bw.arguments import FlagError, build_parser, validate_args

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
PAPER_MODELS = ("gpt-1.3b", "gpt-2.2b", "gpt-3.9b", "bert-2.2b", "bert-3.8b")
SCHEDULES = ("megatron", "naive", "gpipe", "flush", "2bw")
# the variables the scripts read: a caller's own settings must not leak into the tests
_SCRIPT_VARS = ("MODEL", "SCHEDULE", "NODES", "GPUS_PER_NODE", "TP", "PP", "MICRO_BATCH",
                "GLOBAL_BATCH", "SEQ_LENGTH", "TRAIN_ITERS", "LR", "MIN_LR", "WARMUP_ITERS",
                "CLIP_GRAD", "UNTIE", "PRECISION", "RECOMPUTE", "LOG_INTERVAL", "EVAL_INTERVAL",
                "EVAL_ITERS", "SAVE", "LOAD", "SAVE_INTERVAL", "DATA_PATH", "TOKENIZER_MODEL",
                "TOKENIZER_TYPE", "MOCK_DATA", "VOCAB_SIZE", "CPU", "DRY_RUN", "REPO",
                "SCHEDULES", "LOG_DIR", "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_JOB_NODELIST",
                "SLURM_GPUS_ON_NODE", "TORCHRUN", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                "NNODES", "RDZV_ADDR", "RDZV_TIMEOUT", "REQUEUE_EXIT", "SLURM_RESTART_COUNT")


def _dry_run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in _SCRIPT_VARS}
    clean.update(DRY_RUN="1", **env)
    return subprocess.run(["bash", str(SCRIPTS / script), *args], env=clean,
                          capture_output=True, text=True, timeout=30)


def _commands(done: subprocess.CompletedProcess) -> list[list[str]]:
    assert done.returncode == 0, done.stderr
    return [shlex.split(line[2:]) for line in done.stdout.splitlines() if line.startswith("+ ")]


def _launch(command: list[str]) -> tuple[str, list[str], int]:
    """(gpt|bert, flags after the pretrain script, nodes x processes per node)."""
    index = next(i for i, word in enumerate(command)
                 if Path(word).name in ("pretrain_gpt_2bw.py", "pretrain_bert_2bw.py"))
    launcher = command[:index]
    world = (int(launcher[launcher.index("--nnodes") + 1])
             * int(launcher[launcher.index("--nproc-per-node") + 1]))
    return Path(command[index]).name.split("_")[1], command[index + 1:], world


_BERT_PARSER = None


def _parser(kind: str):
    """The entry script's parser: BERT's adds its own flags."""
    global _BERT_PARSER
    if kind == "gpt":
        return build_parser()
    if _BERT_PARSER is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("_pretrain_bert_2bw",
                                                      REPO / "pretrain_bert_2bw.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _BERT_PARSER = module.parser
    return _BERT_PARSER()


def _validated(command: list[str]):
    kind, flags, world = _launch(command)
    return kind, validate_args(_parser(kind).parse_args(flags), world), world


def _single(done) -> list[str]:
    commands = _commands(done)
    assert len(commands) == 1, done.stdout
    return commands[0]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", PAPER_MODELS)
def test_torchrun_dry_run_passes_validation(model, schedule):
    kind, args, world = _validated(_single(
        _dry_run("train_torchrun.sh", MODEL=model, SCHEDULE=schedule, MOCK_DATA="1")))
    assert kind == model.split("-")[0] and world == 8
    assert args.pipeline_schedule == schedule and args.seq_length == 512
    if schedule == "megatron":  # Megatron tensor MP over the node
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (8, 1)
    else:
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 8)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", PAPER_MODELS)
def test_slurm_dry_run_passes_validation_on_eight_nodes(model, schedule):
    command = _single(_dry_run("train_slurm.sbatch", MODEL=model, SCHEDULE=schedule,
                               NODES="8", MOCK_DATA="1"))
    assert command[0] == "srun"
    kind, args, world = _validated(command)
    assert world == 64 and args.data_parallel_size == 8
    assert args.pipeline_schedule == schedule


def test_slurm_script_asks_for_no_gpus_and_bounds_the_rendezvous():
    """A cluster without GPU resources refuses a job that asks for GPUs: the script asks for
    none (sbatch --gpus-per-node does); a node lost at the rendezvous ends the step."""
    text = (SCRIPTS / "train_slurm.sbatch").read_text()
    assert "#SBATCH --gpus" not in text and "#SBATCH --gres" not in text
    command = _single(_dry_run("train_slurm.sbatch", NODES="2", GPUS_PER_NODE="2", CPU="1",
                               MODEL="gpt-tiny", PRECISION="fp32", MOCK_DATA="1",
                               RDZV_TIMEOUT="60"))
    assert "--kill-on-bad-exit=1" in command and "join_timeout=60" in command
    _, args, world = _validated(command)
    assert world == 4 and args.cpu and args.pipeline_model_parallel_size == 2


def test_nnodes_is_read_as_nodes():
    _, args, world = _validated(_single(_dry_run(
        "train_torchrun.sh", NNODES="2", NODE_RANK="1", GPUS_PER_NODE="1", PP="2",
        MODEL="gpt-tiny", CPU="1", PRECISION="fp32", MOCK_DATA="1")))
    assert world == 2 and args.pipeline_model_parallel_size == 2


def test_model_shapes_have_the_parameter_counts_they_are_named_for():
    from megatron_2bw.planner import ModelSpec

    for model in PAPER_MODELS:
        kind, args, _ = _validated(_single(
            _dry_run("train_torchrun.sh", MODEL=model, SCHEDULE="2bw", MOCK_DATA="1")))
        billions = float(model.split("-")[1].rstrip("b"))
        count = ModelSpec.from_args(args, kind).num_parameters() / 1e9
        assert abs(count - billions) / billions < 0.05, (model, count)


def test_layout_and_batch_variables_reach_the_flags(tmp_path):
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"not read by validation")
    command = _single(_dry_run(
        "train_torchrun.sh", "--exit-interval", "7", MODEL="gpt-2.2b", SCHEDULE="2bw",
        GPUS_PER_NODE="4", TP="2", PP="2", MICRO_BATCH="1", GLOBAL_BATCH="8",
        DATA_PATH=str(tmp_path / "corpus_text_document"), TOKENIZER_MODEL=str(tokenizer),
        PRECISION="bf16", RECOMPUTE="1", UNTIE="1", CLIP_GRAD="0"))
    _, args, world = _validated(command)
    assert world == 4
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.data_parallel_size, args.num_microbatches) == (2, 2, 1, 8)
    assert args.bf16 and args.recompute_granularity == "full" and args.clip_grad == 0
    assert args.untie_embeddings_and_output_weights and args.exit_interval == 7
    assert args.data_path == [str(tmp_path / "corpus_text_document")]


def test_validation_catches_a_layout_the_world_cannot_hold():
    command = _single(_dry_run("train_torchrun.sh", MODEL="gpt-1.3b", SCHEDULE="2bw",
                               GPUS_PER_NODE="8", PP="16", MOCK_DATA="1"))
    with pytest.raises(FlagError, match="not divisible"):
        _validated(command)


def test_cpu_tiny_baselines_dry_run_prints_five_valid_runs_and_the_comparison():
    done = _dry_run("baselines.sh", MODEL="gpt-tiny", GPUS_PER_NODE="2", CPU="1",
                    PRECISION="fp32", MOCK_DATA="1", GLOBAL_BATCH="16", TP="4")
    commands = _commands(done)
    runs, compare = commands[:-1], commands[-1]
    layouts = {}
    for command in runs:
        _, args, world = _validated(command)
        assert world == 2 and args.cpu and args.clip_grad == 0
        assert args.untie_embeddings_and_output_weights and args.eval_iters == 0
        layouts[args.pipeline_schedule] = (args.tensor_model_parallel_size,
                                           args.pipeline_model_parallel_size)
    assert layouts == {"megatron": (2, 1), "naive": (1, 2), "gpipe": (1, 2), "flush": (1, 2),
                       "2bw": (1, 2)}
    assert Path(compare[1]).name == "compare.py" and "--from-logs" in compare


@pytest.mark.parametrize("script", ["train_torchrun.sh", "train_slurm.sbatch", "baselines.sh"])
@pytest.mark.parametrize("env, message", [
    ({"MODEL": "gpt-175b", "MOCK_DATA": "1"}, "MODEL=gpt-175b"),
    ({"SCHEDULE": "1f1b", "MOCK_DATA": "1"}, "SCHEDULE=1f1b"),
    ({}, "DATA_PATH"),
])
def test_bad_settings_fail_with_one_line_and_print_no_command(script, env, message):
    if script == "baselines.sh" and "SCHEDULE" in env:
        env = {"SCHEDULES": "2bw " + env["SCHEDULE"], "MOCK_DATA": "1"}
    done = _dry_run(script, **env)
    assert done.returncode == 2
    assert not any(line.startswith("+ ") for line in done.stdout.splitlines())
    assert done.stderr.strip().startswith("error: ") and message in done.stderr


@pytest.mark.parametrize("kind, files, expected", [
    ("gpt", ("--vocab-file", "--merge-file"), "GPT2BPETokenizer"),  # pretrain_gpt.py's args_defaults
    ("bert", ("--vocab-file",), "BertWordPieceLowerCase"),  # pretrain_bert.py's args_defaults
    ("gpt", ("--tokenizer-model",), "GPTSentencePieceTokenizer"),  # Megatron-LM refuses these two
    ("bert", ("--tokenizer-model",), "SentencePieceTokenizer"),
])
def test_entry_scripts_default_the_tokenizer_type_as_megatron_lm(tmp_path, kind, files, expected):
    """Megatron-LM's example commands give no --tokenizer-type: its entry scripts default it
    (core_v0.16.1 pretrain_gpt.py / pretrain_bert.py ``args_defaults``)."""
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--lr", "1e-3",
             "--micro-batch-size", "1", "--train-iters", "2", "--data-path", str(tmp_path / "corpus")]
    for flag in files:
        path = tmp_path / flag[2:]
        path.write_text("not read by validation")
        flags += [flag, str(path)]
    assert validate_args(_parser(kind).parse_args(flags), 1).tokenizer_type == expected
