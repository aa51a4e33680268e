"""The executor's exchange handler and the boxes tensors pass through between virtual stages.

:class:`Mailbox` runs the ``{..}`` steps (one fused send/receive group each, through
``p2p.StageComm``) and keeps, keyed (tensor, microbatch, the maker's chunk), the inbox
(received), the outbox (made, not sent) and the handoff (the V's turn: a chunk's output for
this stage's next chunk, detached, never sent). Invariant: the stage's point-to-point
traffic is one ``StageComm.exchange`` per exchange step, in program order, on every rank.
"""

from __future__ import annotations

import torch

from megatron_2bw.schedules import Exchange
from megatron_2bw.schedules.call import Call

__all__ = ["Mailbox"]


class Mailbox:
    """The runner's exchanges and boxes. Needs ``inbox``, ``outbox``, ``handoff``, ``comm``,
    ``stage``, ``chunks`` and ``placement``."""

    def _exchange(self, exchange: Exchange, before: str, call: Call) -> None:
        """One fused send/receive group; a sent activation's storage is then released as
        Megatron does (its autograd graph stays for the backward)."""
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        sends = [t.key for t in exchange.transfers if t.op == "send"]
        outgoing = {key: self.outbox.pop(key) for key in sends}
        self.inbox.update(self.comm.exchange(exchange, outgoing, before))
        for (tensor, _, _), output in outgoing.items():
            if tensor == "activation":
                deallocate_output_tensor(output, call.config.deallocate_pipeline_outputs)

    def _first(self, chunk: int) -> bool:
        """Whether ``chunk`` of this stage is the model's first virtual stage (reads data)."""
        return self.placement.is_first(self.stage, chunk)

    def _last(self, chunk: int) -> bool:
        """Whether ``chunk`` of this stage is the model's last virtual stage (the loss)."""
        return self.placement.is_last(self.stage, chunk)

    def _take(self, tensor: str, microbatch: int, chunk: int, step: int) -> torch.Tensor | None:
        """What the virtual stage `step` (+-1) away from ``chunk`` made for ``microbatch``:
        received from its stage, or handed over by this stage's other chunk (the V's turn);
        None past the model's ends."""
        maker = self.placement.neighbour(self.stage, chunk, step)
        if maker is None:
            return None
        box = self.handoff if maker[0] == self.stage else self.inbox
        return box.pop((tensor, microbatch, maker[1]))

    def _give(self, tensor: str, microbatch: int, chunk: int, step: int,
              value: torch.Tensor) -> None:
        """Pass ``value`` to the virtual stage `step` (+-1) away: into the outbox for its
        stage, or, on this stage (the V's turn), detached as a received tensor would be."""
        taker = self.placement.neighbour(self.stage, chunk, step)
        if taker is None:
            return
        if taker[0] == self.stage:
            self.handoff[tensor, microbatch, chunk] = value.detach()
        else:
            self.outbox[tensor, microbatch, chunk] = value

    def _input(self, microbatch: int, chunk: int) -> torch.Tensor | None:
        """The previous virtual stage's output for ``microbatch`` (None on the first)."""
        received = self._take("activation", microbatch, chunk, -1)
        return None if received is None else received.requires_grad_(True)

    def _output_grad(self, microbatch: int, chunk: int) -> torch.Tensor | None:
        """The next virtual stage's input gradient for ``microbatch`` (None on the last: its
        output is the loss)."""
        return self._take("grad", microbatch, chunk, 1)

    def _vp_stage(self, chunk: int) -> int | None:
        """megatron-core's ``vp_stage`` of a chunk: None without virtual stages."""
        return chunk if self.chunks > 1 else None
