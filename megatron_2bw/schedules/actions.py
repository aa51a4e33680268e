"""One stage's schedule as data: `Action`, its string form, validation and implied communication.

A schedule is, per pipeline stage, an ordered list of actions: ``F3v1`` the forward of
microbatch 3 on weight version 1, ``B3v1`` its backward, ``I3v1``/``W3v1`` the input- and
weight-gradient parts of a split backward, ``S2`` the step that makes version 2, ``F3c1v1`` a
forward on model chunk 1. Microbatches are numbered across batches (batch b holds b*m ..
b*m+m-1); version 0 is the initial weights.

Invariant: communication is never written down. `communication` derives it from the order by a
pure pass (stage i's F(k) receives stage i-1's output of F(k); its B(k) or I(k) the gradient of
stage i+1's), along the virtual stages of the `Placement` when stages hold several chunks.

Notation and placements: docs/executor.md, "Actions".
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, Literal, NoReturn, Sequence

__all__ = [
    "Kind",
    "SENDS_GRAD",
    "MAKES_PARAM_GRADS",
    "Action",
    "P2P",
    "Comms",
    "ScheduleError",
    "parse_action",
    "format_actions",
    "parse_actions",
    "communication",
    "Placement",
    "format_grid",
    "validate",
]


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward: input and weight gradients
    INPUT_GRAD = "I"  # the input-gradient part of a backward
    WEIGHT_GRAD = "W"  # the weight-gradient part, after the microbatch's I
    STEP = "S"  # optimizer step: makes a new weight version


SENDS_GRAD = (Kind.BACKWARD, Kind.INPUT_GRAD)
"""The kinds that receive the output gradient and send the input gradient upstream."""
MAKES_PARAM_GRADS = (Kind.BACKWARD, Kind.WEIGHT_GRAD)
"""The kinds that accumulate parameter gradients: a microbatch's backward is done after one."""


@dataclass(frozen=True)
class Action:
    """One entry of a stage's schedule.

    Roughly, on stage i:
        F: point weights at `version`; x = recv(i-1) or data; y = chunk(x); stash; send(y, i+1)
        B: point weights at `version`; g = recv(i+1) or loss; backward(stash[mb], g); send(dx, i-1)
        I: as B, but the linear layers' weight-gradient GEMMs are left for the W (their input
           and output gradient kept); the graph is freed
        W: those GEMMs, into the parameters' gradients; sends nothing
        S: optimizer step on the accumulated gradients of `batch`; the result is `version`
    """

    kind: Kind
    microbatch: int | None
    """Global microbatch index (batch * m + j); None for a step."""
    batch: int
    """Batch the microbatch belongs to; for a step, the batch whose gradients it applies."""
    version: int
    """Weight version read (F, B, I, W) or made (S; always batch + 1)."""
    chunk: int = 0
    """Model chunk (virtual stage) of the stage the action runs on; 0 for a step, which
    covers all of the stage's chunks."""

    def __post_init__(self) -> None:
        if (self.kind is Kind.STEP) != (self.microbatch is None):
            raise ValueError(f"a step has no microbatch and F/B/I/W need one: {self!r}")
        if self.kind is Kind.STEP and self.version != self.batch + 1:
            raise ValueError(f"the step after batch {self.batch} makes version "
                             f"{self.batch + 1}, not {self.version}")
        if self.chunk < 0 or (self.kind is Kind.STEP and self.chunk != 0):
            raise ValueError(f"a chunk is >= 0, and 0 for a step: {self!r}")

    def __str__(self) -> str:
        if self.kind is Kind.STEP:
            return f"S{self.version}"
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.microbatch}{chunk}v{self.version}"


_ACTION_RE = re.compile(r"([FBIW])(\d+)(?:c(\d+))?v(\d+)|S(\d+)")


