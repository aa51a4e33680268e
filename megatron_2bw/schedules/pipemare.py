"""PipeMare (Yang et al., MLSys 2021): asynchronous pipeline training without weight stashing,
on Megatron's batches; the same 1F1B order and per-stage updates as PipeDream
(`pipedream.py`).

A microbatch's forward reads PipeDream's version, its backward the stage's newest, W_i(t).
`delays` reads tau_fwd and tau_bkwd from the action data; `PipeMareOptions` holds the
--pipemare-* options: T1 (learning-rate rescheduling, `lr_factor`), T2 (discrepancy
correction, `correction_span`, m >= d only) and W (synchronous warm-up, `pipemare_version`).

Invariants: one weight version is read (the spec's memory); the executor's second slot holds
T2's corrected copy, or else the previous version only so that a drain refills the pipeline
with the versions an undrained run reads (a resumed run is exact).

The rule, the delays, T1, T2 and W: docs/schedules.md, "PipeMare".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .actions import Action, Kind
from .flush import one_f_one_b
from .pipedream import drain_notice, pipedream_version

__all__ = ["PipeMareOptions", "pipemare", "pipemare_version", "pipemare_backward_version",
           "call_schedule", "delays", "correction_span", "lr_factor", "weight_buffers"]


@dataclass(frozen=True)
class PipeMareOptions:
    """PipeMare's techniques (flags --pipemare-*; see the module docstring)."""

    discrepancy_decay: float | None = None
    """D of T2, in (0, 1); None: no discrepancy correction."""
    lr_warmup_steps: int = 0
    """K of T1; 0: no rescheduling."""
    sync_iters: int = 0
    """N of W: iterations run synchronously before the asynchronous ones."""

    @classmethod
    def from_args(cls, args) -> "PipeMareOptions":
        return cls(getattr(args, "pipemare_discrepancy_decay", None),
                   getattr(args, "pipemare_lr_warmup_steps", 0) or 0,
                   getattr(args, "pipemare_sync_iters", 0) or 0)


def pipemare_version(depth: int, microbatches: int, stage: int, microbatch: int,
                     sync_iters: int = 0) -> int:
    """Weight version (global, 0-indexed) `microbatch`'s forward reads on `stage`: its batch's
    during the synchronous warm-up, PipeDream's afterwards."""
    if microbatch // microbatches < sync_iters:
        return microbatch // microbatches
    return pipedream_version(depth, microbatches, stage, microbatch)


def pipemare_backward_version(depth: int, microbatches: int, stage: int, microbatch: int) -> int:
    """Weight version (global, 0-indexed) `microbatch`'s backward reads: its batch's, the
    newest on every stage once the stage's step after the previous batch is made."""
    del depth, stage
    return microbatch // microbatches


def pipemare(depth: int, microbatches: int, stage: int, batch: int, *,
             fill: bool, drain: bool, drain_at: int | None = None) -> list[Action]:
    """Stage `stage`'s actions in call `batch` (see `pipedream.pipedream`)."""
    return one_f_one_b(
        depth, microbatches, stage, batch, fill=fill, drain=drain, drain_at=drain_at,
        version_of=lambda k: pipedream_version(depth, microbatches, stage, k),
        backward_version_of=lambda k: pipemare_backward_version(depth, microbatches, stage, k))


def call_schedule(batch: int, sync_iters: int) -> str:
    """The schedule call `batch` runs with `sync_iters` synchronous iterations first: "flush"
    (it fills and drains; every pass of batch t reads W(t)), then "pipemare", whose first call
    fills as after any drain."""
    return "flush" if batch < sync_iters else "pipemare"


def delays(actions: list[Action]) -> dict[int, tuple[int, int]]:
    """Microbatch -> (tau_fwd, tau_bkwd) on one stage's list: the version its batch's step
    updates (the version that step makes, minus one) minus the version its F, and its B,
    read."""
    updated = {a.batch: a.version - 1 for a in actions if a.kind is Kind.STEP}
    forward = {a.microbatch: a.version for a in actions if a.kind is Kind.FORWARD}
    return {a.microbatch: (updated[a.batch] - forward[a.microbatch], updated[a.batch] - a.version)
            for a in actions if a.kind is Kind.BACKWARD}


@lru_cache(maxsize=64)
def _steady_delays(depth: int, microbatches: int, stage: int) -> tuple[tuple[int, int], ...]:
    """The delays of a batch in steady state (batch n = `drain_notice` of n + 2 calls: its
    look-ahead forwards read versions made after the start)."""
    steady = drain_notice(depth, microbatches)
    actions = [a for t in range(steady + 2)
               for a in pipemare(depth, microbatches, stage, t, fill=t == 0,
                                 drain=t == steady + 1)]
    found = delays(actions)
    return tuple(found[steady * microbatches + j] for j in range(microbatches))


def correction_span(depth: int, microbatches: int, stage: int) -> int:
    """s_i: the stage's largest tau_fwd - tau_bkwd (0: nothing to correct)."""
    return max(fwd - bkwd for fwd, bkwd in _steady_delays(depth, microbatches, stage))


def forward_delay(depth: int, microbatches: int, stage: int) -> int:
    """tau_i of T1: the stage's largest tau_fwd, floored at 1."""
    return max(1, *(fwd for fwd, _ in _steady_delays(depth, microbatches, stage)))


def lr_factor(step: int, warmup_steps: int, tau: int) -> float:
    """T1's factor on the learning rate at step `step` (from 0): 1 / tau ** p_k with
    p_k = 1 - min(k / K, 1); 1 without rescheduling (K = 0)."""
    if warmup_steps <= 0:
        return 1.0
    return 1.0 / tau ** (1.0 - min(step / warmup_steps, 1.0))


def weight_buffers(depth: int, microbatches: int, stage: int, correction: bool) -> int:
    """Weight-sized buffers PipeMare holds on `stage`: the one version, and with T2 on a stage
    that corrects, delta and the corrected copy (delta is fp32: in a 16-bit run it takes the
    bytes of two)."""
    return 3 if correction and correction_span(depth, microbatches, stage) > 0 else 1
