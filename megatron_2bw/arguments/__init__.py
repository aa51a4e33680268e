"""Command-line flags: Megatron-LM's names for what Megatron-LM has, ours for the rest.

All consistency checks live in :func:`validate_args`; each failure raises :class:`FlagError`
naming the flag and printing every factor, and entry scripts turn it into one error line and a
non-zero exit on every rank, before any process group or model exists.

Modules: ``parser`` (`build_parser`, `parse_args`), ``validate`` (`validate_args`, the order of
the rules), and one per feature, each with its flags and their rules: ``model``, ``moe``,
``parallel``, ``training``, ``optimizer``, ``precision``, ``data``, ``checkpoint``; ``common``
holds the shared value types and raisers. This file only re-exports the names callers import.
"""

from __future__ import annotations

from megatron_2bw.arguments.moe import MOE_LOAD_BALANCING, moe_freq_type, moe_layer_pattern
from megatron_2bw.arguments.model import ATTENTION_BACKENDS
from megatron_2bw.arguments.optimizer import have_emerging_optimizers
from megatron_2bw.arguments.parallel import SCHEDULES, VIRTUAL_STAGE_SCHEDULES
from megatron_2bw.arguments.parser import _Parser, build_parser, parse_args
from megatron_2bw.arguments.precision import low_precision_refusal
from megatron_2bw.arguments.training import MAX_TRAIN_SAMPLES
from megatron_2bw.arguments.validate import validate_args
from megatron_2bw.flag_types import FlagError, int_at_least, number_in

__all__ = ["FlagError", "SCHEDULES", "build_parser", "parse_args", "validate_args",
           "int_at_least", "number_in", "have_emerging_optimizers"]
