"""Helpers every flag module shares: the argparse value types of counts, probabilities and
positive numbers, and the two ways a validator raises a FlagError. Imports nothing of the
subpackage (its lowest module)."""

from __future__ import annotations

from megatron_2bw.flag_types import FlagError, int_at_least, number_in


_COUNT = int_at_least(1)
_NONNEG = int_at_least(0)
_POSITIVE = number_in(0, low_open=True)
_PROBABILITY = number_in(0, 1, high_open=True)


def _require(condition: bool, flag: str, message: str) -> None:
    if not condition:
        raise FlagError(flag, message)


def _refuse(problem) -> None:
    """Raise a layout problem (megatron_2bw.schedules.requirements) as a FlagError."""
    if problem is not None:
        raise FlagError(problem.flag, problem.message)
