"""Point-to-point transfers between neighbouring pipeline stages (NCCL on GPU, gloo on CPU).

The executor hands over one `Exchange` of a stage's program at a time (`schedules.comm`):
its sends and receives, to either neighbour, go out as ONE ``batch_isend_irecv`` group, and the
call returns when all of them completed. That is what NCCL needs: a send completes only once the
peer's matching receive runs, p2p between two ranks runs in issue order, and the pass that made
the program mirrored every group on the peer, so the two sides always meet. Every wait is bounded
by ``--distributed-timeout-minutes``, the pipeline group's timeout (a plain ``wait()``, as
megatron-core's; gloo raises when it runs out, NCCL's watchdog aborts the communicator); a wait
that fails names the peer and the transfers.

Every ``torch.distributed`` call of the executor lives here, on the main thread.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_2bw.schedules.comm import Exchange, Transfer

__all__ = ["StageComm", "CommError"]


class CommError(RuntimeError):
    """A transfer with a neighbouring stage failed; the message names the peer and what."""


class StageComm:
    """This rank's links to the previous and next pipeline stage (same TP/DP coordinates)."""

    def __init__(self, tensor_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 timeout: datetime.timedelta):
        from megatron.core import parallel_state as ps

        self.group = ps.get_pipeline_model_parallel_group()
        self.stage = ps.get_pipeline_model_parallel_rank()
        depth = ps.get_pipeline_model_parallel_world_size()
        # megatron-core's previous and next ranks wrap around: the ring of virtual stages
        self.ranks = {(self.stage - 1) % depth: ps.get_pipeline_model_parallel_prev_rank(),
                      (self.stage + 1) % depth: ps.get_pipeline_model_parallel_next_rank()}
        self.shape = tensor_shape
        self.dtype = dtype
        self.device = device
        self.timeout = timeout

    def _who(self, stage: int) -> str:
        return f"rank {self.ranks[stage]} (stage {stage})"

    def exchange(self, exchange: Exchange, outgoing: dict[tuple[str, int, int], torch.Tensor],
                 before: str) -> dict[tuple[str, int, int], torch.Tensor]:
        """Run one fused group: send ``outgoing[transfer.key]`` for each send, and return the
        received tensors by their transfers' keys (tensor, microbatch, the sender's chunk).
        ``before`` names the action that follows, for error messages."""
        ops, received = [], {}
        for t in exchange.transfers:
            key = t.key
            if t.op == "send":
                tensor = self._checked(outgoing[key], t)
                ops.append(dist.P2POp(dist.isend, tensor, self.ranks[t.peer], self.group))
            else:
                received[key] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, received[key], self.ranks[t.peer], self.group))
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as error:  # gloo raises RuntimeError, NCCL DistBackendError
            raise CommError(self._stalled(exchange, before, error)) from error
        for work in works:
            self._wait(work, exchange, before)
        return received

    def _checked(self, tensor: torch.Tensor, transfer: Transfer) -> torch.Tensor:
        if tuple(tensor.shape) != tuple(self.shape) or tensor.dtype != self.dtype:
            raise CommError(f"stage {self.stage}: {transfer.describe()}: shape "
                            f"{tuple(tensor.shape)} {tensor.dtype}, the pipeline expects "
                            f"{self.shape} {self.dtype}")
        return tensor.detach().contiguous()

    def _wait(self, work, exchange: Exchange, before: str) -> None:
        """Wait for one transfer of the group, bounded by the pipeline group's timeout
        (``--distributed-timeout-minutes``), as megatron-core waits: a plain ``wait()``. A
        timed ``wait(timeout=...)`` would make NCCL's host thread poll the transfer."""
        try:
            completed = work.wait()
        except Exception as error:
            raise CommError(self._stalled(exchange, before, error)) from error
        if completed is False:  # a backend that reports the timeout instead of raising
            raise CommError(self._stalled(exchange, before, "timed out"))

    def _stalled(self, exchange: Exchange, before: str, error) -> str:
        peers = sorted({t.peer for t in exchange.transfers})
        what = "; ".join(t.describe() for t in exchange.transfers)
        return (f"stage {self.stage}: waiting on {' and '.join(self._who(p) for p in peers)} "
                f"for the exchange before {before} ({what}) failed or ran past "
                f"--distributed-timeout-minutes {self.timeout.total_seconds() / 60:g}: {error}")
