"""A rank ends with its launcher, and its helper processes end with the rank.

:func:`bind_to_launcher` asks the kernel for SIGTERM when the process that started this one
ends (``PR_SET_PDEATHSIG``; the parent recorded by :func:`remember_launcher` at start-up), which
the training loop handles as a pre-emption. :func:`end_helpers_with_this_process` makes every
process forked from this one (checkpoint writers, DataLoader workers) get SIGKILL when it dies
and ignore SIGTERM and SIGINT; :func:`bind_helpers_to_this_process` also hands megatron-core's
checkpoint writer a plain in-process queue instead of a ``multiprocessing.Manager``'s.

Invariants: no rank trains on after its launcher died; no helper outlives its rank or dies
before it; no spawned queue server exists, and the writer's results queue hands over
synchronously (megatron-core reads it with ``get_nowait`` right after the put).
Why, and what nohup changes: docs/checkpoints_and_faults.md, "Ranks, launchers and helpers".
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import queue
import signal
import sys

__all__ = ["remember_launcher", "bind_to_launcher", "launcher_gone",
           "end_helpers_with_this_process", "bind_helpers_to_this_process",
           "ignore_stop_signals"]

_PR_SET_PDEATHSIG = 1
_helpers_bound = False
_queue_replaced = False
_forking_pid = None
_launcher_pid: int | None = None
_launcher_ignores_hangup = False


def _linux() -> bool:
    return sys.platform.startswith("linux")


def _set_parent_death_signal(sig: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


# ---- the rank and its launcher ----------------------------------------------------------------

def _ignores_hangup(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGHUP (its SigIgn mask; False where unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration, IndexError):
        return False
    return bool((int(mask, 16) >> (signal.SIGHUP - 1)) & 1)


def remember_launcher() -> None:
    """Record the process that started this one, and whether it ignores SIGHUP (call first
    thing at start-up, while it lives; idempotent)."""
    global _launcher_pid, _launcher_ignores_hangup
    if _launcher_pid is None:
        _launcher_pid = os.getppid()
        _launcher_ignores_hangup = _linux() and _ignores_hangup(_launcher_pid)


def _nohup_for_this_process_alone() -> bool:
    """SIGHUP is ignored here but not in the launcher: this process asked to outlive a
    launcher that ends with the terminal (a shell)."""
    return signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and not _launcher_ignores_hangup


def launcher_gone() -> bool:
    """Whether the process recorded by :func:`remember_launcher` ended: it is no longer this
    one's parent (the kernel re-parented this process), or its main thread, which started
    this one, is dead while the rest of it is still being torn down (a killed multi-threaded
    launcher: the kernel signals this process when that thread ends)."""
    if _launcher_pid is None:
        return False
    if os.getppid() != _launcher_pid:
        return True
    try:
        with open(f"/proc/{_launcher_pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return _linux()
    return state in ("Z", "X")


def bind_to_launcher() -> bool:
    """SIGTERM to this process when its launcher ends; a launcher that already ended sends it
    now. Returns whether the process is bound: not off Linux, nor where SIGHUP is ignored
    here and not in the launcher (``nohup`` for this process alone). Install the SIGTERM
    handler first: it receives the signal."""
    remember_launcher()
    if not _linux() or _nohup_for_this_process_alone():
        return False
    _set_parent_death_signal(signal.SIGTERM)
    if launcher_gone():  # it ended before the call: the kernel will not say so
        os.kill(os.getpid(), signal.SIGTERM)
    return True


# ---- helper processes and the rank ------------------------------------------------------------

def ignore_stop_signals(*_) -> None:
    """In a helper process: SIGTERM and SIGINT do nothing (the helper ends with its rank, which
    handles them). Also usable as a DataLoader ``worker_init_fn``."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread of the process: cannot happen after a fork
            pass


def _remember_parent() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_parent() -> None:
    """In a freshly forked child: SIGKILL when the parent process ends; SIGTERM and SIGINT
    ignored."""
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != _forking_pid:  # the parent died between fork and prctl
        os._exit(1)
    ignore_stop_signals()


def _end_helpers_at_exit() -> None:
    """At interpreter exit: SIGKILL the child processes still running. multiprocessing's own
    exit hook, which runs after this one, sends its daemonic children (DataLoader workers)
    SIGTERM, which they ignore, and then joins them: a rank leaving with an error, its data
    iterators still referenced, waited there forever."""
    import multiprocessing

    children = multiprocessing.active_children()
    if children:  # torch's SIGCHLD handler would report each worker's end as a failure
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()


def end_helpers_with_this_process() -> None:
    """Every process forked from this one from now on ends with it and ignores SIGTERM and
    SIGINT; at exit, the helpers still running are killed (idempotent; Linux)."""
    global _helpers_bound
    if _helpers_bound or not _linux():
        return
    _helpers_bound = True
    os.register_at_fork(before=_remember_parent, after_in_child=_die_with_parent)
    import multiprocessing.util  # noqa: F401  registers its exit hook first: it runs after ours

    atexit.register(_end_helpers_at_exit)


def bind_helpers_to_this_process() -> None:
    """:func:`end_helpers_with_this_process`, and megatron-core's checkpoint writer collects
    its results in an in-process queue (idempotent)."""
    global _queue_replaced
    end_helpers_with_this_process()
    if _queue_replaced or not _linux():
        return
    _queue_replaced = True
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
