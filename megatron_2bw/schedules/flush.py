"""PipeDream-Flush: 1F1B within a batch, then a flush (PipeDream-2BW paper, Section 3.3).

Stage i runs w_i = min(d-i-1, m) warm-up forwards, then alternates F(j+w_i), B(j), then the
cool-down backwards. At most min(d-i, m) activations are stashed on stage i, against m for
GPipe, for the same bubble.
"""

from __future__ import annotations

from typing import Callable

from .actions import Action, Kind

__all__ = ["flush", "one_f_one_b", "warmup_slots", "slot_pass"]


def warmup_slots(depth: int, stage: int, chunks: int = 1) -> int:
    """w_i: the forwards stage `stage` runs before its first backward: d - i - 1 under 1F1B;
    with V = `chunks` > 1 model chunks, 2(d - i - 1) + (V - 1)d (megatron-core's interleaved
    order, ``get_schedule_table``)."""
    if chunks == 1:
        return depth - stage - 1
    return 2 * (depth - stage - 1) + (chunks - 1) * depth


def slot_pass(depth: int, chunks: int, slot: int, *, backward: bool) -> tuple[int, int]:
    """(global microbatch, chunk) of a stage's forward or backward `slot` (counted from the
    training's start): d microbatches through chunk 0, the same d through chunk 1, ..., then
    the next d; backwards take the chunks in reverse. One chunk: slot s is microbatch s."""
    group, within = divmod(slot, depth * chunks)
    chunk = within // depth
    return group * depth + within % depth, chunks - 1 - chunk if backward else chunk


def one_f_one_b(depth: int, microbatches: int, stage: int, batch: int, *, fill: bool,
                drain: bool, version_of: Callable[[int], int],
                backward_version_of: Callable[[int], int] | None = None,
                chunks: int = 1, drain_at: int | None = None) -> list[Action]:
    """The 1F1B order of stage `stage` for the backwards of `batch`, then the step: w_i
    warm-up forward slots, then F(slot s + w_i), B(slot s) (at most w_i + 1 passes stashed),
    each slot a (microbatch, chunk) pass (`slot_pass`; one chunk: the microbatch).

    With `fill` the list starts with the warm-up forwards (pipeline empty before); without,
    they ran in earlier calls. With `drain` no forward beyond `batch` runs (the cool-down);
    without, the forwards run w_i slots ahead, and with one chunk and m < w_i that is into
    the batches after the next (PipeDream at m < d), up to the end of batch `drain_at` (the
    planned drain; None: none planned). With V > 1 chunks the look-ahead is capped at one
    batch (megatron-core's interleaved warm-up).
    `version_of(k)` is the weight version (global) microbatch k reads, in its forward and, unless
    `backward_version_of(k)` says otherwise (no weight stashing), in its backward.
    """
    per_batch = microbatches * chunks
    lag = warmup_slots(depth, stage, chunks)
    if chunks > 1:
        lag = min(lag, per_batch)
    first = batch * per_batch
    last_batch = batch if drain else drain_at
    end = None if last_batch is None else (last_batch + 1) * per_batch  # no forward slot past
    backward_version_of = backward_version_of or version_of

    def action(kind: Kind, slot: int) -> Action:
        k, chunk = slot_pass(depth, chunks, slot, backward=kind is Kind.BACKWARD)
        rule = version_of if kind is Kind.FORWARD else backward_version_of
        return Action(kind, k, k // microbatches, rule(k), chunk)

    def runs(slot: int) -> bool:
        return end is None or slot < end

    actions = [action(Kind.FORWARD, first + s) for s in range(lag)
               if runs(first + s)] if fill else []
    for s in range(per_batch):
        if runs(first + s + lag):
            actions.append(action(Kind.FORWARD, first + s + lag))
        actions.append(action(Kind.BACKWARD, first + s))
    return actions + [Action(Kind.STEP, None, batch, batch + 1)]


def flush(depth: int, microbatches: int, stage: int, batch: int, *,
          fill: bool = True, drain: bool = True) -> list[Action]:
    """Stage `stage`'s actions for `batch`: warm-up, 1F1B, cool-down, step. Batch b reads
    version b; every call fills and drains, so `fill` and `drain` change nothing."""
    del fill, drain
    return one_f_one_b(depth, microbatches, stage, batch, fill=True, drain=True,
                       version_of=lambda k: k // microbatches)
