"""Logging, evaluation and checkpoint flags (their few rules run in
``training._validate_training``)."""

from __future__ import annotations

import argparse

from megatron_2bw.arguments.common import _COUNT, _NONNEG, _POSITIVE


def _add_logging_and_checkpoint_args(p: argparse.ArgumentParser) -> None:
    def torch_dist_only(text: str) -> str:
        """--ckpt-format takes Megatron-LM's values, of which we write torch_dist only."""
        if text != "torch_dist":
            raise argparse.ArgumentTypeError(f"only torch_dist is supported, got {text!r}")
        return text

    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=_COUNT, default=10)
    g.add_argument("--eval-interval", type=_COUNT, default=100)
    g.add_argument("--eval-iters", type=_NONNEG, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    # Megatron-LM's logging flags, defaults as in its LoggerConfig (training_config.py);
    # what each writes: megatron_2bw/training/logs.py
    g.add_argument("--tensorboard-log-interval", type=_COUNT, default=1)
    g.add_argument("--tensorboard-queue-size", type=_COUNT, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0)
    g.add_argument("--timing-log-option", choices=("max", "minmax", "all"), default="minmax")
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=_COUNT, default=None)
    g.add_argument("--ckpt-keep", type=_COUNT, default=None,
                   help="keep only the N newest checkpoints in --save (older ones are deleted "
                        "once a newer one is complete); default: keep all")
    g.add_argument("--overwrite-save", action="store_true",
                   help="allow a run that starts from scratch to save into a --save directory "
                        "that holds another run's checkpoints")
    g.add_argument("--exit-interval", type=_COUNT, default=None,
                   help="stop (after saving) when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=_POSITIVE, default=None,
                   help="stop (after saving) once training has run this long; checked every "
                        "iteration on every rank")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="accepted for Megatron-LM's command lines: SIGTERM and SIGINT are "
                        "always handled (save, then exit 0)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true",
                   help="leave the optimizer and learning-rate schedule out of checkpoints")
    g.add_argument("--no-save-rng", action="store_true",
                   help="leave the RNG state out of checkpoints")
    g.add_argument("--ckpt-format", type=torch_dist_only, default="torch_dist",
                   help="accepted for Megatron-LM's command lines: checkpoints are always "
                        "torch_dist (megatron-core's dist_checkpointing)")
    schedule = g.add_mutually_exclusive_group()
    schedule.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                          dest="override_opt_param_scheduler", action="store_true",
                          help="on --load, take the learning-rate schedule from the flags, "
                               "not from the checkpoint")
    schedule.add_argument("--use-checkpoint-opt_param-scheduler",
                          "--use-checkpoint-opt-param-scheduler",
                          dest="use_checkpoint_opt_param_scheduler", action="store_true",
                          help="on --load, take the learning-rate schedule from the "
                               "checkpoint; by default the two must agree (as in Megatron-LM)")
