"""The one place that decides what a process runs on: CUDA with NCCL whenever CUDA is usable,
unless the user passed ``--cpu``; otherwise the CPU, with gloo and the CPU runtime
(:mod:`megatron_2bw.runtime.cpu`).

:func:`choose_device` is the decision as a pure function; :func:`device_kind` asks it for this
process without acting on it; :func:`select_device` acts on it once per training process.

Invariants:
  * On CUDA, ``torch.cuda.set_device(LOCAL_RANK)`` runs in :func:`select_device` before any
    communicator or CUDA tensor exists.
  * The CPU runtime is never active while training on CUDA (:func:`select_device` raises).
  * :func:`training_device` reports what :func:`select_device` chose; nothing else decides the
    device from ``torch.cuda.is_available()``.
More: docs/gpu.md, "The runtime, module by module".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from megatron_2bw.runtime import cpu

__all__ = ["DeviceChoice", "choose_device", "device_kind", "select_device", "device_choice",
           "on_cuda", "training_device", "to_device"]


@dataclass(frozen=True)
class DeviceChoice:
    """What a process trains on: ``kind`` "cuda" (device ``index``, NCCL) or "cpu" (gloo, the
    CPU runtime installed); ``reason`` says why, for logs."""

    kind: str
    index: int | None
    backend: str
    reason: str


_choice: DeviceChoice | None = None  # set by select_device()


def choose_device(force_cpu: bool, cuda_usable: bool, local_rank: int) -> DeviceChoice:
    """The device decision as a pure function: CUDA device ``local_rank`` with NCCL when CUDA is
    usable and the user did not pass ``--cpu``; the CPU with gloo otherwise."""
    if force_cpu:
        return DeviceChoice("cpu", None, "gloo", "--cpu")
    if not cuda_usable:
        return DeviceChoice("cpu", None, "gloo", "CUDA is not usable")
    return DeviceChoice("cuda", local_rank, "nccl", f"CUDA device {local_rank} (LOCAL_RANK)")


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device_kind(force_cpu: bool = False) -> str:
    """The device kind this process would train on, "cuda" or "cpu" (:func:`choose_device`
    for this process), without preparing it: :func:`select_device` does that."""
    return choose_device(force_cpu, cpu.cuda_usable(), local_rank=0).kind


def select_device(force_cpu: bool) -> DeviceChoice:
    """Choose this process's device and prepare it: ``torch.cuda.set_device(LOCAL_RANK)`` on
    CUDA, the CPU runtime on the CPU. Safe to call again with the same answer. Call it before any
    process group or CUDA tensor exists.

    Raises RuntimeError when the CPU runtime is active but the process is to train on CUDA."""
    global _choice
    choice = choose_device(force_cpu, cpu.cuda_usable(), _local_rank())
    if choice.kind == "cuda":
        if cpu.is_installed():
            raise RuntimeError(
                "the CPU runtime is active in a process that trains on CUDA: it must never "
                "be; pass --cpu to train on the CPU, or do not install it")
        torch.cuda.set_device(choice.index)
    else:
        cpu.install(force=force_cpu)
    _choice = choice
    return choice


def device_choice() -> DeviceChoice | None:
    """The choice :func:`select_device` made in this process, None before it ran."""
    return _choice


def on_cuda(force_cpu: bool) -> bool:
    """Whether this process trains on CUDA: the choice :func:`select_device` made, or before it
    ran (the planner's profiler builds blocks without it) the one :func:`device_kind` gives."""
    if _choice is not None:
        return _choice.kind == "cuda"
    return device_kind(force_cpu) == "cuda"


def training_device() -> torch.device:
    """The device this process trains on: ``cuda:<current device>`` on CUDA, ``cpu`` under the
    CPU runtime. Decided by :func:`select_device` (``distributed.initialize`` calls it), never by
    ``torch.cuda.is_available()`` (``--cpu`` on a GPU host gives ``cpu``)."""
    if _choice is None:
        raise RuntimeError("training_device() before megatron_2bw.runtime.distributed."
                           "initialize(): the device is not chosen yet")
    if _choice.kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch`` with every tensor on ``device``. On a CUDA device each tensor is copied from
    pinned host memory with ``non_blocking=True`` (the copy is ordered on the current stream,
    before any kernel that reads it); non-tensors (None) pass through. On the CPU the batch is
    returned as it is: nothing moves, nothing is pinned."""
    if device.type == "cpu":
        return batch
    return {key: _to_device(value, device) for key, value in batch.items()}


def _to_device(value: Any, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor) or value.device == device:
        return value
    if value.device.type == "cpu" and not value.is_pinned():
        value = value.pin_memory()
    return value.to(device, non_blocking=True)
