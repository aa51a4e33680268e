"""Point-to-point transfers between neighbouring pipeline stages (gloo on CPU, NCCL on GPU).

Receives block (the action needs the tensor); sends are asynchronous and complete in the
background, so a send whose receive is only posted in the peer's next Megatron call (2BW's
look-ahead activation) never blocks this stage. Every ``torch.distributed`` call of the
executor lives here.

Invariant: messages between two stages are matched in order (NCCL has no tags), so each
direction carries one kind of tensor: activations flow to stage+1, gradients to stage-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["StageComm", "CommError"]


class CommError(RuntimeError):
    """A transfer with a neighbouring stage failed; the message names the peer and what."""


@dataclass
class _PendingSend:
    work: object
    tensor: torch.Tensor  # kept alive until the transfer completed
    what: str


class StageComm:
    """This rank's links to the previous and next pipeline stage (same TP/DP coordinates)."""

    def __init__(self, tensor_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        from megatron.core import parallel_state as ps

        self.group = ps.get_pipeline_model_parallel_group()
        self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()
        self.next_rank = ps.get_pipeline_model_parallel_next_rank()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.shape = tensor_shape
        self.dtype = dtype
        self.device = device
        self.pending: list[_PendingSend] = []

    def _recv(self, src: int, what: str) -> torch.Tensor:
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device, requires_grad=False)
        try:
            dist.irecv(buffer, src=src, group=self.group).wait()
        except Exception as error:  # gloo raises RuntimeError, NCCL DistBackendError
            raise CommError(f"stage {self.stage}: receiving {what} from rank {src} failed: "
                            f"{error}") from error
        return buffer

    def _send(self, tensor: torch.Tensor, dst: int, what: str) -> None:
        tensor = tensor.detach()  # an alias: the caller may free the original's storage
        if tuple(tensor.shape) != tuple(self.shape) or tensor.dtype != self.dtype:
            raise CommError(f"stage {self.stage}: {what} has shape {tuple(tensor.shape)} "
                            f"{tensor.dtype}, the pipeline expects {self.shape} {self.dtype}")
        try:
            work = dist.isend(tensor.contiguous(), dst=dst, group=self.group)
        except Exception as error:
            raise CommError(f"stage {self.stage}: sending {what} to rank {dst} failed: "
                            f"{error}") from error
        self.pending.append(_PendingSend(work, tensor, what))
        self._prune()

    def _prune(self) -> None:
        self.pending = [p for p in self.pending if not p.work.is_completed()]

    def recv_activation(self, microbatch: int) -> torch.Tensor:
        """The previous stage's output for ``microbatch``; it becomes this stage's input."""
        tensor = self._recv(self.prev_rank, f"activation of microbatch {microbatch}")
        tensor.requires_grad_(True)
        return tensor

    def recv_grad(self, microbatch: int) -> torch.Tensor:
        return self._recv(self.next_rank, f"output gradient of microbatch {microbatch}")

    def send_activation(self, tensor: torch.Tensor, microbatch: int) -> None:
        self._send(tensor, self.next_rank, f"activation of microbatch {microbatch}")

    def send_grad(self, tensor: torch.Tensor, microbatch: int) -> None:
        self._send(tensor, self.prev_rank, f"input gradient of microbatch {microbatch}")

    def wait_sends(self) -> None:
        """Block until every send completed (before a checkpoint, at the end of training)."""
        for pending in self.pending:
            try:
                pending.work.wait()
            except Exception as error:
                raise CommError(f"stage {self.stage}: sending {pending.what} failed: "
                                f"{error}") from error
        self.pending = []
