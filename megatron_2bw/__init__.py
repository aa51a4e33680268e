"""megatron-2bw: PipeDream-2BW and pipeline baselines inside megatron-core.

``megatron_2bw.install(schedule)`` points ``megatron.core.pipeline_parallel.
get_forward_backward_func`` at the chosen schedule, so any Megatron-style training loop uses it.
"""

from megatron_2bw.runtime import jit_import as _jit_import

__version__ = "0.1.0"

_jit_import.register()  # without CUDA, megatron-core's fuser is chosen at its import (no Dynamo)


def install(schedule: str = "2bw") -> None:
    """Select ``schedule`` for every later ``get_forward_backward_func()`` call (idempotent)."""
    from megatron_2bw.schedules.patch import install as _install

    _install(schedule)
