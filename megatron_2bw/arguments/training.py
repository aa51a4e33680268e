"""Training flags (batch, length, learning rate, precision, recomputation) with the runtime
ones (garbage collection, memory, profiling), and `_validate_training`, which also runs the
optimizer's, precision's and PipeMare's checks in that fixed order."""

from __future__ import annotations

import argparse

from megatron_2bw.arguments.common import (_COUNT, _NONNEG, _POSITIVE, _PROBABILITY, _refuse,
                                           _require)
from megatron_2bw.arguments.optimizer import (_add_muon_args, _validate_muon,
                                              _validate_stale_correction)
from megatron_2bw.arguments.precision import _validate_low_precision_weights
from megatron_2bw.flag_types import number_in
from megatron_2bw.schedules.requirements import recompute_problem


MAX_TRAIN_SAMPLES = 2 ** 40
"""More training samples than this (beyond any real run) are refused: the dataset indices
for all of them are built before the first iteration."""


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=_COUNT, default=4)
    g.add_argument("--global-batch-size", type=_COUNT, default=None,
                   help="default: micro batch x data-parallel size")
    g.add_argument("--rampup-batch-size", nargs=3, type=_COUNT, default=None,
                   metavar=("START", "INCREMENT", "RAMPUP_SAMPLES"),
                   help="grow the global batch from START by INCREMENT up to "
                        "--global-batch-size over RAMPUP_SAMPLES samples (megatron-core's "
                        "num_microbatches_calculator); needs --train-samples")
    g.add_argument("--train-iters", type=_COUNT, default=None,
                   help="iterations to train (exclusive with --train-samples; one is required)")
    g.add_argument("--train-samples", type=_COUNT, default=None,
                   help="samples to train (exclusive with --train-iters; one is required)")
    g.add_argument("--optimizer", choices=("adam", "sgd", "muon", "dist_muon"), default="adam",
                   help="muon: Muon for the hidden layers' matrices, Adam for embeddings, "
                        "output layer, norms and biases (megatron-core's split; "
                        "docs/megatron_lm_compatibility.md says which Muon runs)")
    _add_muon_args(g)
    g.add_argument("--lr", type=_POSITIVE, default=None, help="required")
    g.add_argument("--min-lr", type=number_in(0), default=0.0)
    g.add_argument("--decoupled-lr", type=_POSITIVE, default=None,
                   help="learning rate of the input embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=number_in(0), default=None,
                   help="minimum learning rate of the input embedding and output layer")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine",
                                                "inverse-square-root", "WSD"), default="cosine")
    g.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine",
                                                    "minus_sqrt"), default="exponential",
                   help="decay of WSD's annealing phase")
    g.add_argument("--lr-wsd-decay-iters", type=_COUNT, default=None,
                   help="iterations of WSD's annealing phase (with --train-iters)")
    g.add_argument("--lr-wsd-decay-samples", type=_COUNT, default=None,
                   help="samples of WSD's annealing phase (with --train-samples)")
    g.add_argument("--lr-warmup-iters", type=_NONNEG, default=0)
    g.add_argument("--lr-warmup-fraction", type=number_in(0, 1), default=None,
                   help="warm-up as a fraction of the decay iterations or samples (instead of "
                        "--lr-warmup-iters / --lr-warmup-samples)")
    g.add_argument("--lr-decay-iters", type=_COUNT, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-samples", type=_NONNEG, default=0,
                   help="warm-up samples (with --train-samples)")
    g.add_argument("--lr-decay-samples", type=_COUNT, default=None,
                   help="default: --train-samples")
    g.add_argument("--weight-decay", type=number_in(0), default=0.01)
    g.add_argument("--clip-grad", type=number_in(0), default=1.0)
    g.add_argument("--adam-beta1", type=_PROBABILITY, default=0.9)
    g.add_argument("--adam-beta2", type=_PROBABILITY, default=0.999)
    g.add_argument("--adam-eps", type=_POSITIVE, default=1e-8)
    g.add_argument("--seed", type=_NONNEG, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=_POSITIVE, default=None,
                   help="static loss scale for --fp16; dynamic when not given")
    g.add_argument("--initial-loss-scale", type=_POSITIVE, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=_POSITIVE, default=1.0)
    g.add_argument("--loss-scale-window", type=_COUNT, default=1000,
                   help="dynamic fp16 loss scaling: steps between scale increases; as many "
                        "consecutive skipped steps end the run as diverged")
    g.add_argument("--hysteresis", type=_COUNT, default=2)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_true",
                   help="keep training on a non-finite loss or gradient norm (checked every "
                        "iteration by default)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=_COUNT, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    _add_runtime_args(p)


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's garbage-collection, memory and profiling flags (its "training" and
    "profiling" groups), as its training.py uses them."""
    g = p.add_argument_group("garbage collection, memory, profiling")
    g.add_argument("--manual-gc", action="store_true",
                   help="gc.disable(); collect every --manual-gc-interval iterations")
    g.add_argument("--manual-gc-interval", type=_NONNEG, default=0,
                   help="with --manual-gc: iterations between gc.collect() (0: never)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false",
                   dest="manual_gc_eval", help="with --manual-gc: no collection around "
                                               "evaluations")
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="torch.cuda.empty_cache() after the optimizer step (1) and after "
                        "evaluation (2); no effect on the CPU")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations [--profile-step-start, --profile-step-end)")
    g.add_argument("--profile-step-start", type=_NONNEG, default=10)
    g.add_argument("--profile-step-end", type=_NONNEG, default=12)
    g.add_argument("--profile-ranks", type=_NONNEG, nargs="+", default=[0])
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="torch.profiler, trace written into --tensorboard-dir (without it "
                        "--profile is nsys's, which has no effect on the CPU)")


def _validate_training_length(args: argparse.Namespace) -> None:
    """Exactly one of --train-iters / --train-samples, with the learning-rate flags of its unit
    (``validate_args`` in Megatron-LM's megatron/training/arguments.py at core_v0.16.1;
    --lr-warmup-fraction goes with either). With --train-samples, ``train_iters`` is derived
    as Megatron-LM's ``update_train_iters`` derives it (training.py): the ramp's batches, then
    whole batches of --global-batch-size (a partial last batch is dropped)."""
    iters, samples = args.train_iters, args.train_samples
    _require(iters is not None or samples is not None, "--train-iters",
             "one of --train-iters and --train-samples is required")
    unit, other = ("--train-iters", "--train-samples") if iters is not None else \
        ("--train-samples", "--train-iters")
    _require(iters is None or samples is None, "--train-samples",
             "--train-iters and --train-samples are exclusive")
    wrong_unit = {  # flag given -> the unit it needs
        "--lr-decay-samples": args.lr_decay_samples is not None,
        "--lr-warmup-samples": args.lr_warmup_samples != 0,
        "--lr-wsd-decay-samples": args.lr_wsd_decay_samples is not None,
    } if iters is not None else {
        "--lr-decay-iters": args.lr_decay_iters is not None,
        "--lr-warmup-iters": args.lr_warmup_iters != 0,
        "--lr-wsd-decay-iters": args.lr_wsd_decay_iters is not None,
    }
    for flag, given in wrong_unit.items():
        _require(not given, flag, f"not with {unit} (use the {unit.split('-')[-1]} flag; "
                 f"this one goes with {other})")
    if args.lr_warmup_fraction is not None:
        warmup = "--lr-warmup-iters" if iters is not None else "--lr-warmup-samples"
        _require(args.lr_warmup_iters == 0 and args.lr_warmup_samples == 0,
                 "--lr-warmup-fraction", f"give --lr-warmup-fraction or {warmup}, not both")
    if args.lr_decay_style == "WSD":
        wsd = "--lr-wsd-decay-iters" if iters is not None else "--lr-wsd-decay-samples"
        _require(args.lr_wsd_decay_iters is not None or args.lr_wsd_decay_samples is not None,
                 wsd, "required with --lr-decay-style WSD (the annealing phase's length)")
    if samples is not None:
        _require(samples <= MAX_TRAIN_SAMPLES, "--train-samples",
                 f"{samples} samples exceed {MAX_TRAIN_SAMPLES:.2e} (the data indices are "
                 "built up front)")
        args.train_iters = _iterations_for_samples(args)
        _require(args.train_iters >= 1, "--train-samples",
                 f"{samples} samples do not fill one batch of {args.global_batch_size}")
    _require(args.train_iters * args.global_batch_size <= MAX_TRAIN_SAMPLES, "--train-iters",
             f"{args.train_iters} iterations of {args.global_batch_size} samples exceed "
             f"{MAX_TRAIN_SAMPLES:.2e} samples (the data indices are built up front)")


def _iterations_for_samples(args: argparse.Namespace) -> int:
    """Megatron-LM's ``update_train_iters``: count the ramp's iterations with megatron-core's
    calculator (while consumed <= ramp-up samples and <= --train-samples), then add whole
    batches of --global-batch-size."""
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator)

    start, increment, rampup_samples = args.rampup_batch_size
    ramp = RampupBatchsizeNumMicroBatchesCalculator(
        args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
        decrease_batch_size_if_needed=False, rank=-1, start_global_batch_size=start,
        batch_size_increment=increment, ramup_samples=rampup_samples)
    iterations = consumed = 0
    while consumed <= rampup_samples and consumed <= args.train_samples:
        ramp.update(consumed, consistency_check=False)
        consumed += ramp.get_current_global_batch_size()
        iterations += 1
    return iterations + max(args.train_samples - consumed, 0) // args.global_batch_size


def _validate_training(args: argparse.Namespace) -> None:
    _validate_training_length(args)
    _require(not (args.bf16 and args.fp16), "--bf16", "--bf16 and --fp16 are exclusive")
    _require(args.min_lr <= args.lr, "--min-lr",
             f"must lie in [0, --lr={args.lr}], got {args.min_lr}")
    _require(args.seed < 2 ** 31, "--seed", f"must be < 2**31 (numpy's seeds), got {args.seed}")
    _require(args.min_loss_scale <= args.initial_loss_scale, "--min-loss-scale",
             f"{args.min_loss_scale:g} exceeds --initial-loss-scale {args.initial_loss_scale:g}")
    if args.train_samples is None:
        args.lr_decay_iters = args.lr_decay_iters or args.train_iters
        # megatron-core's OptimizerParamScheduler asserts warm-up < decay steps
        _require(args.lr_warmup_iters < args.lr_decay_iters, "--lr-warmup-iters",
                 f"{args.lr_warmup_iters} warm-up iterations must be fewer than the "
                 f"{args.lr_decay_iters} decay iterations (--lr-decay-iters, else --train-iters)")
    else:
        args.lr_decay_samples = args.lr_decay_samples or args.train_samples
        _require(args.lr_warmup_samples < args.lr_decay_samples, "--lr-warmup-samples",
                 f"{args.lr_warmup_samples} warm-up samples must be fewer than the "
                 f"{args.lr_decay_samples} decay samples (--lr-decay-samples, else "
                 "--train-samples)")
    _require(args.seq_length <= args.max_position_embeddings, "--seq-length",
             f"{args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None, "--recompute-method",
                 "required with --recompute-granularity full (uniform or block)")
        args.recompute_num_layers = args.recompute_num_layers or 1
        _validate_recompute_layers(args)
    elif args.recompute_method is not None:
        _require(False, "--recompute-method", "only valid with --recompute-granularity full")
    if args.recompute_granularity is not None:
        _refuse(recompute_problem(args.pipeline_schedule))
    _validate_pipemare(args)
    _validate_muon(args)
    _validate_stale_correction(args)
    from megatron_2bw.runtime.device import device_kind

    _validate_low_precision_weights(args, on_cuda=device_kind(args.cpu) == "cuda")
    if args.save_interval is not None:
        _require(args.save is not None, "--save-interval", "needs --save DIR")
    if args.ckpt_keep is not None:
        _require(args.save is not None, "--ckpt-keep", "needs --save DIR")


def _validate_recompute_layers(args: argparse.Namespace) -> None:
    """--recompute-num-layers N within the layers of a model chunk: at most the fullest
    chunk's; with --recompute-method uniform megatron-core recomputes groups of N layers and
    indexes past a chunk whose layers are not a multiple of N, so N divides every chunk's."""
    n, chunks = args.recompute_num_layers, args.pipeline_layer_split
    most = max(chunks)
    _require(1 <= n <= most, "--recompute-num-layers",
             f"must lie in [1, {most}] (layers per model chunk), got {n}")
    if args.recompute_method == "uniform":
        odd = sorted({c for c in chunks if c % n})
        _require(not odd, "--recompute-num-layers",
                 f"--recompute-method uniform recomputes groups of {n} layers, and model "
                 f"chunks of {', '.join(map(str, odd))} layers are not a multiple of it")


def _validate_pipemare(args: argparse.Namespace) -> None:
    """The --pipemare-* flags need --pipeline-schedule pipemare."""
    given = [flag for flag, off in (("--pipemare-discrepancy-decay", None),
                                    ("--pipemare-lr-warmup-steps", 0),
                                    ("--pipemare-sync-iters", 0))
             if getattr(args, flag[2:].replace("-", "_")) != off]
    for flag in given:
        _require(args.pipeline_schedule == "pipemare", flag,
                 f"only with --pipeline-schedule pipemare, not {args.pipeline_schedule}")
