"""What a pipeline schedule needs of a layout, written once: the training's flag validation
(megatron_2bw.arguments) raises these problems as FlagErrors, and the planner
(megatron_2bw.planner.cost.Layout.problem) rejects the layouts that have one, so the planner
refuses exactly what the training refuses.

Each check is a pure function of the layout's numbers and returns a :class:`Problem` (the flag
to fix and one line saying why, every factor printed) or None.

    too_few_microbatches("2bw", d=4, batch=Batch("--global-batch-size", 4, b=1, w=2))
    # Problem("--global-batch-size", "2bw needs m >= d microbatches per batch ...")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_2bw.schedules import VIRTUAL_STAGE_SCHEDULES, keeps_versions
from megatron_2bw.schedules.interleaved import warmup_slots

__all__ = ["Problem", "Batch", "RECOMPUTE_REFUSED", "too_few_microbatches", "recompute_problem",
           "virtual_stage_problem", "v_placement_problem"]

RECOMPUTE_REFUSED = {
    "zb-h1": "the recomputation's nested backward ignores the split into input and weight "
             "gradients",
    "pipemare": "recomputing at the backward would redo the forward with the backward's newer "
                "weights",
    "zb-v": "the recomputation's nested backward ignores the split into input and weight "
            "gradients",
    "dualpipev": "the recomputation's nested backward ignores the split into input and weight "
                 "gradients",
}
"""Schedules that run without activation recomputation, and why."""


@dataclass(frozen=True)
class Problem:
    """Why a layout cannot run: ``flag`` is the one to fix, ``message`` says why."""

    flag: str
    message: str


@dataclass(frozen=True)
class Batch:
    """A batch of ``size`` sequences in microbatches of ``b`` on each of ``w`` data-parallel
    pipelines: m = size / (b w). ``flag`` gives its size (``name``: the part of the flag's
    value it is, e.g. START of --rampup-batch-size)."""

    flag: str
    size: int
    b: int
    w: int
    name: str = ""

    @property
    def m(self) -> int:
        return self.size // (self.b * self.w)

    def split(self) -> str:
        """How m comes about, with every factor: "START 2 / (2 x 1) = 1"."""
        return f"{self.name + ' ' if self.name else ''}{self.size} / ({self.b} x {self.w}) = " \
               f"{self.m}"


def too_few_microbatches(schedule: str, d: int, batch: Batch, where: str = "",
                         ramp: bool = False) -> Problem | None:
    """2BW needs m >= d microbatches per batch (PipeDream-2BW, Section 3.1): its first stage's
    d - 1 look-ahead forwards stay inside the batch, so two versions suffice. PipeDream and
    PipeMare run below m = d (an N-slot store), but not yet while the batch size ramps up
    (``ramp``). ``where``: the batches it applies to, for the message."""
    needs = schedule == "2bw" or (ramp and keeps_versions(schedule))
    if not needs or batch.m >= d:
        return None
    return Problem(batch.flag, f"{schedule} needs m >= d microbatches per batch (pipeline depth "
                               f"{d}){where}: m = {batch.split()}; raise "
                               f"{batch.name or batch.flag} to at least {batch.b * batch.w * d}")


def recompute_problem(schedule: str) -> Problem | None:
    """Recomputation under a schedule in :data:`RECOMPUTE_REFUSED`."""
    if schedule not in RECOMPUTE_REFUSED:
        return None
    return Problem("--recompute-granularity", f"not with --pipeline-schedule {schedule}: "
                                              f"{RECOMPUTE_REFUSED[schedule]}")


def virtual_stage_problem(schedule: str, d: int, v: int, num_layers: int | None,
                          batches: Sequence[Batch], v_flag: str, overlap_p2p_comm: bool = True
                          ) -> Problem | None:
    """V > 1 virtual stages, as Megatron-LM and megatron-core 0.16.1 run them (see
    ``arguments.parallel._validate_virtual_stages``): an interleaving schedule; more than 1 pipeline
    stage (more than 2 for megatron's without overlapped p2p); L a multiple of d V (unless
    ``num_layers`` is None: an uneven split, ``schedules.split``, checked its own); m of each
    batch a multiple of d; and for a version-keeping schedule (2BW-interleaved) the first
    stage's 2(d - 1) + (V - 1)d warm-up forwards inside one batch of m V. ``v_flag`` names the
    flag that set V."""
    if schedule not in VIRTUAL_STAGE_SCHEDULES:
        return Problem(v_flag, f"--pipeline-schedule {schedule} does not run virtual stages yet "
                               f"(V = {v}); use --pipeline-schedule "
                               f"{' or '.join(VIRTUAL_STAGE_SCHEDULES)}")
    least = 2 if overlap_p2p_comm or schedule != "megatron" else 3
    if d < least:
        return Problem("--pipeline-model-parallel-size",
                       f"virtual stages (V = {v}) need more than {least - 1} pipeline stages"
                       f"{'' if overlap_p2p_comm else ' with --no-overlap-p2p-communication'}, "
                       f"got {d} (as in Megatron-LM)")
    if num_layers is not None and num_layers % (d * v):
        return Problem("--num-layers", f"{num_layers} layers do not split evenly over {d} "
                                       f"pipeline stages x {v} virtual stages = {d} x {v} = "
                                       f"{d * v} model chunks")
    look_ahead = warmup_slots(d, 0, v)
    for batch in batches:
        if batch.m % d:
            return Problem(batch.flag, f"virtual stages run microbatches in groups of the "
                                       f"pipeline depth {d}: {batch.split()} microbatches is "
                                       f"not a multiple of {d}")
        if keeps_versions(schedule) and batch.m * v < look_ahead:
            return Problem(batch.flag, f"{schedule} with {v} virtual stages keeps two weight "
                                       f"versions only when the first stage's {look_ahead} "
                                       f"warm-up forwards (2(d-1) + (V-1)d) fit in one batch: "
                                       f"m x V = {batch.m} x {v} < {look_ahead}")
    return None


def v_placement_problem(schedule: str, d: int, v: int | None, num_layers: int | None,
                        batches: Sequence[Batch], tied: bool) -> Problem | None:
    """zb-v and dualpipev (``V_SCHEDULES``): two model chunks per rank in a V (rank i holds
    stages i and 2d-1-i), so V is theirs (None or 2), d >= 2, L a multiple of 2d (unless
    ``num_layers`` is None, as above), untied
    embeddings (the V puts the embedding and the output layer on rank 0's two chunks, outside
    megatron-core's embedding group of first and last rank), and for DualPipeV m >= 2d in every
    batch."""
    if v not in (None, 1, 2):
        return Problem("--num-virtual-stages-per-pipeline-rank",
                       f"--pipeline-schedule {schedule} runs 2 model chunks per rank (a V); "
                       f"leave it out")
    if d < 2:
        return Problem("--pipeline-model-parallel-size",
                       f"--pipeline-schedule {schedule} needs at least 2 pipeline stages, got {d}")
    if num_layers is not None and num_layers % (2 * d):
        return Problem("--num-layers", f"{num_layers} layers do not split evenly over the V's "
                                       f"2 x {d} pipeline stages = {2 * d} model chunks")
    if tied:
        return Problem("--untie-embeddings-and-output-weights",
                       f"needed by --pipeline-schedule {schedule} (tied embeddings across rank "
                       f"0's two chunks are not supported yet)")
    for batch in batches:
        if schedule == "dualpipev" and batch.m < 2 * d:
            return Problem(batch.flag, f"dualpipev needs microbatches per batch m >= 2 x "
                                       f"pipeline depth = {2 * d}: {batch.split()}")
    return None