def parse_action(text: str, microbatches: int) -> Action:
    """Inverse of `str(action)`; `microbatches` (m per batch) gives the batch of a microbatch."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected like 'F3v1', 'B3v1', 'I3v1', "
                         "'W3v1', 'F3c1v1' or 'S2')")
    kind, microbatch, chunk, version, step_version = match.groups()
    if step_version is not None:
        return Action(Kind.STEP, None, int(step_version) - 1, int(step_version))
    microbatch = int(microbatch)
    return Action(Kind(kind), microbatch, microbatch // microbatches, int(version),
                  int(chunk or 0))


def format_actions(actions: Sequence[Action]) -> str:
    """One line: actions separated by spaces, ' | ' after each step (a call boundary)."""
    return " ".join(f"{a} |" if a.kind is Kind.STEP else str(a) for a in actions).rstrip(" |")


def parse_actions(line: str, microbatches: int) -> list[Action]:
    """Inverse of `format_actions`."""
    return [parse_action(token, microbatches) for token in line.split() if token != "|"]


# --- communication implied by the order ------------------------------------------------------


@dataclass(frozen=True)
class P2P:
    """One point-to-point transfer of an action."""

    peer: int
    """Stage at the other end."""
    tensor: Literal["activation", "grad"]
    """Forward output (F) or gradient of the stage's input (B, I)."""
    microbatch: int
    chunk: int = 0
    """Model chunk of the sending side's action (the one that made the tensor): with chunks,
    (tensor, microbatch, chunk) names a transfer on a pair of stages."""


@dataclass(frozen=True)
class Comms:
    """What one action receives before it runs and sends after it ran (None: nothing)."""

    recv: P2P | None
    send: P2P | None


