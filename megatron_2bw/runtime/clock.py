"""Clocks for timing work without stalling the device: host clocks on the CPU, CUDA events on a GPU.

On CUDA a *mark* is a CUDA event recorded on the current stream (nothing waits), turned into
seconds later, once per iteration or log line, when the events have long completed; on the CPU
a mark is ``time.perf_counter()``.

    clock = clock_for(device)          # HostClock on the CPU, EventClock on CUDA
    start = clock.mark(); work(); end = clock.mark()
    clock.seconds(start, end)          # after the iteration: duration
    clock.at(start)                    # on the perf_counter time line (timelines)

Invariant: :meth:`mark` never blocks the host, except the first mark of an *anchored*
:class:`EventClock` (timelines), which synchronizes its one anchor event.
Why not a host clock or a synchronize: docs/gpu.md, "The runtime, module by module".
"""

from __future__ import annotations

import time
from typing import Callable

import torch

__all__ = ["HostClock", "EventClock", "clock_for"]


class HostClock:
    """Marks are ``time.perf_counter()`` seconds (the CPU: host time is compute time)."""

    events = False

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark: float) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def at(self, mark: float) -> float:
        return mark


class EventClock:
    """Marks are CUDA events (timing enabled) recorded on the current stream; ``new_event``
    makes one (``torch.cuda.Event(enable_timing=True)`` unless given). ``anchored``: the
    clock can place marks on the host's time line (:meth:`at`)."""

    events = True

    def __init__(self, new_event: Callable[[], object] | None = None, anchored: bool = False):
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self.anchored = anchored
        self._anchor: tuple[object, float] | None = None  # (event, perf_counter when it ran)

    def mark(self):
        if self.anchored and self._anchor is None:
            anchor = self._record()
            anchor.synchronize()  # once per clock: ties event time to the host's time line
            self._anchor = (anchor, time.perf_counter())
        return self._record()

    def _record(self):
        event = self._new_event()
        event.record()
        return event

    def ready(self, mark) -> bool:
        """Whether the event has run (never blocks)."""
        return mark.query()

    def seconds(self, start, end) -> float:
        """Device time from ``start`` to ``end``; waits for ``end`` to run."""
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def at(self, mark) -> float:
        """``mark`` on the host's perf_counter time line; waits for it to run."""
        if self._anchor is None:
            raise RuntimeError("EventClock.at() needs an anchored clock that made a mark")
        anchor, host_time = self._anchor
        return host_time + self.seconds(anchor, mark)


def clock_for(device: torch.device, anchored: bool = False) -> HostClock | EventClock:
    """CUDA events on a CUDA device, the host clock on the CPU (the CPU runtime included).
    ``anchored``: marks will be placed on the host's time line (timelines)."""
    return EventClock(anchored=anchored) if device.type == "cuda" else HostClock()
