"""What a timeline records of the executor's actions (``tools/timeline.py``).

:class:`TimelineRecord` is one executed action; :class:`Timeline` is the runner's part that
marks a clock around each action and turns the marks into records once a call ends.
Invariant: marking never waits on the device; the only wait is one per call, when the call's
marks are resolved (on CUDA, its last event).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Timeline", "TimelineRecord"]


@dataclass(frozen=True)
class TimelineRecord:
    """One executed action, for timelines (``tools/timeline.py``): ``start``/``end`` in
    ``time.perf_counter()`` seconds. On CUDA both are CUDA events recorded around the action on
    the current stream, placed on that time line after the call (``runtime.clock``): the
    action's compute, not its launch; on the CPU host clock readings."""

    stage: int
    kind: str
    microbatch: int | None
    version: int | None
    start: float
    end: float


class Timeline:
    """The runner's timeline: ``timeline`` (None, or a list to record into), ``clock`` (made at
    the first mark by ``_timeline_clock()``) and the call's unresolved marks. Needs ``stage``."""

    timeline: list[TimelineRecord] | None
    clock: object
    _unresolved: list[tuple]

    def _mark(self):
        """A clock mark when recording a timeline (None otherwise): a CUDA event on CUDA, the
        host clock on the CPU (``runtime.clock.clock_for``). Never waits."""
        if self.timeline is None:
            return None
        if self.clock is None:
            self.clock = self._timeline_clock()
        return self.clock.mark()

    def _record(self, kind: str, microbatch: int | None, version: int | None, start) -> None:
        """Close the mark ``start`` of ``_mark`` (nothing when not recording). Never waits."""
        if self.timeline is not None and start is not None:
            self._unresolved.append((kind, microbatch, version, start, self.clock.mark()))

    def _resolve_timeline(self) -> None:
        """After a call: the call's marks become TimelineRecords on the perf_counter time line
        (on CUDA this waits for the call's last event, once per call, not per action)."""
        if self.timeline is not None:
            self.timeline += [TimelineRecord(self.stage, kind, microbatch, version,
                                             self.clock.at(start), self.clock.at(end))
                              for kind, microbatch, version, start, end in self._unresolved]
        self._unresolved = []