@dataclass(frozen=True)
class Placement:
    """Which piece of the model (virtual stage, counted from the input) each stage's model
    chunk holds, for `depth` stages of `chunks` chunks each.

    "loop" (Megatron's interleaved placement; one chunk: plain pipelining): chunk c of stage i
    holds virtual stage c*d + i, so the model loops over the stages V times and stage 0's
    chunk c follows stage d-1's chunk c-1.
    "v" (ZB-V and DualPipeV; Qi et al., "Pipeline Parallelism with Controllable Memory",
    2024, and torch.distributed.pipelining's ``style="v"``): two chunks, chunk 0 of stage i
    holds virtual stage i and chunk 1 holds 2d-1-i. The model goes down the stages and comes
    back up: the turn at stage d-1 (its chunk 0 feeds its chunk 1) is a local hand-off, and
    stage 0 holds both the first virtual stage (the input) and the last (the loss).
    """

    depth: int
    chunks: int = 1
    shape: Literal["loop", "v"] = "loop"

    def __post_init__(self) -> None:
        if self.shape not in ("loop", "v"):
            raise ValueError(f"a placement is 'loop' or 'v', not {self.shape!r}")
        if self.shape == "v" and self.chunks != 2:
            raise ValueError(f"the V placement has 2 chunks per stage, not {self.chunks}")
        if self.shape == "loop" and self.chunks > 1 and self.depth < 2:
            raise ValueError(f"{self.chunks} model chunks per stage need at least 2 stages, "
                             f"got {self.depth}")

    @classmethod
    def v(cls, depth: int) -> "Placement":
        return cls(depth, 2, "v")

    def virtual(self, stage: int, chunk: int) -> int:
        """The virtual stage chunk `chunk` of stage `stage` holds."""
        if self.shape == "v" and chunk == 1:
            return 2 * self.depth - 1 - stage
        return chunk * self.depth + stage

    def holder(self, virtual: int) -> tuple[int, int]:
        """(stage, chunk) holding virtual stage `virtual`: the inverse of `virtual`."""
        chunk, offset = divmod(virtual, self.depth)
        if self.shape == "v" and chunk == 1:
            return self.depth - 1 - offset, 1
        return offset, chunk

    def neighbour(self, stage: int, chunk: int, step: int) -> tuple[int, int] | None:
        """(stage, chunk) of the virtual stage `step` (+-1) away from (stage, chunk), None past
        either end of the model."""
        virtual = self.virtual(stage, chunk) + step
        if not 0 <= virtual < self.depth * self.chunks:
            return None
        return self.holder(virtual)

    def is_first(self, stage: int, chunk: int) -> bool:
        """Whether (stage, chunk) is the model's first virtual stage (it reads the input)."""
        return self.virtual(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        """Whether (stage, chunk) is the model's last virtual stage (it computes the loss)."""
        return self.virtual(stage, chunk) == self.depth * self.chunks - 1

    def peers(self, stage: int) -> list[int]:
        """The other stages `stage` exchanges tensors with, in order."""
        found = {n[0] for c in range(self.chunks) for step in (-1, 1)
                 if (n := self.neighbour(stage, c, step)) is not None}
        return sorted(found - {stage})


def communication(actions: Sequence[Action], stage: int, depth: int, *,
                  chunks: int = 1, placement: Placement | None = None) -> list[Comms]:
    """For each action of `stage`'s list, the transfers it implies, with `chunks` model chunks
    per stage placed as `placement` says (default: the loop placement of `chunks`).

    F(k) receives F(k)'s activation from the previous virtual stage and sends its output to the
    next; B(k) and I(k) receive the output gradient from the next virtual stage and send their
    input gradient to the previous; the first and last virtual stage have no peer on one side;
    W and steps communicate nothing point-to-point. With one chunk the previous virtual stage
    is stage-1 and the next stage+1; with V chunks, chunk c of stage 0 follows chunk c-1 of
    stage d-1. A neighbour on the stage itself (the V's turn) is a local hand-off: no
    transfer.
    """
    placement = placement or Placement(depth, chunks)
    comms = []
    for a in actions:
        if a.kind is not Kind.STEP and not 0 <= a.chunk < placement.chunks:
            raise ValueError(f"{a} on stage {stage}: chunk outside 0..{placement.chunks - 1}")
        before, after = (_remote(placement.neighbour(stage, a.chunk, step), stage)
                         for step in (-1, 1))
        if a.kind is Kind.FORWARD:
            recv = None if before is None else P2P(before[0], "activation", a.microbatch,
                                                   before[1])
            send = None if after is None else P2P(after[0], "activation", a.microbatch, a.chunk)
        elif a.kind in SENDS_GRAD:
            recv = None if after is None else P2P(after[0], "grad", a.microbatch, after[1])
            send = None if before is None else P2P(before[0], "grad", a.microbatch, a.chunk)
        else:
            recv = send = None
        comms.append(Comms(recv, send))
    return comms


def _remote(neighbour: tuple[int, int] | None, stage: int) -> tuple[int, int] | None:
    """A neighbour on another stage; None at the model's ends and for a local hand-off."""
    return None if neighbour is None or neighbour[0] == stage else neighbour


# --- the grid and the validator --------------------------------------------------------------


class ScheduleError(ValueError):
    """A schedule is wrong or cannot run; the message holds the grid with the action marked."""


def format_grid(schedule: Sequence[Sequence[Action]],
                marks: dict[int, int] | None = None) -> str:
    """Stages as rows, list positions as columns; `marks` {stage: position} are bracketed and
    their row ends with '<-- ERROR HERE'."""
    marks = marks or {}
    width = max((len(str(a)) for actions in schedule for a in actions), default=1) + 2
    steps = max((len(actions) for actions in schedule), default=0)
    lines = ["step     " + "".join(f"{j:<{width}}" for j in range(steps)).rstrip()]
    for stage, actions in enumerate(schedule):
        cells = [f"[{a}]" if marks.get(stage) == j else f" {a}" for j, a in enumerate(actions)]
        row = f"stage {stage:<2}" + "".join(f"{c:<{width}}" for c in cells).rstrip()
        lines.append(row + ("   <-- ERROR HERE" if stage in marks else ""))
    return "\n".join(lines)


def validate(schedule: Sequence[Sequence[Action]], microbatches: int, num_batches: int, *,
             version_of: Callable[[int, int], int] | None = None,
             backward_version_of: Callable[[int, int], int] | None = None,
             max_versions: int | None = None, placement: Placement | None = None) -> None:
    """Raise `ScheduleError` unless on every stage and for every model chunk (V = one more than
    the largest chunk in the schedule, placed as `placement` says, by default the loop
    placement): each microbatch of the `num_batches` batches has exactly
    one F and then either one B or one I and later one W, all with the same version
    (`version_of(stage, microbatch)` if given), or, with `backward_version_of`, the backward's
    (B, I, W) that version instead (no weight stashing); a forward reads a version already
    made; the step after batch b comes after all of b's backwards (B or W), one per batch in
    order; and at most `max_versions` weight versions are alive (the newest plus those made
    already that microbatches forwarded and not yet through their B or W will read there).
    Across stages: each stage receives activations and gradients in the order its neighbours
    send them; a local hand-off (the V's turn) comes after the action that makes it."""
    chunks = 1 + max((a.chunk for actions in schedule for a in actions), default=0)
    placement = placement or Placement(len(schedule), chunks)
    for stage, actions in enumerate(schedule):
        _validate_stage(schedule, stage, microbatches, num_batches, chunks, version_of,
                        backward_version_of, max_versions)
        _check_local_handoffs(schedule, stage, placement)
    _check_channel_order(schedule, placement)


def _check_local_handoffs(schedule: Sequence[Sequence[Action]], stage: int,
                          placement: Placement) -> None:
    """An F whose previous virtual stage is on the same stage runs after that chunk's F of
    the microbatch, and a B or I whose next one is, after that chunk's B or I."""
    done: set[tuple[Kind, int, int]] = set()
    for j, a in enumerate(schedule[stage]):
        if a.kind not in (Kind.FORWARD, *SENDS_GRAD):
            continue
        forward = a.kind is Kind.FORWARD
        source = placement.neighbour(stage, a.chunk, -1 if forward else 1)
        if source is not None and source[0] == stage:
            kinds = (Kind.FORWARD,) if forward else SENDS_GRAD
            if not any((kind, a.microbatch, source[1]) in done for kind in kinds):
                raise ScheduleError(
                    f"stage {stage}, step {j} ({a}): its input comes from this stage's chunk "
                    f"{source[1]}, which has not made it yet\n"
                    + format_grid(schedule, {stage: j}))
        done.add((a.kind, a.microbatch, a.chunk))


def _validate_stage(schedule: Sequence[Sequence[Action]], stage: int, microbatches: int,
                    num_batches: int, chunks: int, version_of: Callable[[int, int], int] | None,
                    backward_version_of: Callable[[int, int], int] | None,
                    max_versions: int | None) -> None:
    """`validate`'s checks on one stage's list."""
    actions, total = schedule[stage], microbatches * num_batches

    def fail(position: int, why: str) -> NoReturn:
        raise ScheduleError(f"stage {stage}, step {position} ({actions[position]}): {why}\n"
                            + format_grid(schedule, {stage: position}))

    stashed: dict[tuple[int, int], int] = {}  # (microbatch, chunk) -> version, before B or I
    pending: dict[tuple[int, int], int] = {}  # after I, before W
    done: set[tuple[int, int]] = set()
    newest = 0
    for j, a in enumerate(actions):
        key = (a.microbatch, a.chunk)
        if a.kind is not Kind.STEP:
            problem = _numbering_problem(a, stage, microbatches, total, version_of,
                                         backward_version_of)
            if problem is not None:
                fail(j, problem)
        if a.kind is Kind.FORWARD:
            if key in stashed or key in pending or key in done:
                fail(j, "second forward of this microbatch")
            if a.version > newest:
                fail(j, f"version {a.version} not made yet (newest is {newest})")
            stashed[key] = a.version if backward_version_of is None else \
                backward_version_of(stage, a.microbatch)  # the version its backward reads
        elif a.kind in SENDS_GRAD:
            if key not in stashed:
                fail(j, "second backward of this microbatch" if key in pending or key in done
                     else "backward without a forward before it")
            if stashed.pop(key) != a.version:
                fail(j, "backward reads another version than its forward")
            if a.kind is Kind.INPUT_GRAD:
                pending[key] = a.version
            else:
                done.add(key)
        elif a.kind is Kind.WEIGHT_GRAD:
            if key not in pending:
                fail(j, "weight gradient without an input gradient before it")
            if pending.pop(key) != a.version:
                fail(j, "weight gradient reads another version than its forward")
            done.add(key)
        else:
            if a.version != newest + 1:
                fail(j, f"steps out of order: the next step makes version {newest + 1}")
            first = a.batch * microbatches
            missing = [k for k in range(first, first + microbatches) for c in range(chunks)
                       if (k, c) not in done]
            if missing:
                fail(j, f"step before the backwards of microbatches {sorted(set(missing))}")
            newest = a.version
        alive = {newest, *(v for v in (*stashed.values(), *pending.values()) if v <= newest)}
        if max_versions is not None and len(alive) > max_versions:
            fail(j, f"{len(alive)} weight versions alive {sorted(alive)}, "
                    f"at most {max_versions} allowed")
    _check_stage_complete(schedule, stage, total, chunks, num_batches,
                          complete=not stashed and not pending, done=done, steps=newest)


def _numbering_problem(a: Action, stage: int, microbatches: int, total: int,
                       version_of: Callable[[int, int], int] | None,
                       backward_version_of: Callable[[int, int], int] | None) -> str | None:
    """Why an F, B, I or W's numbers are wrong on ``stage`` (None if right): its microbatch
    among the ``total``, its batch that microbatch's, its version the schedule's rule's."""
    if not 0 <= a.microbatch < total:
        return f"microbatch outside 0..{total - 1}"
    if a.batch != a.microbatch // microbatches:
        return (f"batch {a.batch}, but microbatch {a.microbatch} is in batch "
                f"{a.microbatch // microbatches} with m={microbatches}")
    rule = version_of if a.kind is Kind.FORWARD or backward_version_of is None \
        else backward_version_of
    if rule is not None and a.version != rule(stage, a.microbatch):
        return (f"microbatch {a.microbatch} reads version "
                f"{rule(stage, a.microbatch)} on this stage")
    return None


def _check_stage_complete(schedule: Sequence[Sequence[Action]], stage: int, total: int,
                          chunks: int, num_batches: int, *, complete: bool,
                          done: set[tuple[int, int]], steps: int) -> None:
    """At the end of a stage's list: every microbatch of every chunk went through its
    forward and backward (nothing left before its B, I or W), and one step per batch."""
    if not complete or len(done) != total * chunks:
        missing = sorted({k for k in range(total) for c in range(chunks) if (k, c) not in done})
        raise ScheduleError(f"stage {stage}: microbatches {missing[:8]}"
                            f"{' ...' if len(missing) > 8 else ''} miss a forward or a "
                            f"backward\n" + format_grid(schedule))
    if steps != num_batches:
        raise ScheduleError(f"stage {stage}: {steps} steps for {num_batches} batches\n"
                            + format_grid(schedule))


def _check_channel_order(schedule: Sequence[Sequence[Action]], placement: Placement) -> None:
    """Point-to-point messages between two stages are matched in order (Megatron's p2p has no
    tags), so a stage must receive each kind of tensor in the order its neighbour sends it:
    activations in the sender's forward order, gradients in its backward order."""
    depth = len(schedule)
    comms = [communication(actions, stage, depth, placement=placement)
             for stage, actions in enumerate(schedule)]

    def order(stage: int, op: str, peer: int, tensor: str) -> list[tuple[int, int, int]]:
        found = []
        for j, c in enumerate(comms[stage]):
            p2p = c.send if op == "send" else c.recv
            if p2p is not None and p2p.peer == peer and p2p.tensor == tensor:
                found.append((p2p.microbatch, p2p.chunk, j))
        return found

    for sender in range(depth):
        for receiver in placement.peers(sender):
            for tensor in ("activation", "grad"):
                sent = order(sender, "send", receiver, tensor)
                for (k_sent, c_sent, _), (k_recv, c_recv, j) in zip(
                        sent, order(receiver, "recv", sender, tensor)):
                    if (k_sent, c_sent) != (k_recv, c_recv):
                        raise ScheduleError(
                            f"stage {receiver}, step {j} ({schedule[receiver][j]}): receives "
                            f"microbatch {k_recv} from stage {sender}, which sends microbatch "
                            f"{k_sent} at that point\n" + format_grid(schedule, {receiver: j}))
