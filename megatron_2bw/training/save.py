"""The training loop's save phase: a checkpoint of the drained pipeline.

:class:`Save` drains the schedule, refuses non-finite weights (all ranks agree, then
:class:`~megatron_2bw.training.guard.Divergence`), and writes the checkpoint with the
schedule's own entries (``checkpoint_extra``) and the FLOPs count so far.
Invariant: nothing is written from non-finite weights, and every rank makes the same
collectives in the same order (the all-reduce of the finiteness flag, then the save).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.training import build, checkpointing
from megatron_2bw.training.guard import Divergence, nonfinite

__all__ = ["Save"]


class Save:
    """The trainer's save. Needs ``args``, ``forward_backward``, ``model``, ``optimizer``,
    ``scheduler``, ``state``, ``info``, ``logger``, ``flops_per_iteration`` and
    ``_flops_counted_at``, and ``_drain`` (:class:`~megatron_2bw.training.pauses.Pauses`)."""

    def _weights(self) -> list[torch.Tensor]:
        """The weights a checkpoint would hold: every alive version of a version-keeping
        schedule, else the parameters."""
        tensors = getattr(self.forward_backward, "weight_tensors", lambda: None)()
        if tensors is not None:
            return tensors
        return [p.data for chunk in self.model for p in chunk.parameters()]

    def _check_weights_before_saving(self) -> None:
        """No checkpoint is written from non-finite weights (any precision, checked or not):
        all ranks agree, then raise Divergence."""
        flag = nonfinite(self._weights()).reshape(1).to(self.info.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self._abandon()
            raise Divergence(f"iteration {self.state.iteration}: the weights are not finite "
                             f"(NaN or inf); training stopped without saving"
                             f"{self._untouched()}")

    def _abandon(self) -> None:
        abandon = getattr(self.forward_backward, "abandon", None)
        if abandon is not None:
            abandon()

    def _untouched(self) -> str:
        return f" (the last checkpoint in {self.args.save} is untouched)" if self.args.save \
            else ""

    def save(self) -> None:
        """Drain, refuse non-finite weights, write the checkpoint with the schedule's own
        entries; every rank calls it at the same iteration."""
        self._drain()
        self._check_weights_before_saving()
        fb, model = self.forward_backward, self.model
        extra = None
        if hasattr(fb, "checkpoint_extra"):
            extra = lambda sharded: fb.checkpoint_extra(model, sharded)  # noqa: E731
        iteration, flops = self._flops_counted_at
        self.state.num_floating_point_operations_so_far = (
            flops + (self.state.iteration - iteration) * self.flops_per_iteration)
        with build.forward_pre_hook_paused(self.model):  # saves the all-gathered weights
            path = checkpointing.save_checkpoint(
                self.args.save, self.model, self.optimizer, self.scheduler, self.state,
                self.args, extra=extra, keep=self.args.ckpt_keep)
        self.logger.print(f" saved checkpoint at iteration {self.state.iteration} to {path}")
