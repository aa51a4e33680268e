"""FP8/FP4 recipes: refused under the schedules that keep weight versions, on CUDA only."""

from __future__ import annotations

import argparse

from megatron_2bw import schedules
from megatron_2bw.arguments.common import _require


def _validate_low_precision_weights(args: argparse.Namespace, on_cuda: bool) -> None:
    """FP8/FP4 (transformer-engine) only under schedules with one weight version per batch:
    transformer-engine casts a weight to FP8 when a microbatch passes ``is_first_microbatch``
    and caches the cast in place for the batch's other microbatches, so under 2bw, pipedream
    and pipemare the look-ahead forwards of batch t+1 would overwrite the cached copy that
    batch t's backward passes still read (another weight version). On the CPU the recipes
    have no effect (no transformer-engine layers), so Megatron-LM's FP8 examples still run
    there under every schedule."""
    for flag, dest in (("--fp8-format", "fp8"), ("--fp4-format", "fp4")):
        problem = low_precision_refusal(args.pipeline_schedule, getattr(args, dest, None),
                                        on_cuda)
        _require(problem is None, flag, problem or "")


def low_precision_refusal(schedule: str, recipe: str | None, on_cuda: bool) -> str | None:
    """Why an FP8/FP4 ``recipe`` cannot run under ``schedule`` (None when it can)."""
    if recipe is None or not on_cuda or not schedules.keeps_versions(schedule):
        return None
    return (f"not with --pipeline-schedule {schedule}: transformer-engine caches each "
            "weight's low-precision copy at a batch's first microbatch, and the next batch's "
            "look-ahead forwards would overwrite the copy this batch's backward passes read "
            "(another weight version); use flush, gpipe, zb-h1, naive or megatron")
