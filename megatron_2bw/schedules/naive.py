"""Inter-layer model parallelism without pipelining.

One microbatch runs forward through all stages and backward again before the next one starts
(PipeDream-2BW paper, Section 2: at most one stage is busy at any time). Gradients of the batch's
m microbatches accumulate; the step follows the last backward.
"""

from __future__ import annotations

from .actions import Action, Kind

__all__ = ["naive"]


def naive(depth: int, microbatches: int, stage: int, batch: int, *,
          fill: bool = True, drain: bool = True) -> list[Action]:
    """Stage `stage`'s actions for `batch`: F(k) B(k) for each microbatch k, then the step.

    The order is the same on every stage; the dependencies (F(k+1) on stage 0 waits for B(k)
    on stage 0, which waits for all later stages) keep one microbatch in flight."""
    del depth, stage, fill, drain
    first = batch * microbatches
    actions = []
    for k in range(first, first + microbatches):
        actions += [Action(Kind.FORWARD, k, batch, batch), Action(Kind.BACKWARD, k, batch, batch)]
    return actions + [Action(Kind.STEP, None, batch, batch + 1)]
