"""Interleaved 1F1B over V model chunks per stage (Narayanan et al., SC'21, Section 2.2), with a
flush per batch (Megatron's interleaved schedule) or without one (2BW-interleaved).

Chunk c of stage i is virtual stage c*d + i. A stage runs its m*V (microbatch, chunk) passes
in "slots": forward slot s is microbatch (s // (d*V))*d + s % d of chunk (s // d) % V, so the
stage takes d microbatches through chunk 0, the same d through chunk 1, ..., then the next d;
backward slot s is the same microbatch of chunk V-1 - (s // d) % V. Stage i warms up with

    w_i = 2*(d - i - 1) + (V - 1)*d forwards   (megatron-core's get_schedule_table order)

then alternates F(slot s + w_i), B(slot s). With equal chunk costs f and b the flush variant
takes m*V*(f + b) + (d - 1)*(f + b) per batch: its bubble is 1/V of 1F1B's for the same
stage work (V*f and V*b per microbatch). Slots need m to be a multiple of d.

The order is `flush.one_f_one_b` with `chunks` (1F1B over slots). 2BW-interleaved runs the
same slots over the whole training as one sequence, as 2BW does with 1F1B: call t holds the backwards of batch t, its forwards run w_i slots ahead into batch
t+1, and batch b reads weight version max(b - 1, 0) (1-stale: W(t+1) = W(t) - lr grad f(W(t-1))).
A stage then holds two versions as long as its look-ahead stays within the next batch,
w_0 <= m*V; with more, batch t+2's forwards would need a third version, so it is refused.

The executor runs both (``--num-virtual-stages-per-pipeline-rank V`` with
``--pipeline-schedule flush`` or ``2bw``; tests/test_interleaved.py): flush gives the losses of
megatron-core's interleaved schedule, 2BW-interleaved those of 2bw with one chunk. Under
2BW-interleaved one weight version spans the stage's V chunks, and the deferred optimizer step
(megatron_2bw.deferred) finalizes and steps them together. Exchanges (``comm.fuse`` with
``chunks``) hold one group per forward/backward pair, as megatron-core posts them, and run under
NCCL's rendezvous on the simulator: flush in the buffered time, 2BW-interleaved losing about
one chunk's f + b per batch boundary to the early receive of the look-ahead before the step.
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
