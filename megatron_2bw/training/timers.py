"""megatron-core's timers without a device synchronize, for our schedules.

megatron-core's ``Timer.start``/``stop`` call ``torch.cuda.synchronize()``, which would wait for
the collectives 2BW's deferred step leaves in flight and stall the launch queue once per
microbatch at level 2. Under our schedules the timers mark start and stop with
:mod:`megatron_2bw.runtime.clock` instead (CUDA events resolved at the log line; the host clock
on the CPU); under ``--pipeline-schedule megatron`` megatron-core's own ``Timers`` stay.

Invariants: no timer blocks the host; timers never read do not pile up (a timer resolves the
spans whose events already ran once it holds many); names, levels, the all-gather at the log
line, the strings and TensorBoard writes are megatron-core's.

More: docs/gpu.md, "The runtime, module by module".
"""

from __future__ import annotations

import torch
from megatron.core.timers import Timer, Timers

from megatron_2bw.runtime.clock import EventClock, HostClock, clock_for

__all__ = ["StreamTimer", "StreamTimers", "timers_for", "syncs_device"]

_SETTLE_AT = 64  # unresolved spans a timer holds before it resolves those that ran


def syncs_device(schedule: str) -> bool:
    """Whether the timers of a run under ``schedule`` synchronize the device (and barrier at
    level 1): only megatron-core's own schedule, timed as Megatron-LM times it."""
    return schedule == "megatron"


class StreamTimer(Timer):
    """A megatron-core ``Timer`` whose start and stop are clock marks: no device synchronize,
    no barrier (the ``barrier`` arguments are accepted and ignored)."""

    def __init__(self, name: str, clock: HostClock | EventClock):
        super().__init__(name)
        self.clock = clock
        self._opened = None
        self._spans: list[tuple] = []  # (start, stop) marks not yet added to the elapsed time

    def start(self, barrier: bool = False) -> None:
        assert not self._started, "timer has already been started"
        self._opened, self._started = self.clock.mark(), True

    def stop(self, barrier: bool = False) -> None:
        assert self._started, "timer is not started"
        self._spans.append((self._opened, self.clock.mark()))
        self._started = False
        if len(self._spans) >= _SETTLE_AT:
            self._settle(only_ready=True)

    def _settle(self, only_ready: bool = False) -> None:
        """Add the spans' durations to the elapsed time (with ``only_ready``, only those
        whose stop mark already ran, without waiting)."""
        waiting = []
        for start, stop in self._spans:
            if only_ready and not self.clock.ready(stop):
                waiting.append((start, stop))
                continue
            seconds = self.clock.seconds(start, stop)
            self._elapsed += seconds
            self._active_time += seconds
        self._spans = waiting

    def reset(self) -> None:
        super().reset()
        self._spans = []

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        started = self._started
        if started:
            self.stop()
        self._settle()
        elapsed = self._elapsed
        if reset:
            self.reset()
        if started:
            self.start()
        return elapsed

    def active_time(self) -> float:
        self._settle()
        return self._active_time


class StreamTimers(Timers):
    """megatron-core's ``Timers`` whose timers are :class:`StreamTimer` on ``device``'s clock."""

    def __init__(self, log_level: int, log_option: str, device: torch.device):
        super().__init__(log_level, log_option)
        self.clock = clock_for(device)

    def __call__(self, name: str, log_level: int | None = None):
        timer = super().__call__(name, log_level)
        if type(timer) is Timer:  # made just now by megatron-core
            timer = self._timers[name] = StreamTimer(name, self.clock)
        return timer


def timers_for(schedule: str, log_level: int, log_option: str, device: torch.device) -> Timers:
    """megatron-core's ``Timers`` under its own schedule; :class:`StreamTimers` otherwise."""
    if syncs_device(schedule):
        return Timers(log_level, log_option)
    return StreamTimers(log_level, log_option, device)
