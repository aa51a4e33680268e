"""Helper processes end with their rank.

megatron-core's torch_dist checkpoint writer forks one writer process per bucket on every save
and collects their results through a ``multiprocessing.Manager`` queue, whose server process
lives as long as the Python process that spawned it. A rank killed with SIGKILL (a dead node,
the OOM killer, torchrun stopping the others) runs no clean-up, so both outlived it.

:func:`bind_helpers_to_this_process` (idempotent, Linux) makes every process forked from this
one receive SIGKILL when this one dies (``PR_SET_PDEATHSIG``), and hands the checkpoint writer a
plain in-process queue instead of the Manager's, so no spawned server exists at all. A
synchronous save (--async-save is refused) puts its writers' collected results into that queue
and reads them back in this same process; the forked writers report through a queue of their
own. The queue must hand over synchronously: megatron-core reads it with ``get_nowait`` right
after the put, and a ``multiprocessing.Queue`` only reaches its pipe later, through a feeder
thread, so under load the save failed with "results_queue should not be empty".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import sys

__all__ = ["bind_helpers_to_this_process"]

_PR_SET_PDEATHSIG = 1
_bound = False
_forking_pid = None


def _remember_parent() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_parent() -> None:
    """In a freshly forked child: SIGKILL when the parent process ends."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _forking_pid:  # the parent died between fork and prctl
        os._exit(1)


def bind_helpers_to_this_process() -> None:
    global _bound
    if _bound or not sys.platform.startswith("linux"):
        return
    _bound = True
    os.register_at_fork(before=_remember_parent, after_in_child=_die_with_parent)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
