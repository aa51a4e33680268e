"""Interleaved 1F1B over V model chunks per stage (Narayanan et al., SC'21, Section 2.2), with a
flush per batch (Megatron's interleaved schedule) or without one (2BW-interleaved).

Chunk c of stage i is virtual stage c*d + i. A stage runs its m*V (microbatch, chunk) passes in
slots, d microbatches at a time through each chunk, warming up with
w_i = 2*(d - i - 1) + (V - 1)*d forwards (megatron-core's get_schedule_table order); the order
is `flush.one_f_one_b` with `chunks`. 2BW-interleaved runs the same slots over the whole
training as one sequence, batch b reading version max(b - 1, 0).

Invariants: m is a multiple of d; one weight version spans a stage's V chunks; 2BW-interleaved
holds two versions, so a look-ahead past the next batch (w_0 > m*V) is refused.

The slots, the bubble and the exchanges: docs/schedules.md, "Interleaved 1F1B".
"""

from __future__ import annotations


from .actions import Action
from .flush import one_f_one_b, slot_pass, warmup_slots
from .twobw import twobw_version

__all__ = ["interleaved_flush", "interleaved_twobw", "warmup_slots", "forward_slots"]


def forward_slots(depth: int, microbatches: int, chunks: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of one batch's forwards in slot order (an evaluation call)."""
    _check(depth, microbatches, chunks)
    return [slot_pass(depth, chunks, s, backward=False) for s in range(microbatches * chunks)]


def _check(depth: int, microbatches: int, chunks: int) -> None:
    if chunks < 2 or depth < 2:
        raise ValueError(f"interleaving needs at least 2 chunks and 2 stages, got V={chunks}, "
                         f"d={depth}")
    if microbatches % depth:
        raise ValueError(f"interleaved schedules need the microbatches per batch to be a "
                         f"multiple of the pipeline size: m={microbatches}, d={depth}")


def interleaved_flush(depth: int, microbatches: int, stage: int, batch: int, chunks: int, *,
                      fill: bool = True, drain: bool = True) -> list[Action]:
    """Megatron's interleaved 1F1B: every call fills and drains; batch b reads version b."""
    del fill, drain
    _check(depth, microbatches, chunks)
    return one_f_one_b(depth, microbatches, stage, batch, fill=True, drain=True,
                       version_of=lambda k: k // microbatches, chunks=chunks)


def interleaved_twobw(depth: int, microbatches: int, stage: int, batch: int, chunks: int, *,
                      fill: bool, drain: bool) -> list[Action]:
    """2BW-interleaved: the slots of the whole training, batch b reading max(b - 1, 0)."""
    _check(depth, microbatches, chunks)
    if warmup_slots(depth, 0, chunks) > microbatches * chunks:
        raise ValueError(
            f"2BW-interleaved with d={depth}, V={chunks} needs m*V >= 2(d-1) + (V-1)d = "
            f"{warmup_slots(depth, 0, chunks)} (the first stage's look-ahead within one batch, "
            f"two weight versions), got m={microbatches}")
    return one_f_one_b(depth, microbatches, stage, batch, fill=fill, drain=drain,
                       version_of=lambda k: twobw_version(k // microbatches), chunks=chunks)
