"""Bytes a process writes by copying tensors, counted with a dispatch mode: ``copy_``,
``clone`` and ``_to_copy`` (also ``.contiguous()``, ``.to()``, ``.clone()``). The mode slows
every op, so measure one iteration, not a timed one."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CopiedBytes"]

_COPY_OPS = (torch.ops.aten.copy_.default, torch.ops.aten.clone.default,
             torch.ops.aten._to_copy.default)


class CopiedBytes:
    """``bytes``: what the copies wrote while a ``with counter.counting():`` block ran (the
    count adds up over blocks)."""

    def __init__(self):
        self.bytes = 0

    def counting(self) -> TorchDispatchMode:
        counter = self

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in _COPY_OPS:
                    counter.bytes += out.numel() * out.element_size()
                return out

        return Count()
