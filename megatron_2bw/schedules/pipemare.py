"""PipeMare (Yang et al., MLSys 2021): asynchronous pipeline training without weight stashing,
on Megatron's batches; the same 1F1B order and per-stage updates as PipeDream
(`pipedream.py`).

A microbatch's forward reads the weights current at its forward and its backward the weights
current at its backward, so the two differ for the look-ahead microbatches: on stage i,

    microbatch j of batch t: forward reads W_i(max(t-1, 0)) if j < w_i = min(d-i-1, m),
                             else W_i(t); backward reads W_i(t)
    W_i(t+1) = W_i(t) - lr * sum_j grad_i f(forward at its version, backward at W_i(t))

The backward uses the activations its forward saved with the newer weights (autograd unpacks
the saved parameters at their current storage, which the executor points at the backward's
version). In PipeMare's terms the delays are tau_fwd = 1, tau_bkwd = 0 for the look-ahead
microbatches and 0, 0 for the others; the last stage is synchronous. With one update per batch
and m >= d no delay exceeds 1, where PipeMare's learning-rate rescheduling (T1, a step of
lr / tau ** p) changes nothing; its discrepancy correction (T2) and synchronous warm-up (W)
are not built yet.

Memory: PipeMare itself keeps one weight version. Here the executor keeps the look-ahead
forwards' version alive as PipeDream does (2 versions at m >= d), so that a drain (evaluation,
checkpoint) refills the pipeline with the same versions and a resumed run is exact.
"""

from __future__ import annotations

from .actions import Action
from .flush import one_f_one_b
from .pipedream import pipedream_version

__all__ = ["pipemare", "pipemare_backward_version"]


def pipemare_backward_version(depth: int, microbatches: int, stage: int, microbatch: int) -> int:
    """Weight version (global, 0-indexed) `microbatch`'s backward reads: its batch's, the
    newest on every stage once the stage's step after the previous batch is made."""
    del depth, stage
    return microbatch // microbatches


def pipemare(depth: int, microbatches: int, stage: int, batch: int, *,
             fill: bool, drain: bool) -> list[Action]:
    """Stage `stage`'s actions in call `batch` (see `twobw.twobw` for `fill` and `drain`)."""
    if microbatches < depth:
        raise ValueError(f"PipeMare needs at least as many microbatches per batch as pipeline "
                         f"stages here: m={microbatches} < d={depth}")
    return one_f_one_b(
        depth, microbatches, stage, batch, fill=fill, drain=drain,
        version_of=lambda k: pipedream_version(depth, microbatches, stage, k),
        backward_version_of=lambda k: pipemare_backward_version(depth, microbatches, stage, k))
