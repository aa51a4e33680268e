"""The training loop's evaluate phase: the mean loss over --eval-iters batches.

:class:`Evaluate` drains the schedule and runs its forward-only calls with the model in eval
mode, the timers detached and the parameter all-gather hooks paused.
Invariant: an evaluation leaves training as it was: torch's global CPU generator
(``training_rng_untouched``), the model back in train mode, the same batches every time.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from megatron_2bw.training import build, logs
from megatron_2bw.training.step import mean_losses_over_data_parallel

__all__ = ["Evaluate", "training_rng_untouched"]


class Evaluate:
    """The trainer's evaluation. Needs ``args``, ``model``, ``config``, ``forward_backward``,
    ``housekeeping``, ``logger``, ``state``, ``loss_key`` and ``loss_stage``, and ``_drain``
    and ``_schedule_kwargs``."""

    @torch.no_grad()
    def evaluate(self, make_iterator: Callable[[], object], split: str = "validation") -> float:
        """Mean loss over --eval-iters batches (the same batches at every evaluation); every
        loss of the loss dict is logged."""
        self._drain()
        for chunk in self.model:
            chunk.eval()
        losses = []
        with self.housekeeping.evaluating(), logs.timers_detached(self.config), \
                build.forward_pre_hook_paused(self.model), training_rng_untouched():
            iterator = make_iterator()
            for _ in range(self.args.eval_iters):
                loss_dicts = self.forward_backward(  # full batches, as Megatron-LM evaluates
                    data_iterator=iterator,
                    **self._schedule_kwargs(True, self.args.num_microbatches))
                losses.append(mean_losses_over_data_parallel(loss_dicts, self.loss_stage))
        for chunk in self.model:
            chunk.train()
        if losses[0] is None:
            return None
        means = {key: sum(each[key] for each in losses) / len(losses) for key in losses[0]}
        self.logger.validation(self.state.iteration, means, split,
                               self.state.consumed_train_samples)
        return means[self.loss_key]


@contextlib.contextmanager
def training_rng_untouched():
    """Around building data iterators and around evaluations: torch's global CPU generator is
    as it was before. A DataLoader iterator draws its base seed from that generator when it is
    made (an evaluation's cyclic one at its first batch), and dropout reads the same generator
    (the CPU runtime's "cuda" generator is that one). Without this, the iterators a resumed run
    builds after restoring the checkpoint's RNG state, and every evaluation, would shift the
    dropout masks of the iterations after them: a resumed run, or one that evaluates, would not
    train as the uninterrupted run without evaluations does."""
    with torch.random.fork_rng(devices=[]):
        yield
