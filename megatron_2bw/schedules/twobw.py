"""PipeDream-2BW: 1F1B that never flushes, with double-buffered weights (Section 3.1).

The whole training is one continuous 1F1B over all N*m microbatches (stage i warms up with
d-i-1 forwards at the start only); a new version is made after a stage's last backward of a
batch, W(t+1) = W(t) - lr * grad f(W(t-1)), and batch b reads version max(b-1, 0).

Invariants: each stage holds at most two versions (m >= d); in Megatron's call t a stage runs
the backwards of exactly batch t and its forwards run ahead into batch t+1; the first call
after a start or a drain also holds the warm-up forwards, and a drain (before an evaluation, a
checkpoint, the end) holds no forward beyond batch t.

More: docs/schedules.md, "2BW in Megatron's one-call-per-batch API" and "2BW".
"""

from __future__ import annotations

from .actions import Action
from .flush import one_f_one_b

__all__ = ["twobw", "twobw_version"]


def twobw_version(batch: int) -> int:
    """Weight version batch `batch` (0-indexed) reads: max(b-1, 0)."""
    return max(batch - 1, 0)


def twobw(depth: int, microbatches: int, stage: int, batch: int, *,
          fill: bool, drain: bool) -> list[Action]:
    """Stage `stage`'s actions in call `batch`: the 1F1B slice holding batch's backwards.

    `fill`: the pipeline is empty before this call (first call, or first after a drain).
    `drain`: the pipeline is left empty after it (last call, evaluation, checkpoint)."""
    if microbatches < depth:
        raise ValueError(f"PipeDream-2BW needs at least as many microbatches per batch as "
                         f"pipeline stages: m={microbatches} < d={depth} (Section 3.1: m >= d, "
                         f"so that each stage holds at most two weight versions)")
    return one_f_one_b(depth, microbatches, stage, batch, fill=fill, drain=drain,
                       version_of=lambda k: twobw_version(k // microbatches))
