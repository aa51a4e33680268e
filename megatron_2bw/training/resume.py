"""The training loop's resume phase: the checkpoint a run starts from.

:class:`Resume` loads --load's latest checkpoint into the model, optimizer and scheduler,
with the schedule's own entries (a version-keeping schedule's older weights) through its
``prepare_load``/``checkpoint_loaded`` hooks, and notes where the FLOPs count resumes.
Invariant: every rank loads the same iteration, or none (a fresh TrainState).
"""

from __future__ import annotations

from megatron_2bw.training import checkpointing
from megatron_2bw.training.checkpointing import TrainState

__all__ = ["Resume"]


class Resume:
    """The trainer's load. Needs ``args``, ``forward_backward``, ``model``, ``optimizer``,
    ``scheduler`` and ``logger``."""

    def _maybe_load(self) -> TrainState:
        """The checkpoint's TrainState (or a fresh one); notes where the FLOPs count resumes
        (Megatron-LM's num_floating_point_operations_so_far)."""
        self._flops_counted_at = (0, 0)
        if not self.args.load:
            return TrainState()
        fb, model = self.forward_backward, self.model
        hooks = {}
        if hasattr(fb, "prepare_load"):
            hooks = dict(extra=lambda sharded, path: fb.prepare_load(model, sharded, path),
                         on_loaded=lambda loaded: fb.checkpoint_loaded(model, loaded))
        state = checkpointing.load_checkpoint(
            self.args.load, self.model, self.optimizer, self.scheduler, self.args,
            warn=self.logger.print, **hooks)
        if state is None:
            self.logger.print(f" no checkpoint found in {self.args.load}: starting from scratch")
            return TrainState()
        self.logger.print(f" resumed from {self.args.load} at iteration {state.iteration}")
        self._flops_counted_at = (state.iteration, state.num_floating_point_operations_so_far)
        return state
