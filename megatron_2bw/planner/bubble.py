"""The schedule's part of an iteration: m microbatches over d stages given each stage's F and B,
the p2p latency and the step, as closed forms (`closed_form_iteration`) or from the schedule
simulator on the action lists the executor runs (`simulated_iteration`).

Invariant: pure functions of those numbers (no model, no cluster); the bubble is whatever the
iteration holds beyond m times the slowest stage's F + B and the step.
"""

from __future__ import annotations

import functools

from megatron_2bw.schedules import V_SCHEDULES, keeps_versions

__all__ = ["closed_form_iteration", "simulated_iteration"]


def _sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


@functools.lru_cache(maxsize=4096)
def _simulate_normalized(schedule: str, d: int, m: int, forward: tuple, backward: tuple,
                         p2p: float, step: float, sync: str) -> float:
    from megatron_2bw.schedules import Costs, pipeline_actions, placement_of, simulate

    placement = placement_of(schedule, d)
    if placement.shape == "v" and not isinstance(forward[0], tuple):  # even chunks: halves
        forward, backward = tuple(f / 2 for f in forward), tuple(b / 2 for b in backward)
    result = simulate(pipeline_actions(schedule, d, m, 3),
                      Costs(forward=forward, backward=backward, p2p=p2p, step=step),
                      step_sync=sync, placement=placement)
    ends = [max(result.batch_ends(i)[k] for i in range(d)) for k in range(2)]
    return ends[1] - ends[0]  # call 1: filled by call 0, not draining: the steady state


def simulated_iteration(schedule: str, d: int, m: int, forward: tuple, backward: tuple,
                        p2p: float, step: float, sync: str) -> float:
    """Time of one steady-state iteration from the schedule simulator
    (`megatron_2bw.schedules.simulate` on the action lists the executor runs), memoized on the
    costs normalised to the slowest forward and rounded to 3 digits: layouts that differ only
    in scale share one simulation."""
    def scaled(costs: tuple) -> tuple:  # per stage, or per stage and chunk
        return tuple(scaled(c) if isinstance(c, tuple) else _sig(c / unit) for c in costs)

    unit = max(max(f) if isinstance(f, tuple) else f for f in forward)
    key = (scaled(forward), scaled(backward), _sig(p2p / unit), _sig(step / unit))
    return unit * _simulate_normalized(schedule, d, m, *key, sync)


def closed_form_iteration(schedule: str, d: int, m: int, forward: list, backward: list,
                          p2p: float, step: float, sync: str, v: int = 1) -> float:
    """One iteration of m microbatches over d stages, the slowest doing F* + B*."""
    work = [f + b for f, b in zip(forward, backward)]
    bottleneck = max(work)
    if d == 1:
        return m * work[0] + step
    if schedule == "gpipe" or (schedule == "flush" and v == 1):
        # Fill and drain every iteration: the first microbatch crosses all stages, the
        # other m - 1 follow at the bottleneck's pace; uniform stages give (m + d - 1)(F+B),
        # the bubble (d - 1)/(m + d - 1) (GPipe; PipeDream-2BW Section 2.2 and 3.2).
        return (m - 1) * bottleneck + sum(work) + 2 * (d - 1) * p2p + step
    if schedule in ("megatron", "flush"):
        # Interleaved 1F1B, V chunks per rank (megatron-core's, or ours under flush): the
        # fill and drain cross d chunks of 1/V of a stage each, the bubble (d - 1)/V of a
        # microbatch's F + B (SC'21 Section 2.2.2: bubble fraction (d - 1)/(V m)); V = 1 is
        # the flush above. 2BW-interleaved runs the same order without the flush: the
        # versions branch below, for any V.
        return (m * bottleneck + (sum(work) - bottleneck) / v
                + 2 * (d - 1) * p2p + step)
    if schedule == "zb-h1":
        # Flush's fill and drain less two weight gradients per stage off the bottleneck:
        # uniform stages give m (F + B) + (d - 1)(F + I - W) with B = I + W (Section 2.1,
        # while W <= min(F, I)); W is half the backward (the simulator's default split), so
        # each other stage adds F + I - W = its forward.
        slowest = work.index(bottleneck)
        fill = sum(f for i, f in enumerate(forward) if i != slowest)
        return m * bottleneck + fill + 2 * (d - 1) * p2p + step
    if schedule in V_SCHEDULES:
        # Two chunks of half a stage each, the V's bubble: ZB-V idles (d - 1) T_F of a
        # chunk per rank (Qi et al., Section 6), DualPipeV (d - 1)(F&B + B - 3W) of a chunk
        # (DeepSeek-V3, Table 2), the same F/2 where W is half the backward; the slowest
        # stage's F as the bound (tests/test_vshape.py derives both).
        return m * bottleneck + (d - 1) * max(forward) / 2 + 2 * (d - 1) * p2p + step
    if keeps_versions(schedule):
        # Steady state: no flush, no bubble (Section 3.1): m (F* + B*). A pipeline-wide step
        # (global gradient norm) waits for stage 0's last backward: after the last stage's,
        # the backward wave runs through stages d - 2, ..., 0.
        lag = sum(backward[:-1]) + (d - 1) * p2p if sync == "pipeline" else 0.0
        return m * bottleneck + lag + step
    if schedule == "naive":
        # One stage busy at a time: every microbatch crosses all stages (d-fold).
        return m * (sum(work) + 2 * (d - 1) * p2p) + step
    raise ValueError(f"unknown schedule {schedule!r}")
