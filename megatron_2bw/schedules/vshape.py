"""V-shape schedules: ZB-V and DualPipeV, two model chunks per stage in the V placement.

Stage i holds chunk 0 = virtual stage i and chunk 1 = virtual stage 2d-1-i
(`actions.Placement.v`): a microbatch goes down through chunk 0, turns on stage d-1 without a
transfer and comes back up through chunk 1 to the loss on stage 0. ZB-V follows
torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` order (Qi et al., ICLR 2024,
Section 6), DualPipeV torch's ``ScheduleDualPipeV`` (DeepSeek-V3's DualPipe cut in half;
m >= 2d), its overlapped forward-backward pairs run as an F then a B.

Invariants: both split backwards into I and W and are synchronous (batch b reads version b;
every call fills and drains).

The orders phase by phase: docs/schedules.md, "ZB-V and DualPipeV".
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable

from .actions import Action, Kind

__all__ = ["zbv", "dualpipev", "vshape_stash", "vshape_weight_grads"]


class _Order:
    """A stage's actions as they are appended: each (kind, chunk) takes the next microbatch of
    the batch in turn (B and I share one count: a backward is one or the other)."""

    def __init__(self, batch: int, microbatches: int) -> None:
        self.batch, self.m = batch, microbatches
        self.actions: list[Action] = []
        self.count: Counter = Counter()
        self.weight_queue: deque[tuple[int, int]] = deque()  # (microbatch, chunk) after I

    def add(self, kind: Kind, chunk: int) -> None:
        key = (Kind.INPUT_GRAD if kind is Kind.BACKWARD else kind, chunk)
        j = self.count[key]
        self.count[key] += 1
        self.actions.append(Action(kind, self.batch * self.m + j, self.batch, self.batch, chunk))
        if kind is Kind.INPUT_GRAD:
            self.weight_queue.append((j, chunk))

    def add_queued_weight_grad(self) -> None:
        """The W of the oldest I whose W has not run (nothing when none is pending)."""
        if self.weight_queue:
            j, chunk = self.weight_queue.popleft()
            self.actions.append(Action(Kind.WEIGHT_GRAD, self.batch * self.m + j, self.batch,
                                       self.batch, chunk))

    def done(self) -> list[Action]:
        """The actions of microbatches inside the batch, then the step."""
        last = (self.batch + 1) * self.m
        return ([a for a in self.actions if a.microbatch < last]
                + [Action(Kind.STEP, None, self.batch, self.batch + 1)])


def zbv(depth: int, microbatches: int, stage: int, batch: int, *,
        fill: bool = True, drain: bool = True) -> list[Action]:
    """Stage `stage`'s ZB-V actions for `batch` (module docstring), then the step."""
    del fill, drain
    d, i, F, I, W = depth, stage, Kind.FORWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD
    n = max(microbatches, 2 * d - 1)
    order = _Order(batch, microbatches)

    def run(*passes: tuple[Kind, int]) -> None:
        for kind, chunk in passes:
            order.add(kind, chunk)

    run(*[(F, 0)] * (2 * (d - i) - 1))
    for _ in range(i):
        run((F, 1), (F, 0))
    for _ in range(d - i):
        run((F, 1), (I, 1), (W, 1))
    while order.count[F, 1] < order.count[F, 0] or order.count[F, 0] < n:
        if order.count[F, 0] < n:
            run((F, 0))
        run((I, 0), (W, 0), (F, 1), (I, 1), (W, 1))
    for _ in range(i):
        run((I, 0), (I, 1))
    for _ in range(d - i):
        run((I, 0), (W, 0))
    for chunk in (1, 0):
        while order.count[W, chunk] < order.count[I, chunk]:
            run((W, chunk))
    return order.done()


def dualpipev(depth: int, microbatches: int, stage: int, batch: int, *,
              fill: bool = True, drain: bool = True) -> list[Action]:
    """Stage `stage`'s DualPipeV actions for `batch` (module docstring), then the step."""
    del fill, drain
    d, i, m, F, B = depth, stage, microbatches, Kind.FORWARD, Kind.BACKWARD
    if m < 2 * d:
        raise ValueError(f"dualpipev needs at least 2d microbatches per batch (m >= {2 * d} "
                         f"at d={d}), got m={m}")
    order = _Order(batch, m)
    for _ in range(2 * (d - i - 1)):
        order.add(F, 0)
    for _ in range(i + 1):
        order.add(F, 0), order.add(F, 1)
    for _ in range(d - i - 1):
        order.add(Kind.INPUT_GRAD, 1), order.add_queued_weight_grad(), order.add(F, 1)
    for _ in range(m - 2 * d + i + 1):
        order.add(F, 0), order.add(B, 1), order.add(F, 1), order.add(B, 0)
    for _ in range(d - i - 1):
        order.add(B, 1), order.add(F, 1), order.add(B, 0)
    split = False  # the second half of the cool-down splits its backwards (zero bubble)
    for j in range(i + 1):
        split = split or (j == (i + 1) // 2 and i % 2 == 1)
        order.add(Kind.INPUT_GRAD if split else B, 1)
        split = split or (j == (i + 1) // 2 and i % 2 == 0)
        order.add(Kind.INPUT_GRAD if split else B, 0)
    for _ in range(d - i - 1):
        order.add_queued_weight_grad()
        order.add(Kind.INPUT_GRAD if split else B, 0)
    for _ in range(i + 1):
        order.add_queued_weight_grad()
    return order.done()



def vshape_stash(schedule: str) -> Callable[[int, int, int], int]:
    """(d, m, stage) -> peak chunk passes forwarded and not yet through their B or I on the
    stage, each half a stage's activations. ZB-V: min(2d, m + 1 + i, 2m), at most 2d chunk
    passes = d whole-stage activations, 1F1B's peak (the paper's "same memory as 1F1B");
    DualPipeV: 2d + 1 on every stage (the DualPipe repository's "PP + 1" chunks)."""
    if schedule == "zb-v":
        return lambda d, m, i: min(2 * d, m + 1 + i, 2 * m)
    return lambda d, m, i: 2 * d + 1


def vshape_weight_grads(schedule: str) -> Callable[[int, int, int], int]:
    """(d, m, stage) -> peak chunk passes whose I ran and whose W has not. DualPipeV: i + 1;
    ZB-V: counted on the order (2i + 1 from m >= 2d - 1 on)."""
    if schedule == "dualpipev":
        return lambda d, m, i: i + 1
    return lambda d, m, i: _peak_pending(zbv(d, m, i, 0))


def _peak_pending(actions: list[Action]) -> int:
    """Most chunk passes between their I and their W at once in a stage's list."""
    pending, peak = 0, 0
    for a in actions:
        pending += (a.kind is Kind.INPUT_GRAD) - (a.kind is Kind.WEIGHT_GRAD)
        peak = max(peak, pending)
    return peak
