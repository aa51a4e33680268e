"""One Megatron call as the executor's handlers see it.

:class:`Call` holds what ``forward_backward_func`` was given for the call (model chunks, data
iterators, config, microbatch count) and what the call gathers (losses, token count); it lives
for one call only. Invariant: nothing in it outlives the call; state across calls is the
runner's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["Call", "model_chunks"]


@dataclass
class Call:
    """What one Megatron call passes to the schedule, as the handlers need it."""

    forward_step_func: Callable
    data_iterators: list
    """One per model chunk."""
    models: list
    """The stage's model chunks (virtual stages c*d + stage); one without virtual stages."""
    config: object
    num_microbatches: int
    losses: list
    num_tokens: torch.Tensor
    pg_collection: object
    force_all_reduce: bool
    completing: dict = field(default_factory=dict)
    """chunk -> the call's actions whose parameter gradients complete the chunk's for the
    batch: its last B, or its last I (the small parameters) and its last W (the rest)."""
    gathers_next_chunk_at: dict = field(default_factory=dict)
    """chunk c+1 -> chunk c's first forward of the call, where chunk c+1's parameter
    all-gathers are launched (virtual stages with ``config.param_sync_func``; c+1 >= 2)."""

    @property
    def model(self) -> torch.nn.Module:
        """The one model chunk (schedules that keep weight versions run one chunk)."""
        return self.models[0]


def model_chunks(model) -> list:
    """The stage's model chunks as a list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]
