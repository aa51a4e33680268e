"""Discrete-event simulation of all stages' action lists with per-action costs.

Each stage runs its list in order, one action at a time; an action starts when its stage is
free and its inputs have arrived (the previous virtual stage's F, the next one's B or I, its
own step's version; a "pipeline" step waits for every stage). Sends are buffered, except in
NCCL mode: when the lists are programs (`comm.fuse`) transfers are rendezvous at the
exchanges, as on NCCL.

Invariant: it never hangs. A stage waiting on an action later in its own list is a dependency
violation, nothing runnable while actions remain is a deadlock (a cycle of stages waiting at
exchanges in NCCL mode); both raise `ScheduleError` with the grid.

The timing rules, NCCL mode and the bubble fraction: docs/executor.md, "The simulator".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from .actions import SENDS_GRAD, Action, Kind, Placement, ScheduleError, format_grid
from .comm import Exchange, Step
from .split import LayerSplit

__all__ = ["Costs", "Span", "SimResult", "simulate", "format_timeline"]


@dataclass(frozen=True)
class Costs:
    """Time of each action; a tuple gives one value per stage, and a stage's value may be a
    tuple of one value per model chunk (chunks holding different layers: `of_layers`)."""

    forward: float | Sequence[float | Sequence[float]] = 1.0
    """Forward of one microbatch on a stage (on one chunk of it)."""
    backward: float | Sequence[float | Sequence[float]] = 2.0
    """Backward of one microbatch on a stage (about twice the forward, Section 3.1): a fused B,
    or its I and W together."""
    p2p: float = 0.0
    """Latency of one activation or gradient transfer between neighbouring stages."""
    step: float = 0.0
    """Optimizer step (S) on a stage."""
    weight_grad: float | Sequence[float | Sequence[float]] | None = None
    """The weight-gradient part (W) of `backward`; the input-gradient part (I) takes the rest.
    None: half of `backward` (a linear layer's dX and dW cost the same FLOPs)."""

    @classmethod
    def of_layers(cls, split: LayerSplit, placement: Placement, layer: tuple[float, float],
                  embedding: tuple[float, float] = (0.0, 0.0),
                  head: tuple[float, float] = (0.0, 0.0), **rest) -> "Costs":
        """Each chunk's forward and backward from the layers `split` gives it under
        `placement`: (forward, backward) of one `layer`, of the `embedding` on the first
        virtual stage and of the `head` (final norm, output layer, loss) on the last."""
        last = placement.depth * placement.chunks - 1

        def chunk(stage: int, c: int, part: int) -> float:
            v = placement.virtual(stage, c)
            return (split.count(v) * layer[part] + (v == 0) * embedding[part]
                    + (v == last) * head[part])

        def per_stage(part: int) -> tuple:
            return tuple(tuple(chunk(i, c, part) for c in range(placement.chunks))
                         for i in range(placement.depth))

        return cls(forward=per_stage(0), backward=per_stage(1), **rest)

    def of(self, action: Action, stage: int) -> float:
        def at(cost: float | Sequence[float | Sequence[float]]) -> float:
            if isinstance(cost, (int, float)):
                return float(cost)
            here = cost[stage]
            return float(here if isinstance(here, (int, float)) else here[action.chunk])

        weight = at(self.backward) / 2 if self.weight_grad is None else at(self.weight_grad)
        return {Kind.FORWARD: at(self.forward), Kind.BACKWARD: at(self.backward),
                Kind.INPUT_GRAD: at(self.backward) - weight, Kind.WEIGHT_GRAD: weight,
                Kind.STEP: at(self.step)}[action.kind]


@dataclass(frozen=True)
class Span:
    """One action as it ran: a timeline record."""

    stage: int
    kind: Kind
    microbatch: int | None
    version: int
    start: float
    end: float
    chunk: int = 0


@dataclass(frozen=True)
class SimResult:
    makespan: float
    """End of the last action."""
    busy: tuple[float, ...]
    """Per stage: time in F, B, I and W."""
    step: tuple[float, ...]
    """Per stage: time in S."""
    bubble: float
    """1 - sum(busy + step) / (depth * makespan): the idle share of all stages' time."""
    stage_bubble: tuple[float, ...]
    """Per stage: 1 - (busy_i + step_i) / makespan."""
    peak_stash: tuple[int, ...]
    """Per stage: most microbatches (of any chunk) forwarded and not yet through their B or I
    at once: the activations a backward needs."""
    peak_weight_grads: tuple[int, ...]
    """Per stage: most microbatches through their I and not yet through their W at once: what
    the deferred weight gradients keep (the layers' inputs and output gradients)."""
    peak_stash_bytes: tuple[float, ...]
    """Per stage: the most bytes its stashed microbatches hold at once, each chunk's
    `simulate(stash_bytes=...)` per microbatch (zeros without them)."""
    max_versions: tuple[int, ...]
    """Per stage: most weight versions alive at once (newest + those made already that
    microbatches forwarded and not yet through their B or W read there: with weight stashing
    their forward's, without (PipeMare) their backward's)."""
    spans: tuple[Span, ...]
    """Every action with its start and end, in the order they were simulated."""

    def batch_ends(self, stage: int) -> list[float]:
        """End of each step on `stage`, batch by batch."""
        return [s.end for s in self.spans if s.stage == stage and s.kind is Kind.STEP]


class _Stage:
    """One stage's progress through its list: where it is, when it is free, and what its
    actions hold (the bookkeeping behind `SimResult`'s memory fields)."""

    def __init__(self, steps: Sequence[Step], stash_bytes: Sequence[float] = ()) -> None:
        self.steps = steps
        self.stash_bytes = stash_bytes
        """Bytes one microbatch leaves stashed in each chunk."""
        self.held_bytes = self.peak_bytes = 0.0
        self.cursor = 0
        """Position of the next step in `steps`."""
        self.free = 0.0
        """When the stage's last action (or exchange) ended."""
        self.forward_end: dict[tuple[int, int], float] = {}  # (microbatch, chunk) -> end
        self.backward_end: dict[tuple[int, int], float] = {}  # of its B or I
        self.step_end: dict[int, float] = {0: 0.0}  # version -> when the stage made it
        self.received: set[tuple[str, int, int]] = set()  # NCCL mode: (tensor, mb, chunk)
        self.backward_reads = {(a.microbatch, a.chunk): a.version for a in steps
                               if isinstance(a, Action) and a.kind in SENDS_GRAD}
        """(microbatch, chunk) -> the version its backward reads (without weight stashing a
        newer one than its forward's)."""
        self.stash: dict[tuple[int, int], int] = {}  # forwarded, before B or I -> version
        self.pending: dict[tuple[int, int], int] = {}  # after I, before W -> version
        self.newest = 0
        self.peak_stash = self.peak_weight_grads = 0
        self.max_versions = 1

    def next(self) -> Step | None:
        return self.steps[self.cursor] if self.cursor < len(self.steps) else None

    def record(self, a: Action, end: float) -> None:
        """`a` ran until `end`: move the cursor and update what the stage holds."""
        self.free, self.cursor, key = end, self.cursor + 1, (a.microbatch, a.chunk)
        size = self.stash_bytes[a.chunk] if a.chunk < len(self.stash_bytes) else 0.0
        if a.kind is Kind.FORWARD:
            self.forward_end[key] = end
            self.stash[key] = self.backward_reads.get(key, a.version)
            self.held_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        elif a.kind in SENDS_GRAD:
            self.backward_end[key] = end
            self.held_bytes -= size
            version = self.stash.pop(key)
            if a.kind is Kind.INPUT_GRAD:
                self.pending[key] = version
        elif a.kind is Kind.WEIGHT_GRAD:
            self.pending.pop(key)
        else:
            self.step_end[a.version] = end
            self.newest = max(self.newest, a.version)
        self.peak_stash = max(self.peak_stash, len(self.stash))
        self.peak_weight_grads = max(self.peak_weight_grads, len(self.pending))
        alive = {self.newest, *(v for v in (*self.stash.values(), *self.pending.values())
                                if v <= self.newest)}
        self.max_versions = max(self.max_versions, len(alive))


class _Simulation:
    """All stages run together: `ready` says when an action's inputs are there, `run` runs it,
    `exchange` completes a fused group (NCCL mode), `advance` runs one stage as far as it can."""

    def __init__(self, schedule: Sequence[Sequence[Step]], costs: Costs,
                 step_sync: Literal["local", "pipeline"], placement: Placement | None,
                 stash_bytes: Sequence[Sequence[float]] | None = None) -> None:
        self.schedule, self.costs, self.step_sync = schedule, costs, step_sync
        self.depth = len(schedule)
        chunks = 1 + max((a.chunk for steps in schedule for a in steps
                          if isinstance(a, Action)), default=0)
        self.placement = placement or Placement(self.depth, chunks)
        self.nccl = any(isinstance(step, Exchange) for steps in schedule for step in steps)
        self.partners = _partners(schedule) if self.nccl else {}
        self.posted: dict[tuple[int, int], float] = {}  # (stage, position) -> reached at
        self.stages = [_Stage(steps, stash_bytes[i] if stash_bytes else ())
                       for i, steps in enumerate(schedule)]
        self.spans: list[Span] = []

    def violation(self, stage: int, why: str) -> ScheduleError:
        at = self.stages[stage].cursor
        return ScheduleError(f"dependency violation on stage {stage}, step {at} "
                             f"({self.schedule[stage][at]}): {why}\n"
                             + format_grid(self.schedule, {stage: at}))

    def source(self, stage: int, a: Action) -> tuple[str, tuple[int, int] | None]:
        """The tensor `a` receives and the (stage, chunk) that makes it (None: no input)."""
        if a.kind is Kind.FORWARD:
            return "activation", self.placement.neighbour(stage, a.chunk, -1)
        return "grad", self.placement.neighbour(stage, a.chunk, 1)

    def ready(self, stage: int, a: Action) -> float | None:
        """When `a`'s inputs are there; None while another stage has not produced them."""
        here = self.stages[stage]
        if a.kind is Kind.STEP:
            return here.free
        if a.version not in here.step_end:
            raise self.violation(stage, f"version {a.version} is not made before it on this "
                                        "stage")
        ready, key = here.step_end[a.version], (a.microbatch, a.chunk)
        if a.kind in SENDS_GRAD and key not in here.stash:
            raise self.violation(stage, "no forward of this microbatch before it on this stage")
        if a.kind is Kind.WEIGHT_GRAD:
            if key not in here.pending:
                raise self.violation(stage, "no input gradient of this microbatch before it")
            return ready
        tensor, peer = self.source(stage, a)
        if peer is None:
            return ready
        if peer[0] == stage:  # the V's turn: a local hand-off, after its maker on this stage
            ends = here.forward_end if a.kind is Kind.FORWARD else here.backward_end
            if (a.microbatch, peer[1]) not in ends:
                raise self.violation(stage, f"its input ({tensor} of microbatch "
                                            f"{a.microbatch}) is made by chunk {peer[1]} of "
                                            "this stage after it")
            return max(ready, ends[a.microbatch, peer[1]])
        if self.nccl:  # the input came in an exchange before `a`, or `a` can never run
            if (tensor, a.microbatch, peer[1]) not in here.received:
                raise self.violation(stage, f"its input ({tensor} of microbatch "
                                            f"{a.microbatch}) is not received in an exchange "
                                            "before it")
            return max(ready, here.free)
        there = self.stages[peer[0]]
        ends = there.forward_end if a.kind is Kind.FORWARD else there.backward_end
        if (a.microbatch, peer[1]) not in ends:
            return None
        return max(ready, ends[a.microbatch, peer[1]] + self.costs.p2p)

    def run(self, stage: int, a: Action, start: float) -> None:
        end = start + self.costs.of(a, stage)
        self.spans.append(Span(stage, a.kind, a.microbatch, a.version, start, end, a.chunk))
        self.stages[stage].record(a, end)

    def exchange(self, stage: int, exchange: Exchange) -> bool:
        """Post the exchange `stage` is at; complete it once every partner exchange is
        posted."""
        here = self.stages[stage]
        at = (stage, here.cursor)
        self.posted.setdefault(at, here.free)
        if not all(partner in self.posted for partner in self.partners[at]):
            return False
        end = max(self.posted[p] for p in (at, *self.partners[at])) + self.costs.p2p
        here.received.update(t.key for t in exchange.transfers if t.op == "recv")
        here.free, here.cursor = max(here.free, end), here.cursor + 1
        return True

    def advance(self, stage: int) -> bool:
        """Run `stage` until it waits (on a peer, an exchange or the step's collective);
        whether it moved."""
        moved = False
        while (a := self.stages[stage].next()) is not None:
            if isinstance(a, Exchange):
                if not self.exchange(stage, a):
                    break
            elif a.kind is Kind.STEP and self.step_sync == "pipeline":
                break  # joins the collective (`collective`)
            else:
                ready = self.ready(stage, a)
                if ready is None:
                    break
                self.run(stage, a, max(self.stages[stage].free, ready))
            moved = True
        return moved

    def collective(self) -> bool:
        """step_sync "pipeline": once every stage waits at the same step, it runs on all."""
        waiting = [stage.next() for stage in self.stages]
        first = waiting[0]
        if not (isinstance(first, Action) and first.kind is Kind.STEP
                and all(a == first for a in waiting)):
            return False
        start = max(stage.free for stage in self.stages)
        for i in range(self.depth):
            self.run(i, first, start)
        return True

    def deadlock(self) -> ScheduleError:
        blocked = {i: s.cursor for i, s in enumerate(self.stages) if s.next() is not None}
        return ScheduleError(
            "deadlock: no action can run while actions remain; blocked: "
            + ", ".join(f"stage {i} at {self.stages[i].next()}" for i in blocked) + "\n"
            + format_grid(self.schedule, blocked))

    def result(self) -> SimResult:
        makespan = max((s.free for s in self.stages), default=0.0)
        busy = tuple(sum(s.end - s.start for s in self.spans
                         if s.stage == i and s.kind is not Kind.STEP) for i in range(self.depth))
        step = tuple(sum(s.end - s.start for s in self.spans
                         if s.stage == i and s.kind is Kind.STEP) for i in range(self.depth))
        work = [b + s for b, s in zip(busy, step)]
        return SimResult(
            makespan=makespan, busy=busy, step=step,
            bubble=1 - sum(work) / (self.depth * makespan) if makespan else 0.0,
            stage_bubble=tuple(1 - w / makespan if makespan else 0.0 for w in work),
            peak_stash=tuple(s.peak_stash for s in self.stages),
            peak_stash_bytes=tuple(s.peak_bytes for s in self.stages),
            peak_weight_grads=tuple(s.peak_weight_grads for s in self.stages),
            max_versions=tuple(s.max_versions for s in self.stages),
            spans=tuple(self.spans))


def simulate(schedule: Sequence[Sequence[Step]], costs: Costs = Costs(), *,
             step_sync: Literal["local", "pipeline"] = "local",
             placement: Placement | None = None,
             stash_bytes: Sequence[Sequence[float]] | None = None) -> SimResult:
    """Run all stages' lists ([stage] -> [Action]) or programs ([stage] -> [Action | Exchange],
    NCCL mode) together, their chunks placed as `placement` says (default: the loop
    placement); see the module docstring. `stash_bytes[stage][chunk]`: what one microbatch
    leaves stashed there (a chunk's layers' activations: `LayerSplit.of_rank`), for
    `SimResult.peak_stash_bytes`."""
    if step_sync not in ("local", "pipeline"):
        raise ValueError(f"step_sync must be 'local' or 'pipeline', got {step_sync!r}")
    sim = _Simulation(schedule, costs, step_sync, placement, stash_bytes)
    while any(stage.next() is not None for stage in sim.stages):
        moved = [sim.advance(i) for i in range(sim.depth)]
        if not (any(moved) | sim.collective()):
            raise sim.deadlock()
    return sim.result()


def _partners(schedule: Sequence[Sequence[Step]]) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """For each exchange, (stage, position), the peers' exchanges its transfers meet. The n-th
    send from stage a to stage b meets b's n-th receive from a (NCCL matches in issue order);
    a transfer that meets another tensor, or none, raises `ScheduleError`."""
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    partners: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for stage, steps in enumerate(schedule):
        for position, step in enumerate(steps):
            if isinstance(step, Exchange):
                partners[stage, position] = set()
                for t in step.transfers:
                    channel = (stage, t.peer) if t.op == "send" else (t.peer, stage)
                    (sends if t.op == "send" else recvs).setdefault(channel, []).append(
                        (stage, position, t))
    for channel in sorted(set(sends) | set(recvs)):
        sent, got = sends.get(channel, []), recvs.get(channel, [])
        for n, ((s1, p1, t1), (s2, p2, t2)) in enumerate(zip(sent, got)):
            if t1.key != t2.key:
                raise ScheduleError(
                    f"stage {s2}, step {p2} ({schedule[s2][p2]}): its receive number {n + 1} "
                    f"from stage {s1} expects the {t2.tensor} of microbatch {t2.microbatch}, "
                    f"but stage {s1} sends the {t1.tensor} of microbatch {t1.microbatch} "
                    f"there\n" + format_grid(schedule, {s1: p1, s2: p2}))
            partners[s1, p1].add((s2, p2))
            partners[s2, p2].add((s1, p1))
        if len(sent) != len(got):
            extra = (sent if len(sent) > len(got) else got)[min(len(sent), len(got))]
            raise ScheduleError(
                f"stage {extra[0]}, step {extra[1]} ({schedule[extra[0]][extra[1]]}): "
                f"stage {channel[0]} sends {len(sent)} tensors to stage {channel[1]}, which "
                f"receives {len(got)}\n" + format_grid(schedule, {extra[0]: extra[1]}))
    return partners


def format_timeline(result: SimResult, unit: float = 1.0, cell: int = 4) -> str:
    """Stages as rows, time as columns (`cell` characters per `unit` of time), in the style of
    the paper's Figures 1-3: each action is labelled at its start ('F3', 'B3', 'W3', 'F3c1',
    'S2'), cut to its width, and filled with '.' for the rest of its time; idle time is
    blank."""
    depth = 1 + max((s.stage for s in result.spans), default=0)
    width = round(result.makespan / unit * cell)
    rows = [[" "] * width for _ in range(depth)]
    for s in result.spans:
        first, last = round(s.start / unit * cell), round(s.end / unit * cell)
        label = (f"S{s.version}" if s.kind is Kind.STEP else
                 f"{s.kind.value}{s.microbatch}" + (f"c{s.chunk}" if s.chunk else ""))
        text = (label + "." * (last - first))[:max(last - first - 1, 1)]
        rows[s.stage][first:first + len(text)] = text
    ticks = "".join(f"{t * unit:<{cell}g}" for t in range(0, width // cell + 1))
    return "\n".join([f"time     {ticks[:width].rstrip()}"]
                     + [f"stage {i:<2} " + "".join(row).rstrip() for i, row in enumerate(rows)])
