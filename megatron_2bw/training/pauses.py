"""The training loop's pauses: when the pipeline must be empty, and telling the schedule.

:class:`Pauses` knows which iterations end in a pause (evaluation, checkpoint, exit, the
end, a batch-size change) and asks a schedule that keeps microbatches in flight (2BW) to
drain early enough (``prepare_drain``, ``drain_notice`` calls ahead), and drains it.
Invariant: every rank decides the same pauses from the same flags and counters, so every
rank's schedule drains in the same call.
"""

from __future__ import annotations

import contextlib

__all__ = ["Pauses"]


class Pauses:
    """The trainer's drains and pause plan. Needs ``args``, ``state``, ``data``, ``timers``
    and ``forward_backward``."""

    def _drain(self) -> None:
        drain = getattr(self.forward_backward, "drain", None)
        if drain is not None:
            drain()

    def _prepare_drain(self, calls: int = 1) -> None:
        """Tell a schedule that keeps microbatches in flight (2BW) that the call ``calls``
        calls from now (1: the coming one) is the last before a pause (evaluation,
        checkpoint, stop, end of training)."""
        prepare = getattr(self.forward_backward, "prepare_drain", None)
        if prepare is not None:
            prepare(calls)

    def _drain_notice(self) -> int:
        """Calls ahead the schedule must know of a pause (1; more under pipedream and pipemare
        at m < d, whose look-ahead forwards reach past the next batch)."""
        notice = getattr(self.forward_backward, "drain_notice", None)
        return 1 if notice is None else notice(self.args.num_microbatches)

    def _announce_pauses(self, upcoming: int, notice: int) -> None:
        """Ask for a drain at the first pause within ``notice`` iterations from ``upcoming``."""
        for ahead in range(notice):
            if self._pauses_after(upcoming + ahead):
                self._prepare_drain(ahead + 1)
                return

    @contextlib.contextmanager
    def _interval_paused(self):
        """Evaluations and checkpoints do not count in the time per iteration (as in
        Megatron-LM, which stops 'interval-time' around them)."""
        self.timers("interval-time").stop()
        try:
            yield
        finally:
            self.timers("interval-time").start()

    def _due(self, interval: int | None, iteration: int | None = None) -> bool:
        iteration = self.state.iteration if iteration is None else iteration
        return interval is not None and iteration % interval == 0

    def _pauses_after(self, iteration: int) -> bool:
        """Whether training pauses after ``iteration`` (evaluation, checkpoint, exit, end)."""
        a = self.args
        evaluates = a.eval_iters > 0 and self.data.valid is not None and self._due(
            a.eval_interval, iteration)
        saves = a.save is not None and self._due(a.save_interval, iteration)
        return (iteration >= a.train_iters or evaluates or saves
                or self._due(a.exit_interval, iteration))

    def _batch_grows_after(self, iteration: int) -> bool:
        """Whether the iteration after ``iteration`` (the next to run) has another number of
        microbatches. 2BW then drains in ``iteration``: its look-ahead forwards would belong to
        a batch of another size (numbered and loss-scaled with this call's m). A drain keeps
        the update rule: batch t reads version max(t-1, 0) whether its forwards ran in this
        call or the next (schedules.twobw)."""
        from megatron.core.num_microbatches_calculator import (
            get_current_global_batch_size, get_num_microbatches, update_num_microbatches)

        assert iteration == self.state.iteration + 1
        consumed = self.state.consumed_train_samples
        update_num_microbatches(consumed, consistency_check=False)
        m, after = get_num_microbatches(), consumed + get_current_global_batch_size()
        update_num_microbatches(after, consistency_check=False)
        grows = get_num_microbatches() != m
        update_num_microbatches(consumed, consistency_check=False)
        return grows
