"""The parser: `_Parser` (argparse raising FlagError), `build_parser` (the feature modules'
flag groups in a fixed order, then Megatron-LM's other flags) and `parse_args`."""

from __future__ import annotations

import argparse
import os
import re
from typing import Sequence

from megatron_2bw.arguments.checkpoint import _add_logging_and_checkpoint_args
from megatron_2bw.arguments.data import _add_data_args
from megatron_2bw.arguments.model import _add_model_args
from megatron_2bw.arguments.moe import _add_moe_args
from megatron_2bw.arguments.optimizer import _add_ddp_args
from megatron_2bw.arguments.parallel import _add_parallel_args
from megatron_2bw.arguments.training import _add_training_args
from megatron_2bw.arguments.validate import validate_args
from megatron_2bw.flag_types import FlagError


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


def build_parser(description: str = "Pretrain a model with megatron-2bw",
                 extra_args_provider=None) -> argparse.ArgumentParser:
    """Our flags, then ``extra_args_provider(parser)``'s (a model's own, as in Megatron-LM's
    parse_args), then every other flag of Megatron-LM's parser (megatron_lm_flags.py)."""
    from megatron_2bw.megatron_lm_flags import add_megatron_lm_flags

    parser = _Parser(description=description, allow_abbrev=False)
    _add_model_args(parser)
    _add_moe_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_logging_and_checkpoint_args(parser)
    _add_ddp_args(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    add_megatron_lm_flags(parser)  # last: only the flags defined nowhere above
    return parser


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and validate; ``world_size`` defaults to torchrun's WORLD_SIZE (1 without it)."""
    from megatron_2bw.megatron_lm_flags import check_megatron_lm_flags
    from megatron_2bw.runtime.device import device_kind

    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = validate_args(args, world_size)
    args.flag_notes = vars(args).pop("validation_notes", []) + check_megatron_lm_flags(
        args, getattr(parser, "_megatron_lm_flags", []), on_cuda=device_kind(args.cpu) == "cuda")
    return args
