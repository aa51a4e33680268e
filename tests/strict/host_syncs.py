"""Host-sync counter: every call that makes the host wait for the device, counted where it is made.

On CPU processes ``.item()``, ``float(t)``, ``.cpu()``, ``.tolist()``, ``torch.cuda.synchronize()``
and the like do not wait, so :func:`install` wraps each and counts it, whatever the tensor's
device, filed under the call's site (the first frame outside torch and this module).

Invariants: only the outermost call counts (``float(t)`` calling ``t.item()`` is one sync); the
stand-ins of the CPU runtime are wrapped too. Installed at interpreter start by
``tests/strict/sitecustomize.py`` when ``MEGATRON_2BW_COUNT_HOST_SYNCS=1``; :func:`counter` reads
the counts (None where not installed); tests/schedule_worker.py snapshots them per iteration.

The calls counted: docs/testing.md, "Counting host syncs".
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading

__all__ = ["TENSOR_CALLS", "Counter", "install", "counter", "enabled"]

TENSOR_CALLS = ("item", "__float__", "__int__", "__bool__", "cpu", "tolist", "numpy")
_SYNCHRONIZING = ("Event", "Stream")  # torch.cuda classes whose synchronize() waits
_MARK = "_megatron_2bw_host_sync_counter"  # on every wrapper: the process's one Counter


def enabled() -> bool:
    return os.environ.get("MEGATRON_2BW_COUNT_HOST_SYNCS", "0") == "1"


class Counter:
    """Host syncs of this process so far: the total and per (call, site)."""

    def __init__(self):
        self.total = 0
        self.by_site: collections.Counter = collections.Counter()
        self._depth = threading.local()

    def snapshot(self) -> tuple[int, dict]:
        return self.total, dict(self.by_site)

    def wrap(self, name: str, original):
        """``original`` counting one sync per outermost call."""

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self.total += 1
                self.by_site[f"{name} {_site()}"] += 1
            self._depth.n = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.n = depth

        setattr(counted, _MARK, self)
        return counted


_PASSING = (os.sep + "torch" + os.sep, os.path.join("megatron_2bw", "runtime", "cpu.py"))
"""Frames that only pass a call on: torch's, and the CPU runtime's device-mapping mode."""


def _site() -> str:
    """``path:line`` of the innermost frame outside torch, the CPU runtime and this module."""
    frame = sys._getframe(2)
    while frame is not None and (any(part in frame.f_code.co_filename for part in _PASSING)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for marker in ("megatron_2bw" + os.sep, "megatron" + os.sep, "tests" + os.sep):
        if marker in path:
            path = path[path.rindex(marker):]
            break
    return f"{path}:{frame.f_lineno}"


def counter() -> Counter | None:
    """This process's counter, whichever copy of this module installed it."""
    import torch

    return getattr(torch.Tensor.item, _MARK, None)


def install() -> Counter:
    """Wrap the syncing calls in this process (idempotent); return the counter."""
    import torch
    import torch.cuda

    found = counter()
    if found is not None:
        return found
    count = Counter()
    for name in TENSOR_CALLS:
        setattr(torch.Tensor, name, count.wrap(f"Tensor.{name}", getattr(torch.Tensor, name)))

    class CountingCudaModule(type(torch.cuda)):
        """torch.cuda whose ``synchronize`` and Event/Stream classes count, whoever sets them."""

        def __setattr__(self, name, value):
            super().__setattr__(name, _counted_cuda_attribute(count, name, value))

    torch.cuda.__class__ = CountingCudaModule
    for name in ("synchronize", *_SYNCHRONIZING):
        setattr(torch.cuda, name, getattr(torch.cuda, name))  # through __setattr__
    return count


def _counted_cuda_attribute(count: Counter, name: str, value):
    if name == "synchronize" and callable(value) and not hasattr(value, _MARK):
        return count.wrap("cuda.synchronize", value)
    if name in _SYNCHRONIZING and isinstance(value, type):
        method = value.__dict__.get("synchronize")
        if method is not None and not hasattr(method, _MARK):
            setattr(value, "synchronize", count.wrap(f"cuda.{name}.synchronize", method))
    return value
