"""Command-line flags: Megatron-LM's names for what Megatron-LM has, ours for the rest.

All consistency checks live in :func:`validate_args`; each failure raises :class:`FlagError`
naming the flag and printing every factor, and entry scripts turn it into one error line and a
non-zero exit on every rank, before any process group or model exists.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Sequence

__all__ = ["FlagError", "SCHEDULES", "build_parser", "parse_args", "validate_args"]

SCHEDULES = ("2bw", "flush", "gpipe", "naive", "megatron")


class FlagError(ValueError):
    """A bad command-line flag; ``str()`` is the one line the user sees."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


class _Parser(argparse.ArgumentParser):
    """argparse that raises FlagError instead of printing usage and exiting."""

    def error(self, message):
        # argparse's wording: "argument --num-layers: invalid int value: 'x'",
        # "unrecognized arguments: --foo 3"; the error line starts with the flag to fix.
        bad_value = re.match(r"argument ([^:/\s]+)\S*: (.*)", message)
        if bad_value:
            raise FlagError(bad_value.group(1), bad_value.group(2))
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            raise FlagError(unknown.group(1), f"unknown flag ({message}); see --help")
        raise FlagError("arguments", message)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"),
                   default="transformer_engine",
                   help="layer implementation; transformer_engine is used only on CUDA where "
                        "transformer_engine imports, the local spec otherwise (said on rank 0)")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default="megatron",
                   help="2bw: PipeDream-2BW; flush: PipeDream-Flush; gpipe; naive: inter-layer "
                        "model parallelism without pipelining; megatron: Megatron's own 1F1B")
    g.add_argument("--no-deferred-step", action="store_true",
                   help="2bw: run the optimizer step where the training loop calls it; by "
                        "default a step with gradient clipping or tied embeddings is deferred "
                        "to its first reader so that its pipeline-wide all-reduces do not stall "
                        "the stages (one extra fp32 gradient copy per stage)")
    g.add_argument("--cpu", action="store_true",
                   help="train on CPU processes over gloo even where CUDA is available")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="bound on every wait of every process group (the default group and "
                        "megatron-core's model-parallel groups); fractions allowed")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch x data-parallel size")
    g.add_argument("--train-iters", type=int, default=200)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine",
                                                "inverse-square-root"), default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale for --fp16; dynamic when not given")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="dynamic fp16 loss scaling: steps between scale increases; as many "
                        "consecutive skipped steps end the run as diverged")
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_true",
                   help="keep training on a non-finite loss or gradient norm (checked every "
                        "iteration by default)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefix, or a blend 'weight prefix weight prefix ...'")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default="GPTSentencePieceTokenizer",
                   choices=("GPTSentencePieceTokenizer", "SentencePieceTokenizer",
                            "NullTokenizer"))
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true",
                   help="random tokens instead of --data-path (smoke tests)")


def _add_logging_and_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--overwrite-save", action="store_true",
                   help="allow a run that starts from scratch to save into a --save directory "
                        "that holds another run's checkpoints")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving) when the iteration is a multiple of this")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")


