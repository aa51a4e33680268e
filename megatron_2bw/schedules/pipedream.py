"""PipeDream-1F1B with weight stashing (Narayanan et al., SOSP 2019), the memory baseline of the
PipeDream-2BW paper (Section 2), on Megatron's batches.

No flush: like 2BW the whole training is one continuous 1F1B, and stage i runs its
w_i = min(d-i-1, m) warm-up forwards only at the start. Unlike 2BW, each stage updates its
weights as soon as its own backward passes of a batch are done, and every microbatch reads the
newest version at its forward (and, stashed, the same version at its backward). In 1F1B the
forwards of the first w_i microbatches of batch t run on stage i before its step after batch
t-1 (they are the look-ahead forwards of the previous call), so, per stage,

    microbatch j of batch t reads W_i(max(t-1, 0)) if j < w_i, else W_i(t)
    W_i(t+1) = W_i(t) - lr * sum_j grad_i f(microbatch j of batch t)

The last stage (w = 0) is synchronous; earlier stages see more staleness, and the stages of
one microbatch read different versions (no "vertical sync", PipeDream Section 3.3). With
m >= d a stage holds at most two versions (the paper's d-i stashed versions are those of
m = 1: an update after every microbatch), the same memory as 2BW. The rule is a function of
(stage, batch, j) only: after a drain (evaluation, checkpoint) the refilled warm-up forwards
still read W_i(t-1), which is alive, so a resumed run is exact.

The optimizer step after batch t is taken where its result is first read (the executor's
deferred step, as for 2BW), at the latest before the next call's first forward on the last
stage; gradient clipping uses the global norm of batch t's gradients over all stages, and a tied
embedding's two copies are updated with the same summed gradient.
"""

from __future__ import annotations

from .actions import Action
from .flush import one_f_one_b

__all__ = ["pipedream", "pipedream_version"]


def pipedream_version(depth: int, microbatches: int, stage: int, microbatch: int) -> int:
    """Weight version (global, 0-indexed) `microbatch` reads on `stage`."""
    batch, j = divmod(microbatch, microbatches)
    lag = min(depth - stage - 1, microbatches)
    return max(batch - 1, 0) if j < lag else batch


def pipedream(depth: int, microbatches: int, stage: int, batch: int, *,
              fill: bool, drain: bool) -> list[Action]:
    """Stage `stage`'s actions in call `batch` (see `twobw.twobw` for `fill` and `drain`)."""
    if microbatches < depth:
        raise ValueError(f"PipeDream with weight stashing needs at least as many microbatches "
                         f"per batch as pipeline stages here: m={microbatches} < d={depth} "
                         "(with m >= d each stage holds at most two weight versions)")
    return one_f_one_b(depth, microbatches, stage, batch, fill=fill, drain=drain,
                       version_of=lambda k: pipedream_version(depth, microbatches, stage, k))
