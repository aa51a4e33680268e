"""Pipeline schedules as data: per-stage action lists for GPipe, PipeDream-Flush, PipeDream-2BW,
PipeDream with weight stashing, PipeMare (no stashing), ZB-H1 (zero bubble, split backward),
ZB-V and DualPipeV (two model chunks per stage in a V, `vshape`) and naive model parallelism, one Megatron call (one batch) at a time or for a whole training.

    call_actions("2bw", depth=4, microbatches=8, stage=1, call=t, fill=t == 0, drain=last)
    pipeline_actions("flush", depth=4, microbatches=8, num_batches=3)  # [stage] -> [Action]
    call_program("2bw", 4, 8, stage=1, call=t, fill=..., drain=...)  # actions + exchanges
    pipeline_programs("2bw", depth=4, microbatches=8, num_batches=3)  # [stage] -> [Step]

The same lists drive the executor, the simulator (`simulate.simulate`), the planner and the
timelines; the programs (`comm.fuse`: the lists with their fused send/receive groups) are what
the executor runs and what the simulator's NCCL mode proves free of deadlocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from .actions import (Action, Comms, Kind, P2P, Placement, ScheduleError, communication,
                      format_actions, format_grid, parse_action, parse_actions, validate)
from .comm import Exchange, Step, Transfer, actions_of, fuse, transfers_of, unbatched
from .flush import flush
from .gpipe import gpipe
from .interleaved import forward_slots, interleaved_flush, interleaved_twobw
from .naive import naive
from .pipedream import drain_notice, pipedream, pipedream_version, versions_held
from .pipemare import pipemare, pipemare_backward_version
from .simulate import Costs, SimResult, Span, format_timeline, simulate
from .split import LayerSplit, LayoutError, LayoutFlags, layer_split
from .twobw import twobw, twobw_version
from .vshape import dualpipev, vshape_stash, vshape_weight_grads, zbv
from .zbh1 import zbh1

__all__ = [
    "Action", "Kind", "P2P", "Comms", "Placement", "ScheduleError", "ScheduleSpec", "SCHEDULES",
    "keeps_versions", "placement_of", "V_SCHEDULES", "INTERLEAVED", "PIPELINE_SCHEDULES", "VIRTUAL_STAGE_SCHEDULES",
    "parse_action", "format_actions", "parse_actions", "communication", "format_grid",
    "validate", "call_actions", "stage_actions", "pipeline_actions", "validate_schedule",
    "Costs", "SimResult", "Span", "simulate", "format_timeline",
    "LayerSplit", "LayoutError", "LayoutFlags", "layer_split",
    "Transfer", "Exchange", "Step", "fuse", "unbatched", "actions_of", "transfers_of",
    "call_program", "pipeline_programs", "forward_program",
]


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule generator and what it declares about memory."""

    name: str
    generate: Callable[..., list[Action]]
    """(depth, microbatches, stage, batch, *, fill, drain) -> the stage's actions in that call."""
    version_of: Callable[[int, int, int, int], int]
    """(depth, microbatches, stage, microbatch) -> the weight version the (global) microbatch
    reads on that stage."""
    max_versions: int
    """Weight versions a stage holds at most (the newest and those stashed microbatches read)
    with m >= d; `versions` gives them per stage for any m."""
    stash: Callable[[int, int, int], int]
    """(depth, microbatches, stage) -> peak stashed activations (microbatches forwarded and not
    yet through their B or I) on that stage."""
    weight_grads: Callable[[int, int, int], int] = lambda d, m, i: 0
    """(depth, microbatches, stage) -> peak microbatches whose input gradient ran and whose
    weight gradient has not (0 for schedules with a fused backward)."""
    backward_version_of: Callable[[int, int, int, int], int] | None = None
    """Like `version_of`, for the backward (B, I, W) where it reads another version than its
    forward (no weight stashing); None: the forward's."""
    shape: str = "loop"
    """Where its model chunks sit (`Placement`): "v" runs two chunks per stage in a V; "loop"
    one chunk, or V chunks interleaved (`INTERLEAVED`)."""
    versions: Callable[[int, int, int], int] | None = None
    """(depth, microbatches, stage) -> weight versions the stage holds at most; None:
    `max_versions` on every stage."""
    drain_notice: Callable[[int, int], int] = lambda d, m: 1
    """(depth, microbatches) -> calls ahead a drain must be known (the look-ahead forwards
    reach that many batches ahead; 1: the next call's)."""

    def versions_on(self, depth: int, microbatches: int, stage: int) -> int:
        """Weight versions `stage` holds at most."""
        if self.versions is None:
            return self.max_versions
        return self.versions(depth, microbatches, stage)


