"""PipeDream-1F1B with weight stashing (Narayanan et al., SOSP 2019), the memory baseline of the
PipeDream-2BW paper (Section 2), on Megatron's batches of m microbatches.

One continuous 1F1B without a flush; each stage steps as soon as its own backwards of a batch
are done, and microbatch k reads, on stage i, W_i(max(floor((k - w_i) / m), 0)) (w_i = d-i-1)
at its forward and, stashed, at its backward.

Invariants: the version a pass reads is a function of (stage, k) only, so a drain and a resume
are exact; stage i holds 1 + ceil(w_i / m) versions (`versions_held`); a drain with m < w_i is
known ceil(w_i / m) calls ahead (`drain_notice`); the step after batch t is deferred to its
first reader, at the latest before the next call's first forward on the last stage.

The rule, the versions held and the drain notice: docs/schedules.md, "PipeDream".
"""

from __future__ import annotations

from .actions import Action
from .flush import one_f_one_b

__all__ = ["pipedream", "pipedream_version", "versions_held", "drain_notice"]


def pipedream_version(depth: int, microbatches: int, stage: int, microbatch: int) -> int:
    """Weight version (global, 0-indexed) `microbatch` reads on `stage`:
    max(floor((k - w_i) / m), 0), w_i = d - i - 1."""
    return max((microbatch - (depth - stage - 1)) // microbatches, 0)


def versions_held(depth: int, microbatches: int, stage: int) -> int:
    """Weight versions `stage` holds at most: 1 + ceil(w_i / m) (d - i at m = 1)."""
    lag = depth - stage - 1
    return 1 + -(-lag // microbatches)


def drain_notice(depth: int, microbatches: int) -> int:
    """Calls ahead a drain must be known: ceil(w_0 / m), at least 1 (the first stage's
    look-ahead forwards reach that many batches past the one whose backwards a call runs)."""
    return max(1, -(-(depth - 1) // microbatches))


def pipedream(depth: int, microbatches: int, stage: int, batch: int, *,
              fill: bool, drain: bool, drain_at: int | None = None) -> list[Action]:
    """Stage `stage`'s actions in call `batch` (see `twobw.twobw` for `fill` and `drain`;
    `drain_at`: the batch of the next planned drain, see `flush.one_f_one_b`)."""
    return one_f_one_b(depth, microbatches, stage, batch, fill=fill, drain=drain,
                       drain_at=drain_at,
                       version_of=lambda k: pipedream_version(depth, microbatches, stage, k))