def build_parser(description: str = "Pretrain a model with megatron-2bw") -> argparse.ArgumentParser:
    parser = _Parser(description=description, allow_abbrev=False)
    _add_model_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_logging_and_checkpoint_args(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and validate; ``world_size`` defaults to torchrun's WORLD_SIZE (1 without it)."""
    args = (parser or build_parser()).parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return validate_args(args, world_size)


def _require(condition: bool, flag: str, message: str) -> None:
    if not condition:
        raise FlagError(flag, message)


def _validate_layout(args: argparse.Namespace) -> None:
    """world = TP x PP x DP; layers split evenly over stages; heads over TP ranks."""
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    _require(tp >= 1, "--tensor-model-parallel-size", f"must be >= 1, got {tp}")
    _require(pp >= 1, "--pipeline-model-parallel-size", f"must be >= 1, got {pp}")
    _require(world % (tp * pp) == 0, "--tensor-model-parallel-size",
             f"world size {world} is not divisible by tensor ({tp}) x pipeline ({pp}) = {tp * pp}")
    args.data_parallel_size = world // (tp * pp)
    _require(args.num_layers % pp == 0, "--num-layers",
             f"{args.num_layers} layers do not split evenly over {pp} pipeline stages")
    _require(args.num_attention_heads % tp == 0, "--num-attention-heads",
             f"{args.num_attention_heads} heads are not divisible by tensor-parallel size {tp}")
    _require(args.hidden_size % args.num_attention_heads == 0, "--hidden-size",
             f"{args.hidden_size} is not divisible by {args.num_attention_heads} heads")


def _validate_batch(args: argparse.Namespace) -> None:
    """global batch = micro batch x DP x microbatches; 2BW needs microbatches >= depth."""
    b, dp, pp = args.micro_batch_size, args.data_parallel_size, args.pipeline_model_parallel_size
    _require(b >= 1, "--micro-batch-size", f"must be >= 1, got {b}")
    if args.global_batch_size is None:
        args.global_batch_size = b * dp
    B = args.global_batch_size
    _require(B % (b * dp) == 0, "--global-batch-size",
             f"{B} is not divisible by micro batch ({b}) x data-parallel size ({dp}) = {b * dp}")
    args.num_microbatches = B // (b * dp)
    m = args.num_microbatches
    if args.pipeline_schedule == "2bw":
        _require(not args.use_distributed_optimizer, "--use-distributed-optimizer",
                 "not supported with --pipeline-schedule 2bw (its parameter all-gather writes "
                 "the shared parameter buffer, which 2BW's two weight versions cannot share)")
        _require(m >= pp, "--global-batch-size",
                 f"2bw needs microbatches per batch m = {B} / ({b} x {dp}) = {m} >= pipeline "
                 f"depth {pp}; raise --global-batch-size to at least {b * dp * pp}")


def _validate_training(args: argparse.Namespace) -> None:
    _require(args.train_iters >= 1, "--train-iters", f"must be >= 1, got {args.train_iters}")
    _require(0 < args.distributed_timeout_minutes < float("inf"),
             "--distributed-timeout-minutes",
             f"must be a finite number > 0, got {args.distributed_timeout_minutes}")
    _require(not (args.bf16 and args.fp16), "--bf16", "--bf16 and --fp16 are exclusive")
    _require(0 < args.lr < float("inf"), "--lr", f"must be a finite number > 0, got {args.lr}")
    _require(args.loss_scale_window >= 1, "--loss-scale-window",
             f"must be >= 1, got {args.loss_scale_window}")
    _require(args.hysteresis >= 1, "--hysteresis", f"must be >= 1, got {args.hysteresis}")
    _require(0 <= args.min_lr <= args.lr, "--min-lr",
             f"must lie in [0, --lr={args.lr}], got {args.min_lr}")
    _require(args.lr_warmup_iters >= 0, "--lr-warmup-iters", "must be >= 0")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    _require(args.lr_warmup_iters <= args.lr_decay_iters, "--lr-warmup-iters",
             f"{args.lr_warmup_iters} warm-up iterations exceed {args.lr_decay_iters} decay "
             "iterations")
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    _require(args.seq_length <= args.max_position_embeddings, "--seq-length",
             f"{args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None, "--recompute-method",
                 "required with --recompute-granularity full (uniform or block)")
        layers_per_stage = args.num_layers // args.pipeline_model_parallel_size
        args.recompute_num_layers = args.recompute_num_layers or 1
        _require(1 <= args.recompute_num_layers <= layers_per_stage, "--recompute-num-layers",
                 f"must lie in [1, {layers_per_stage}] (layers per stage), got "
                 f"{args.recompute_num_layers}")
    elif args.recompute_method is not None:
        _require(False, "--recompute-method", "only valid with --recompute-granularity full")
    for flag in ("log_interval", "eval_interval"):
        _require(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')}", "must be >= 1")
    _require(args.eval_iters >= 0, "--eval-iters", "must be >= 0")
    if args.save_interval is not None:
        _require(args.save is not None, "--save-interval", "needs --save DIR")
        _require(args.save_interval >= 1, "--save-interval", "must be >= 1")


def _validate_data(args: argparse.Namespace) -> None:
    """Data and tokenizer files must exist before any process group starts."""
    if args.mock_data:
        args.vocab_size = args.vocab_size or 1024
        return
    _require(args.data_path is not None, "--data-path",
             "required (an indexed dataset prefix from tools/preprocess_data.py), or --mock-data")
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None, "--vocab-size", "required with NullTokenizer")
        return
    _require(args.tokenizer_model is not None, "--tokenizer-model",
             f"required with --tokenizer-type {args.tokenizer_type}")
    _require(os.path.isfile(args.tokenizer_model), "--tokenizer-model",
             f"no such file: {args.tokenizer_model}")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check every flag against the others; fill derived fields (data_parallel_size,
    num_microbatches, ...). Raises FlagError naming the first bad flag."""
    args.world_size = world_size
    _validate_layout(args)
    _validate_batch(args)
    _validate_training(args)
    _validate_data(args)
    return args
