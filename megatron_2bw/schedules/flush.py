"""PipeDream-Flush: 1F1B within a batch, then a flush (PipeDream-2BW paper, Section 3.3).

Stage i runs w_i = min(d-i-1, m) warm-up forwards, then alternates F(j+w_i), B(j), then the
cool-down backwards. At most min(d-i, m) activations are stashed on stage i, against m for
GPipe, for the same bubble.
"""

from __future__ import annotations

from typing import Callable

from .actions import Action, Kind

__all__ = ["flush", "one_f_one_b"]


def one_f_one_b(depth: int, microbatches: int, stage: int, batch: int, *, fill: bool,
                drain: bool, version_of: Callable[[int], int],
                backward_version_of: Callable[[int], int] | None = None) -> list[Action]:
    """The 1F1B order of stage `stage` for the backwards of `batch`, then the step.

    With `fill` the list starts with the warm-up forwards of the batch (pipeline empty before);
    without, they ran in the previous call. With `drain` no forward beyond `batch` runs (the
    cool-down); without, the forwards run `lag` microbatches into the next batch.
    `version_of(k)` is the weight version (global) microbatch k reads, in its forward and, unless
    `backward_version_of(k)` says otherwise (no weight stashing), in its backward.
    """
    lag = min(depth - stage - 1, microbatches)  # warm-up forwards w_i
    first = batch * microbatches

    backward_version_of = backward_version_of or version_of

    def action(kind: Kind, k: int) -> Action:
        rule = version_of if kind is Kind.FORWARD else backward_version_of
        return Action(kind, k, k // microbatches, rule(k))

    actions = [action(Kind.FORWARD, first + j) for j in range(lag)] if fill else []
    for j in range(microbatches):
        if not drain or j + lag < microbatches:
            actions.append(action(Kind.FORWARD, first + j + lag))
        actions.append(action(Kind.BACKWARD, first + j))
    return actions + [Action(Kind.STEP, None, batch, batch + 1)]


def flush(depth: int, microbatches: int, stage: int, batch: int, *,
          fill: bool = True, drain: bool = True) -> list[Action]:
    """Stage `stage`'s actions for `batch`: warm-up, 1F1B, cool-down, step. Batch b reads
    version b; every call fills and drains, so `fill` and `drain` change nothing."""
    del fill, drain
    return one_f_one_b(depth, microbatches, stage, batch, fill=True, drain=True,
                       version_of=lambda k: k // microbatches)