def _batch_reads(version_of_batch: Callable[[int], int]) -> Callable[[int, int, int, int], int]:
    """A rule under which every microbatch of batch b reads ``version_of_batch(b)``."""
    return lambda d, m, i, k: version_of_batch(k // m)


SCHEDULES: dict[str, ScheduleSpec] = {
    # 2BW: Section 3.1 "at most two weight versions"; the 1F1B stash is d - i (m >= d).
    "2bw": ScheduleSpec("2bw", twobw, _batch_reads(twobw_version), 2, lambda d, m, i: d - i),
    "flush": ScheduleSpec("flush", flush, _batch_reads(lambda b: b), 1,
                          lambda d, m, i: min(d - i, m)),
    "gpipe": ScheduleSpec("gpipe", gpipe, _batch_reads(lambda b: b), 1, lambda d, m, i: m),
    # PipeDream with weight stashing: the newest version and those the look-ahead forwards
    # read, 1 + ceil((d-i-1)/m) (2 at m >= d, d - i at m = 1); the same 1F1B stash as 2BW.
    "pipedream": ScheduleSpec("pipedream", pipedream, pipedream_version, 2,
                              lambda d, m, i: d - i, versions=versions_held,
                              drain_notice=drain_notice),
    # PipeMare: pipedream's order and forwards, backwards at the newest version: one version
    # (Yang et al. 2021); see pipemare.weight_buffers for T2's delta and copy.
    "pipemare": ScheduleSpec("pipemare", pipemare, pipedream_version, 1, lambda d, m, i: d - i,
                             backward_version_of=pipemare_backward_version,
                             drain_notice=drain_notice),
    "naive": ScheduleSpec("naive", naive, _batch_reads(lambda b: b), 1, lambda d, m, i: 1),
    # ZB-H1 (Qi et al., ICLR 2024, Section 2.1): flush's order and stash, W(j-i) after I(j).
    "zb-h1": ScheduleSpec("zb-h1", zbh1, _batch_reads(lambda b: b), 1,
                          lambda d, m, i: min(d - i, m), lambda d, m, i: min(i + 1, m)),
    # ZB-V and DualPipeV (schedules/vshape.py): two chunks per stage in a V; stash and
    # pending W's counted in chunk passes (each half a stage's activations).
    "zb-v": ScheduleSpec("zb-v", zbv, _batch_reads(lambda b: b), 1, vshape_stash("zb-v"),
                         vshape_weight_grads("zb-v"), shape="v"),
    "dualpipev": ScheduleSpec("dualpipev", dualpipev, _batch_reads(lambda b: b), 1,
                              vshape_stash("dualpipev"), vshape_weight_grads("dualpipev"),
                              shape="v"),
}
"""Our schedules (``--pipeline-schedule``; "megatron" is megatron-core's own). Those holding
more than one weight version never flush: a call leaves microbatches in flight."""


V_SCHEDULES = tuple(name for name, spec in SCHEDULES.items() if spec.shape == "v")
"""Schedules that run two model chunks per stage in the V placement."""

INTERLEAVED: dict[str, Callable[..., list[Action]]] = {"flush": interleaved_flush,
                                                     "2bw": interleaved_twobw}
"""Schedules that also run V > 1 model chunks per stage (virtual pipeline stages), with the
same weights as with one chunk: (depth, m, stage, batch, chunks, fill=, drain=) -> actions."""

PIPELINE_SCHEDULES = (*SCHEDULES, "megatron")
"""Every ``--pipeline-schedule``: ours and megatron-core's own 1F1B ("megatron")."""

VIRTUAL_STAGE_SCHEDULES = ("megatron", *INTERLEAVED)
"""Schedules that run virtual pipeline stages: megatron-core's interleaved 1F1B, and ours with
an interleaved form (flush, 2BW-interleaved)."""


def placement_of(schedule: str, depth: int, chunks: int = 1) -> Placement:
    """Where `schedule`'s model chunks sit: the V of a V schedule (two chunks, whatever
    `chunks` says short of another number), else the loop of `chunks` chunks."""
    if schedule in SCHEDULES and SCHEDULES[schedule].shape == "v":
        if chunks not in (1, 2):
            raise ValueError(f"{schedule} runs 2 model chunks per stage (a V), not {chunks}")
        return Placement.v(depth)
    return Placement(depth, chunks)


def keeps_versions(schedule: str) -> bool:
    """Whether `schedule` leaves microbatches in flight between calls and reads several weight
    versions (2bw, pipedream; pipemare, whose backwards read a newer version than their
    forwards): the executor keeps a version store and the loop drains."""
    if schedule not in SCHEDULES:
        return False
    spec = SCHEDULES[schedule]
    return spec.max_versions > 1 or spec.backward_version_of is not None


def _spec(schedule: str, depth: int, microbatches: int) -> ScheduleSpec:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    if depth < 1 or microbatches < 1:
        raise ValueError(f"need depth >= 1 and microbatches >= 1, got depth={depth}, "
                         f"microbatches={microbatches}")
    return SCHEDULES[schedule]


def call_actions(schedule: str, depth: int, microbatches: int, stage: int, call: int, *,
                 fill: bool, drain: bool, chunks: int = 1,
                 drain_at: int | None = None) -> list[Action]:
    """Stage `stage`'s actions in Megatron call `call` (= batch index), ending with its step.

    `fill`: the pipeline is empty when the call starts (first call, or first after a drain).
    `drain`: the call leaves it empty (last call, or before evaluation / a checkpoint).
    Only 2BW looks at them; the other schedules fill and drain in every call. `chunks`: model
    chunks per stage (`INTERLEAVED` schedules; a V schedule runs two whatever it says).
    `drain_at`: the batch of the next planned drain (pipedream and pipemare at m < d stop their
    look-ahead forwards there)."""
    spec = _spec(schedule, depth, microbatches)
    if not 0 <= stage < depth:
        raise ValueError(f"stage {stage} outside 0..{depth - 1}")
    if placement_of(schedule, depth, chunks).shape == "loop" and chunks > 1:
        if schedule not in INTERLEAVED:
            raise ValueError(f"{schedule} runs one model chunk per stage; with {chunks}: "
                             f"{', '.join(sorted(INTERLEAVED))}")
        return INTERLEAVED[schedule](depth, microbatches, stage, call, chunks, fill=fill,
                                     drain=drain)
    if spec.versions is not None or spec.backward_version_of is not None:
        return spec.generate(depth, microbatches, stage, call, fill=fill, drain=drain,
                             drain_at=drain_at)
    return spec.generate(depth, microbatches, stage, call, fill=fill, drain=drain)


def stage_actions(schedule: str, depth: int, microbatches: int, stage: int, num_batches: int,
                  *, drains: Iterable[int] = (), chunks: int = 1) -> list[Action]:
    """Stage `stage`'s whole-training list: the calls 0..num_batches-1 one after another.
    The last call drains, and so do the calls in `drains`."""
    drains = set(drains) | {num_batches - 1}
    actions = []
    for call in range(num_batches):
        actions += call_actions(schedule, depth, microbatches, stage, call,
                                fill=call == 0 or call - 1 in drains, drain=call in drains,
                                chunks=chunks, drain_at=_next_drain(drains, call))
    return actions


def _next_drain(drains: set[int], call: int) -> int:
    """The first drain at or after `call` (the last call always drains)."""
    return min(t for t in drains if t >= call)


def pipeline_actions(schedule: str, depth: int, microbatches: int, num_batches: int, *,
                     drains: Iterable[int] = (), chunks: int = 1) -> list[list[Action]]:
    """All stages' whole-training lists, [stage] -> [Action], validated."""
    drains = tuple(drains)
    lists = [stage_actions(schedule, depth, microbatches, stage, num_batches, drains=drains,
                           chunks=chunks)
             for stage in range(depth)]
    validate_schedule(schedule, lists, microbatches, num_batches)
    return lists


def validate_schedule(schedule: str, lists: list[list[Action]], microbatches: int,
                      num_batches: int) -> None:
    """`validate` with the schedule's version rule and weight-version bound."""
    depth, spec = len(lists), _spec(schedule, len(lists), microbatches)
    backward = spec.backward_version_of
    validate(lists, microbatches, num_batches,
             version_of=lambda stage, k: spec.version_of(depth, microbatches, stage, k),
             backward_version_of=None if backward is None else
             lambda stage, k: backward(depth, microbatches, stage, k),
             max_versions=max(spec.versions_on(depth, microbatches, i) for i in range(depth)),
             placement=placement_of(schedule, depth,
                                    1 + max((a.chunk for x in lists for a in x), default=0)))


def call_program(schedule: str, depth: int, microbatches: int, stage: int, call: int, *,
                 fill: bool, drain: bool, chunks: int = 1,
                 drain_at: int | None = None) -> list[Step]:
    """Stage `stage`'s program in call `call`: `call_actions` with its exchanges (`comm.fuse`).
    Every stage of a pipeline is in the same call with the same `fill` and `drain`, so each
    derives its neighbours' lists and places its sends where they are received."""
    def actions(s: int) -> list[Action]:
        return call_actions(schedule, depth, microbatches, s, call, fill=fill, drain=drain,
                            chunks=chunks, drain_at=drain_at)

    placement = placement_of(schedule, depth, chunks)
    neighbours = {s: actions(s) for s in placement.peers(stage)}
    return fuse(actions(stage), stage, depth, neighbours, placement=placement)


def pipeline_programs(schedule: str, depth: int, microbatches: int, num_batches: int, *,
                      drains: Iterable[int] = (), chunks: int = 1) -> list[list[Step]]:
    """All stages' whole-training programs, [stage] -> [Step]: the calls of
    `pipeline_actions` one after another, each with its exchanges."""
    drains = set(drains) | {num_batches - 1}
    programs: list[list[Step]] = [[] for _ in range(depth)]
    for call in range(num_batches):
        for stage in range(depth):
            programs[stage] += call_program(schedule, depth, microbatches, stage, call,
                                            fill=call == 0 or call - 1 in drains,
                                            drain=call in drains, chunks=chunks,
                                            drain_at=_next_drain(drains, call))
    validate_schedule(schedule, [actions_of(p) for p in programs], microbatches, num_batches)
    return programs


def forward_program(depth: int, microbatches: int, stage: int, chunks: int = 1,
                    placement: Placement | None = None) -> list[Step]:
    """An evaluation call (forward only) on `stage`: every microbatch forward once through
    each of its `chunks` model chunks, in order (interleaved: `interleaved.forward_slots`; the
    V: all through chunk 0, then all through chunk 1), with its exchanges. Actions read
    version 0 here; the executor uses the newest weights."""
    placement = placement or Placement(depth, chunks)

    def forwards() -> list[Action]:
        if placement.shape == "v":
            return [Action(Kind.FORWARD, j, 0, 0, c) for c in (0, 1)
                    for j in range(microbatches)]
        if chunks > 1:
            return [Action(Kind.FORWARD, j, 0, 0, c)
                    for j, c in forward_slots(depth, microbatches, chunks)]
        return [Action(Kind.FORWARD, j, 0, 0) for j in range(microbatches)]

    neighbours = {s: forwards() for s in placement.peers(stage)}
    return fuse(forwards(), stage, depth, neighbours, placement=placement)
