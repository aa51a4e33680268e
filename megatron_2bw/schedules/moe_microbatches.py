"""What a Mixture-of-Experts model keeps per microbatch, tied to the microbatch rather than to
"the current step" (under 2BW a microbatch's forward and backward can straddle a step):

  * :func:`aux_loss_scale_for_backward`: the aux-loss gradient scale a microbatch's backward
    reads, computed for that microbatch;
  * :class:`AuxLossLedger`: the aux losses each forward adds to megatron-core's tracker, booked
    by batch, so an iteration logs its own batch's.
"""

from __future__ import annotations

import torch

__all__ = ["aux_loss_scale_for_backward", "AuxLossLedger"]


def aux_loss_scale_for_backward(config, num_microbatches: int) -> None:
    """Set megatron-core's aux-loss gradient scale (``MoEAuxLossAutoScaler``, one process-wide
    tensor) for the backward about to run, as megatron-core's ``forward_step_calc_loss`` sets
    it after each forward: the loss scale now (``config.grad_scale_func``), over the
    microbatch's batch size unless the loss is per token. The main loss of that microbatch
    gets the same: divided by its batch's m at its forward, multiplied by the loss scale at
    its backward. Set at the backward, not left from the last forward, a microbatch whose
    forward and backward lie on two sides of a step (2BW's look-ahead forwards) reads the
    scale of its own backward. No host sync (a device tensor op)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    current = MoEAuxLossAutoScaler.main_loss_backward_scale
    device = current.device if current is not None else torch.device("cpu")
    one = torch.ones(1, device=device)
    scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    if not config.calculate_per_token_loss:
        scale = scale / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale)


class AuxLossLedger:
    """megatron-core's routers add each forward's aux losses to one process-wide tracker
    (``moe_utils`` ``_MOE_LAYER_WISE_LOGGING_TRACKER``: per name, a value per layer), which
    Megatron-LM reads and clears after each iteration. Under 2BW a call runs forwards of the
    next batch too, so the tracker would mix two batches: here each forward's addition is kept
    by its batch (:meth:`forward`), and after a call the tracker holds exactly that call's
    batch's (:meth:`settle`). Device tensor ops only (no host sync)."""

    def __init__(self):
        self.by_batch: dict[int, dict[str, torch.Tensor]] = {}

    @staticmethod
    def _values() -> dict[str, torch.Tensor]:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return {name: entry["values"] for name, entry in
                get_moe_layer_wise_logging_tracker().items()}

    def forward(self, batch: int, run) -> object:
        """Run ``run()`` (a microbatch's forward) and book what it added to the tracker to
        ``batch``; returns what ``run`` returns."""
        before = {name: values.clone() for name, values in self._values().items()}
        result = run()
        booked = self.by_batch.setdefault(batch, {})
        for name, values in self._values().items():
            added = values - before[name] if name in before else values.clone()
            booked[name] = booked[name] + added if name in booked else added
        return result

    def settle(self, batch: int) -> None:
        """The tracker now holds ``batch``'s additions alone (zeros for a name it has none
        of); later batches' stay booked."""
        booked = self.by_batch.pop(batch, {})
        for name, values in self._values().items():
            values.copy_(booked[name]) if name in booked else values.zero_()

    def clear(self) -> None:
        self.by_batch.clear()
