"""`validate_args`: every rule, in a fixed order (later checks read what earlier ones
derive: data_parallel_size, num_microbatches, the layers' split), and Megatron-LM's required
flags (`_validate_required`)."""

from __future__ import annotations

import argparse

from megatron_2bw.arguments.common import _require
from megatron_2bw.arguments.data import _validate_data
from megatron_2bw.arguments.model import _validate_model_features
from megatron_2bw.arguments.moe import _validate_moe, _validate_moe_placement
from megatron_2bw.arguments.optimizer import _validate_ddp, _validate_layer_wise_muon
from megatron_2bw.arguments.parallel import (_validate_batch, _validate_layout,
                                             _validate_virtual_stages)
from megatron_2bw.arguments.training import _validate_training


_REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads",
             "--max-position-embeddings", "--seq-length", "--lr")


def _validate_required(args: argparse.Namespace) -> None:
    """Megatron-LM's required flags (its validate_args at core_v0.16.1: required_args, and
    --seq-length, which it asserts unless --encoder-seq-length stands in; --lr defaults to None, which leaves the
    schedule without a peak learning rate)."""
    for flag in _REQUIRED:
        _require(getattr(args, flag[2:].replace("-", "_")) is not None, flag,
                 "required (as in Megatron-LM)")
    _require(args.context_parallel_size == 1, "--context-parallel-size",
             "context parallelism needs transformer-engine attention on CUDA, which "
             "megatron-2bw's schedules do not set up (only 1)")
    if args.decoupled_min_lr is not None:
        _require(args.decoupled_lr is not None, "--decoupled-min-lr", "needs --decoupled-lr")
        _require(args.decoupled_min_lr <= args.decoupled_lr, "--decoupled-min-lr",
                 f"must lie in [0, --decoupled-lr={args.decoupled_lr}], got "
                 f"{args.decoupled_min_lr}")
    if args.profile and args.use_pytorch_profiler:
        _require(args.tensorboard_dir is not None, "--use-pytorch-profiler",
                 "needs --tensorboard-dir (the trace is written there, as in Megatron-LM)")
    if args.profile:
        _require(args.profile_step_start < args.profile_step_end, "--profile-step-end",
                 f"must exceed --profile-step-start {args.profile_step_start}, got "
                 f"{args.profile_step_end}")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check every flag against the others; fill derived fields (data_parallel_size,
    num_microbatches, ...). Raises FlagError naming the first bad flag."""
    args.world_size = world_size
    _validate_required(args)
    _validate_layout(args)
    _validate_model_features(args)
    _validate_moe(args)
    _validate_batch(args)
    _validate_virtual_stages(args)
    _validate_moe_placement(args)
    _validate_layer_wise_muon(args)
    _validate_ddp(args)
    _validate_training(args)
    _validate_data(args)
    return args
