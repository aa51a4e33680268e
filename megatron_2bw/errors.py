"""The package's errors that more than one layer raises, outside any of them: standard library
only, so a lower layer (the schedules' executor refusing a checkpoint it cannot resume from)
raises what the training layer catches without importing it. ``str()`` of each is the one line
the user sees. (`FlagError` lives in megatron_2bw.flag_types, the argument layer's leaf.)
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointRefused"]


class CheckpointError(ValueError):
    """A --load/--save problem the user must fix; ``str()`` is the one line they see."""


class CheckpointRefused(CheckpointError):
    """The checkpoint cannot serve this run (not unreadable): no older checkpoint is tried."""
