"""ZB-H1: 1F1B with the backward split into input-gradient (I) and weight-gradient (W) actions
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2.1 and Figure 3, top).

1F1B's order of forwards and input gradients (w_i = min(d-i-1, m) warm-up forwards on stage
i), with each W on stage i delayed by i microbatches: W(j - i) follows I(j), and the last i
weight gradients fill the cool-down. Bubble (d-1)(T_F + T_B - T_W) against 1F1B's
(d-1)(T_F + T_B + T_W), for m >= d and T_W <= min(T_F, T_B).

Invariants: synchronous, flush's weights (batch b reads version b); at most min(d-i, m)
microbatches between F and I on stage i and min(i+1, m) whose W is pending, each keeping only
its linear layers' inputs and output gradients (schedules/wgrad.py).

More: docs/schedules.md, "ZB-H1".
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
