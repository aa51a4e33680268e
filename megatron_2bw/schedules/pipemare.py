"""PipeMare (Yang et al., MLSys 2021): asynchronous pipeline training without weight stashing,
on Megatron's batches; the same 1F1B order and per-stage updates as PipeDream
(`pipedream.py`).

A microbatch's forward reads the weights current at its forward and its backward the weights
current at its backward, so the two differ for the look-ahead microbatches: on stage i,

    microbatch k of batch t: forward reads W_i(max(floor((k - w_i) / m), 0)), w_i = d-i-1
                             (PipeDream's rule: with m >= d, W_i(t-1) for the first w_i
                             microbatches of the batch, else W_i(t)); backward reads W_i(t)
    W_i(t+1) = W_i(t) - lr * sum_j grad_i f(forward at its version, backward at W_i(t))

The backward uses the activations its forward saved with the newer weights (autograd unpacks
the saved parameters at their current storage, which the executor points at the backward's
version).

Delays (PipeMare's tau_fwd and tau_bkwd), read from the action data (`delays`): the step after
batch t updates W_i(t), so tau_fwd(j) = t - (version F(j) reads) and tau_bkwd(j) = t - (version
B(j) reads). tau_bkwd = 0 and tau_fwd = t - floor((k - w_i) / m) <= ceil(w_i / m): with m >= d
0 or 1 (1 for the look-ahead microbatches of every batch after the first), with m < d up to
ceil(w_i / m) (d - i - 1 at m = 1); the last stage (w = 0) is synchronous.

Options (`PipeMareOptions`, flags --pipemare-*):

  T1, learning-rate rescheduling: stage i steps with lr_k / tau_i ** p_k,
      p_k = 1 - min(k / K, 1), tau_i the stage's largest tau_fwd floored at 1 (`lr_factor`).
      With m >= d tau_i = 1 and the factor is 1 at every step; with m < d a stage with
      tau_i > 1 steps with the smaller rate for the first K steps (the runner scales the
      optimizer's learning rate around the step on that stage only).
  T2, discrepancy correction (m >= d only: arguments.py refuses it at m < d): a backward reads
      w_bkwd - (tau_fwd - tau_bkwd) * delta_i, where after each step
      delta_i(t+1) = gamma_i * delta_i(t) + (1 - gamma_i) * (W_i(t+1) - W_i(t)), delta_i(0) = 0,
      gamma_i = D ** (1 / s_i), s_i the stage's largest tau_fwd - tau_bkwd
      (`correction_span`); no correction where s_i = 0 (the last stage).
  W,  synchronous warm-up: the first N iterations run as PipeDream-Flush (the
      pipeline drained every call; forward and backward of batch t < N read W(t)); from
      batch N on the rule above, the refilled look-ahead forwards of batch N reading W(N-1)
      as after any drain (`pipemare_version`).

Memory: PipeMare keeps one weight version (what the spec declares and the simulator counts:
no in-flight microbatch's later pass reads an older version), plus, with T2, delta and the
corrected copy (`weight_buffers`). The executor's second weight slot holds the corrected copy;
without T2 it holds the previous version only so that a drain (evaluation, checkpoint) refills
the pipeline with the versions an undrained run reads and a resumed run is exact.
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
