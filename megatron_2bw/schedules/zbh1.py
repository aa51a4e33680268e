"""ZB-H1: 1F1B with the backward split into input-gradient (I) and weight-gradient (W) actions
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2.1 and Figure 3, top).

A backward's input gradient is all the previous stage waits for; the weight gradient can run
any time later. ZB-H1 keeps 1F1B's order of forwards and input gradients (w_i = min(d-i-1, m)
warm-up forwards on stage i, then F(j + w_i) I(j), then the cool-down), and delays each W on
stage i by i microbatches: W(j - i) follows I(j), and the last i weight gradients fill the
cool-down, where 1F1B's stage i waits for gradients. Input gradients then travel back a
whole W earlier per stage, and with T_F, T_B (input gradient) and T_W (weight gradient) per
microbatch the bubble is

    (d-1)(T_F + T_B - T_W)     against 1F1B's (d-1)(T_F + T_B + T_W)      (Section 2.1)

for m >= d and T_W <= min(T_F, T_B) (the simulator reproduces it exactly there; a longer W
no longer fits the gaps it fills, and then the bubble is larger). Synchronous, the same
weights as flush: batch b reads version b.

Memory: at most min(d-i, m) microbatches between F and I on stage i, 1F1B's stash, and
besides them at most min(i+1, m) whose W is pending. A pending W keeps only what its GEMMs
need, the linear layers' inputs and output gradients (schedules/wgrad.py; the paper's Table 1),
not the microbatch's graph, which its I frees.
"""

from __future__ import annotations

from .actions import Action, Kind

__all__ = ["zbh1"]


def zbh1(depth: int, microbatches: int, stage: int, batch: int, *,
         fill: bool = True, drain: bool = True) -> list[Action]:
    """Stage `stage`'s actions for `batch`: 1F1B with split backwards, each W delayed by
    `stage` microbatches, the remaining W's, the step. Every call fills and drains, so `fill`
    and `drain` change nothing."""
    del fill, drain
    m, first = microbatches, batch * microbatches
    warmup = min(depth - stage - 1, m)

    def action(kind: Kind, j: int) -> Action:
        return Action(kind, first + j, batch, batch)

    actions = [action(Kind.FORWARD, j) for j in range(warmup)]
    for j in range(m):
        if j + warmup < m:
            actions.append(action(Kind.FORWARD, j + warmup))
        actions.append(action(Kind.INPUT_GRAD, j))
        if j >= stage:
            actions.append(action(Kind.WEIGHT_GRAD, j - stage))
    actions += [action(Kind.WEIGHT_GRAD, j) for j in range(max(m - stage, 0), m)]
    return actions + [Action(Kind.STEP, None, batch, batch + 1)]
