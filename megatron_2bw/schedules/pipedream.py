"""PipeDream-1F1B with weight stashing (Narayanan et al., SOSP 2019), the memory baseline of the
PipeDream-2BW paper (Section 2), on Megatron's batches of m microbatches.

No flush: like 2BW the whole training is one continuous 1F1B, and stage i runs its
w_i = d-i-1 warm-up forwards only at the start. Each stage updates its weights as soon as its
own backward passes of a batch are done, and every microbatch reads the newest version at its
forward and, stashed, the same version at its backward (PipeDream Section 3.3). In 1F1B the
forward of (global) microbatch k on stage i runs right after the backward of microbatch
k - w_i - 1, so it reads the versions made by the steps after the batches whose backwards are
all done by then:

    microbatch k reads, on stage i,  W_i(max(floor((k - w_i) / m), 0))
    W_i(t+1) = W_i(t) - lr * sum_j grad_i f(microbatch j of batch t)

With m >= d (w_i < m) that is W_i(t-1) for the first w_i microbatches of batch t, else W_i(t).
With m = 1 (the paper's PipeDream: an update after every microbatch) microbatch k reads
W_i(k - w_i), and with m < d the look-ahead forwards of a call run into the batches after the
next.

Versions a stage holds (the newest and those its in-flight microbatches read): the forwards
of k .. k + w_i are in flight before B(k), reading floor((k-w_i)/m) .. floor(k/m), so

    versions_i = 1 + ceil(w_i / m)        (d - i at m = 1; 2 at m >= d, 1 on the last stage)

(`versions_held`). The rule is a function of (stage, k) only: after a drain (evaluation,
checkpoint) the refilled warm-up forwards still read the versions an undrained run reads,
which the store keeps alive (the same count), so a resumed run is exact. A drain with m < w_i
must be known ceil(w_i / m) calls ahead (`drain_notice`): the calls before it stop their
look-ahead forwards at its batch (`one_f_one_b`'s `drain_at`).

The last stage (w = 0) is synchronous; earlier stages see more staleness, and the stages of
one microbatch read different versions (no "vertical sync", PipeDream Section 3.3).

The optimizer step after batch t is taken where its result is first read (the executor's
deferred step, as for 2BW), at the latest before the next call's first forward on the last
stage; gradient clipping uses the global norm of batch t's gradients over all stages, and a tied
embedding's two copies are updated with the same summed gradient.
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
