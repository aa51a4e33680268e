"""Patch megatron-core's schedule selector so it returns the schedule chosen by the user.

megatron-core re-exports ``get_forward_backward_func`` from ``pipeline_parallel/__init__.py``;
both names are replaced. ``megatron`` keeps Megatron's own 1F1B (or no-pipelining) schedule.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["install", "selected_schedule"]

_original: Callable | None = None
_selected: str = "megatron"


def selected_schedule() -> str:
    return _selected


def _get_forward_backward_func(*args, **kwargs):
    if _selected == "megatron":
        return _original(*args, **kwargs)
    from megatron_2bw.schedules.executor import forward_backward_func_for

    return forward_backward_func_for(_selected)


def install(schedule: str) -> None:
    global _original, _selected
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    if _original is None:
        _original = schedules.get_forward_backward_func
        schedules.get_forward_backward_func = _get_forward_backward_func
        pipeline_parallel.get_forward_backward_func = _get_forward_backward_func
    _selected = schedule
