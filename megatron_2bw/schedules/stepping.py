"""The executor's S (optimizer step) handler and what rides on the step: the deferred step,
the stale-weight correction and PipeMare's learning-rate scaling (T1) and discrepancy
correction (T2).

:class:`Stepping` finalizes a batch's gradients and forks the weight version at S, or begins
a deferred step there and applies it before the first step that reads its version.
Invariant: every rank of a data-parallel group runs the same S and applies in the same
program order, so the step's collectives are issued in the same order everywhere.
"""

from __future__ import annotations

from typing import Callable

from megatron_2bw.corrections import StaleCorrection
from megatron_2bw.discrepancy import DiscrepancyCorrection
from megatron_2bw.schedules import Action, Kind
from megatron_2bw.schedules.call import Call
from megatron_2bw.schedules.pipemare import (PipeMareOptions, correction_span, forward_delay,
                                             lr_factor)

__all__ = ["Stepping", "after_each_step"]


class Stepping:
    """The runner's optimizer side. Needs ``optimizer``, ``defer``, ``deferred``, ``stale``,
    ``stale_rule``, ``_unwrap_step``, ``step_mode``, ``pipemare``, ``correction``,
    ``loaded_delta``, ``versions``, ``batches_done``, ``schedule``, ``depth`` and ``stage``,
    and the :class:`~megatron_2bw.schedules.timeline.Timeline` methods."""

    def attach_optimizer(self, optimizer, defer: bool = True,
                         correction: StaleCorrection | None = None) -> None:
        """The optimizer the training loop steps after each call. Under 2BW its step is then
        deferred (:mod:`megatron_2bw.deferred`) where that removes a pipeline-wide wait;
        ``defer=False`` keeps it where the loop calls it. ``correction``: 2BW's stale-weight
        correction (:mod:`megatron_2bw.corrections`), before the first call."""
        if self.deferred is not None:
            self.deferred.detach()
            self.deferred = None
        if self._unwrap_step is not None:
            self._unwrap_step()
            self._unwrap_step = None
        if getattr(self.stale, "detach", None) is not None:
            self.stale.detach()
        self.stale = None
        if correction is not None:
            if self.versions is not None and correction != self.stale_rule:
                raise RuntimeError("the stale-weight correction is set before the first call")
            self.stale_rule = correction
        self.optimizer, self.defer, self.step_mode = optimizer, defer, None

    def configure_pipemare(self, options: PipeMareOptions) -> None:
        """PipeMare's techniques (--pipemare-*), before the first call."""
        if self.batches_done:
            raise RuntimeError("configure_pipemare() after the first training call")
        self.pipemare, self.correction = options, None

    def abandon(self) -> None:
        """Training ends here without another step (divergence): a deferred step's pending
        collectives are finished, so every rank has issued the same ones, and not applied."""
        if self.deferred is not None:
            self.deferred.wait_collectives()

    def _step(self, action: Action, call: Call) -> None:
        """S: finalize the batch's gradients and fork the weights for the loop's step; with a
        deferred step, apply the previous one (if still pending) and begin this one."""
        if self.deferred is not None:
            self._apply_deferred()  # the previous step, if no action read it yet
            self.deferred.begin(action.version)
            return
        config = call.config
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                call.models, call.num_tokens if config.calculate_per_token_loss else None,
                pg_collection=call.pg_collection, force_all_reduce=call.force_all_reduce)
        if self.versions is not None:
            self.versions.fork(action.version)

    def _apply_deferred(self) -> None:
        """Run a pending deferred step; timelines show it as a step record where it ran."""
        version, start = self.deferred.pending_version, self._mark()
        self.deferred.apply(self.versions)
        if version is not None and hasattr(self.stale, "after_update"):
            self.stale.after_update()
        if self.correction is not None:
            self.correction.track()
        if version is not None:
            self._record(Kind.STEP.value, None, version, start)

    def _reschedule_lr(self, microbatches: int, batch: int) -> None:
        """PipeMare's T1 (--pipemare-lr-warmup-steps K): the step after batch t (step k = t)
        runs with the learning rate scaled by 1 / tau_i ** (1 - min(k/K, 1)) on this stage
        (`pipemare.lr_factor`), tau_i its largest forward delay, > 1 only at m < d. Scaled in
        the optimizer's groups now, between the call and the loop's ``optimizer.step()``:
        the step (or the deferred step, which records the rate there) reads it, and the
        scheduler's next ``step()`` sets every group's rate afresh."""
        steps = self.pipemare.lr_warmup_steps
        if self.schedule != "pipemare" or not steps or self.optimizer is None:
            return
        factor = lr_factor(batch, steps, forward_delay(self.depth, microbatches, self.stage))
        if factor != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] *= factor

    def _bind_correction(self, microbatches: int) -> None:
        """PipeMare's T2 on this stage, from its first call on (none where no backward reads
        a newer version than its forward: the last stage)."""
        decay = self.pipemare.discrepancy_decay
        if self.schedule != "pipemare" or decay is None or self.correction is not None:
            return
        span = correction_span(self.depth, microbatches, self.stage)
        if span > 0:
            self.correction = DiscrepancyCorrection(self.versions, decay, span)
            if self.loaded_delta is not None:
                self.correction.delta = self.loaded_delta
        self.loaded_delta = None


def after_each_step(optimizer, after: Callable[[], None]) -> Callable[[], None]:
    """Make ``optimizer.step()`` call ``after()`` once the step's weights are written (a
    stale-weight correction where the loop runs the step); returns the undo."""
    original = optimizer.step

    def step(*args, **kwargs):
        result = original(*args, **kwargs)
        after()
        return result

    optimizer.step = step
    return lambda: setattr(optimizer, "step", original)
