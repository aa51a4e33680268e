"""One stage's schedule as data: `Action`, its string form, validation and implied communication.

A schedule is, for each pipeline stage, an ordered list of actions (a list of such lists, indexed
by stage, for the whole pipeline):

    F3v1   forward of microbatch 3 with weight version 1
    B3v1   backward of microbatch 3 (same version as its forward)
    S2     optimizer step after batch 1: makes weight version 2

Microbatches are numbered globally across batches from 0: batch b holds microbatches
b*m .. b*m+m-1, with m microbatches per batch. Version 0 is the initial weights; the step after
batch b makes version b+1. Which version a batch reads is the schedule's rule (GPipe, Flush and
naive: b; 2BW: max(b-1, 0), PipeDream-2BW Section 3.1).

Communication is implied by the order and is derived here by a pure pass (`communication`):
stage i's F(k) receives stage i-1's output of F(k), stage i's B(k) receives the gradient from
stage i+1's B(k).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, Literal, NoReturn, Sequence

__all__ = [
    "Kind",
    "Action",
    "P2P",
    "Comms",
    "ScheduleError",
    "parse_action",
    "format_actions",
    "parse_actions",
    "communication",
    "format_grid",
    "validate",
]


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    STEP = "S"  # optimizer step: makes a new weight version


@dataclass(frozen=True)
class Action:
    """One entry of a stage's schedule.

    Roughly, on stage i:
        F: point weights at `version`; x = recv(i-1) or data; y = chunk(x); stash; send(y, i+1)
        B: point weights at `version`; g = recv(i+1) or loss; backward(stash[mb], g); send(dx, i-1)
        S: optimizer step on the accumulated gradients of `batch`; the result is `version`
    """

    kind: Kind
    microbatch: int | None
    """Global microbatch index (batch * m + j); None for a step."""
    batch: int
    """Batch the microbatch belongs to; for a step, the batch whose gradients it applies."""
    version: int
    """Weight version read (F, B) or made (S; always batch + 1)."""

    def __post_init__(self) -> None:
        if (self.kind is Kind.STEP) != (self.microbatch is None):
            raise ValueError(f"a step has no microbatch and F/B need one: {self!r}")
        if self.kind is Kind.STEP and self.version != self.batch + 1:
            raise ValueError(f"the step after batch {self.batch} makes version "
                             f"{self.batch + 1}, not {self.version}")

    def __str__(self) -> str:
        if self.kind is Kind.STEP:
            return f"S{self.version}"
        return f"{self.kind.value}{self.microbatch}v{self.version}"


_ACTION_RE = re.compile(r"([FB])(\d+)v(\d+)|S(\d+)")


def parse_action(text: str, microbatches: int) -> Action:
    """Inverse of `str(action)`; `microbatches` (m per batch) gives the batch of a microbatch."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected like 'F3v1', 'B3v1' or 'S2')")
    kind, microbatch, version, step_version = match.groups()
    if step_version is not None:
        return Action(Kind.STEP, None, int(step_version) - 1, int(step_version))
    microbatch = int(microbatch)
    return Action(Kind(kind), microbatch, microbatch // microbatches, int(version))


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
    """Forward output (F) or gradient of the stage's input (B)."""
    microbatch: int


@dataclass(frozen=True)
class Comms:
    """What one action receives before it runs and sends after it ran (None: nothing)."""

    recv: P2P | None
    send: P2P | None


def communication(actions: Sequence[Action], stage: int, depth: int) -> list[Comms]:
    """For each action of `stage`'s list, the transfers it implies.

    F(k) receives F(k)'s activation from stage-1 and sends its output to stage+1; B(k) receives
    the output gradient from stage+1 and sends its input gradient to stage-1; the first and last
    stage have no peer on one side; steps communicate nothing point-to-point.
    """
    comms = []
    for a in actions:
        if a.kind is Kind.FORWARD:
            recv = P2P(stage - 1, "activation", a.microbatch) if stage > 0 else None
            send = P2P(stage + 1, "activation", a.microbatch) if stage < depth - 1 else None
        elif a.kind is Kind.BACKWARD:
            recv = P2P(stage + 1, "grad", a.microbatch) if stage < depth - 1 else None
            send = P2P(stage - 1, "grad", a.microbatch) if stage > 0 else None
        else:
            recv = send = None
        comms.append(Comms(recv, send))
    return comms


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
             max_versions: int | None = None) -> None:
    """Raise `ScheduleError` unless on every stage: each microbatch of the `num_batches` batches
    has exactly one F and then one B, with the same version (`version_of(stage, microbatch)`
    if given); a
    forward reads a version already made; the step after batch b comes after all of b's
    backwards, one per batch in order; and at most `max_versions` weight versions are alive
    (the newest plus those read by stashed microbatches). Across stages: each stage receives
    activations and gradients in the order its neighbour sends them."""
    total = microbatches * num_batches
    for stage, actions in enumerate(schedule):
        def fail(position: int, why: str) -> NoReturn:
            raise ScheduleError(f"stage {stage}, step {position} ({actions[position]}): {why}\n"
                                + format_grid(schedule, {stage: position}))

        stashed: dict[int, int] = {}  # microbatch -> version, forwarded and not yet backwarded
        done: set[int] = set()
        newest = 0
        for j, a in enumerate(actions):
            if a.kind is not Kind.STEP:
                if not 0 <= a.microbatch < total:
                    fail(j, f"microbatch outside 0..{total - 1}")
                if a.batch != a.microbatch // microbatches:
                    fail(j, f"batch {a.batch}, but microbatch {a.microbatch} is in batch "
                            f"{a.microbatch // microbatches} with m={microbatches}")
                if version_of is not None and a.version != version_of(stage, a.microbatch):
                    fail(j, f"microbatch {a.microbatch} reads version "
                            f"{version_of(stage, a.microbatch)} on this stage")
            if a.kind is Kind.FORWARD:
                if a.microbatch in stashed or a.microbatch in done:
                    fail(j, "second forward of this microbatch")
                if a.version > newest:
                    fail(j, f"version {a.version} not made yet (newest is {newest})")
                stashed[a.microbatch] = a.version
            elif a.kind is Kind.BACKWARD:
                if a.microbatch not in stashed:
                    fail(j, "backward without a forward before it" if a.microbatch not in done
                         else "second backward of this microbatch")
                if stashed.pop(a.microbatch) != a.version:
                    fail(j, "backward reads another version than its forward")
                done.add(a.microbatch)
            else:
                if a.version != newest + 1:
                    fail(j, f"steps out of order: the next step makes version {newest + 1}")
                first = a.batch * microbatches
                missing = [k for k in range(first, first + microbatches) if k not in done]
                if missing:
                    fail(j, f"step before the backwards of microbatches {missing}")
                newest = a.version
            alive = {newest, *stashed.values()}
            if max_versions is not None and len(alive) > max_versions:
                fail(j, f"{len(alive)} weight versions alive {sorted(alive)}, "
                        f"at most {max_versions} allowed")
        if stashed or len(done) != total:
            missing = sorted(set(range(total)) - done)
            raise ScheduleError(f"stage {stage}: microbatches {missing[:8]}"
                                f"{' ...' if len(missing) > 8 else ''} miss a forward or a "
                                f"backward\n" + format_grid(schedule))
        if newest != num_batches:
            raise ScheduleError(f"stage {stage}: {newest} steps for {num_batches} batches\n"
                                + format_grid(schedule))
    _check_channel_order(schedule)


def _check_channel_order(schedule: Sequence[Sequence[Action]]) -> None:
    """Point-to-point messages between two stages are matched in order (Megatron's p2p has no
    tags), so a stage must receive in the order its neighbour sends: activations from stage
    i-1 in stage i-1's forward order, gradients from stage i+1 in stage i+1's backward order."""
    def order(actions: Sequence[Action], kind: Kind) -> list[tuple[int, int]]:
        return [(a.microbatch, j) for j, a in enumerate(actions) if a.kind is kind]

    for stage in range(len(schedule) - 1):
        for kind, sender, receiver in ((Kind.FORWARD, stage, stage + 1),
                                       (Kind.BACKWARD, stage + 1, stage)):
            sent = order(schedule[sender], kind)
            for (k_sent, _), (k_recv, j) in zip(sent, order(schedule[receiver], kind)):
                if k_sent != k_recv:
                    raise ScheduleError(
                        f"stage {receiver}, step {j} ({schedule[receiver][j]}): receives "
                        f"microbatch {k_recv} from stage {sender}, which sends microbatch "
                        f"{k_sent} at that point\n" + format_grid(schedule, {receiver: j}))
