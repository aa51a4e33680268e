"""GPipe (Huang et al., 2019): all forwards of a batch, then all its backwards, then a flush.

PipeDream-2BW paper, Figure 1 / Section 2: every stage stashes the activations of all m
microbatches, and the pipeline drains before each optimizer step.
"""

from __future__ import annotations

from .actions import Action, Kind

__all__ = ["gpipe"]


def gpipe(depth: int, microbatches: int, stage: int, batch: int, *,
          fill: bool = True, drain: bool = True) -> list[Action]:
    """Stage `stage`'s actions for `batch`: F of each microbatch, B of each (same order), step.

    Every call fills and drains the pipeline, so `fill` and `drain` change nothing."""
    del depth, stage, fill, drain  # the same order on every stage
    first = batch * microbatches
    mbs = range(first, first + microbatches)
    return ([Action(Kind.FORWARD, k, batch, batch) for k in mbs]
            + [Action(Kind.BACKWARD, k, batch, batch) for k in mbs]
            + [Action(Kind.STEP, None, batch, batch + 1)])
