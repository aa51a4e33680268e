"""What the planner prices: a `Layout` (t, d, w, b, m, schedule, virtual stages, experts, split),
the pieces each pipeline rank holds under its placement (`rank_parts`, `moe_layers_of`), and why
the training would refuse a layout (`Layout.problem`, `expert_problem`, `moe_placement_problem`).

Invariant: one map from virtual stages to ranks, `schedules.placement_of`, the one the executor
and the training build; the refusals are megatron_2bw.schedules.requirements' and
megatron_2bw.arguments' rules, not copies of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_2bw.schedules import V_SCHEDULES, LayerSplit, placement_of
from megatron_2bw.schedules.requirements import (Batch, recompute_problem, too_few_microbatches,
                                                  v_placement_problem, virtual_stage_problem)

if TYPE_CHECKING:
    from .model import ModelSpec

__all__ = ["Layout", "RankParts", "rank_parts", "moe_layers_of", "expert_problem",
           "moe_placement_problem"]


@dataclass(frozen=True)
class Layout:
    """One configuration the planner considers."""

    t: int
    """Tensor-parallel size (`--tensor-model-parallel-size`)."""
    d: int
    """Pipeline depth (`--pipeline-model-parallel-size`)."""
    w: int
    """Data-parallel width: pipelines side by side."""
    b: int
    """Microbatch size (`--micro-batch-size`)."""
    m: int
    """Microbatches per iteration per pipeline: B = b w m."""
    recompute: bool
    """Full activation recomputation, one layer per checkpoint."""
    schedule: str
    """`--pipeline-schedule`: one of ALL_SCHEDULES ("megatron": megatron-core's 1F1B)."""
    v: int = 1
    """Virtual stages (model chunks) per pipeline rank: Megatron's interleaved 1F1B when > 1
    (`--num-virtual-stages-per-pipeline-rank`; SC'21 Section 2.2.2)."""
    selective: bool = False
    """Selective recomputation (`--recompute-granularity selective`): the attention core is
    replayed in the backward and keeps nothing (Korthikanti et al. 2022, Section 5); exclusive
    with `recompute`."""
    e: int = 1
    """Expert-parallel size (`--expert-model-parallel-size`; Mixture of Experts only): e
    consecutive ranks of a stage's t w share out the experts."""
    split: tuple[int, ...] | None = None
    """Transformer layers per virtual stage in model order (`schedules.LayerSplit`); None:
    megatron-core's even split. Written as Megatron-LM's layout flags (`flags.layout_flags`)."""

    @property
    def world(self) -> int:
        return self.t * self.d * self.w

    @property
    def global_batch(self) -> int:
        return self.b * self.w * self.m

    def label(self) -> str:
        return (f"t{self.t} d{self.d} w{self.w} b{self.b} m{self.m} {self.schedule}"
                + (f" v{self.v}" if self.v > 1 else "") + (" rc" if self.recompute else "")
                + (" sel" if self.selective else "") + (f" e{self.e}" if self.e > 1 else "")
                + (f" split {'|'.join(map(str, self.split))}" if self.split else ""))

    @property
    def placement(self):
        """Where its virtual stages sit (`schedules.placement_of`)."""
        return placement_of(self.schedule, self.d, self.v if self.d > 1 else 1)

    def layers(self, num_layers: int) -> LayerSplit:
        """Its split of ``num_layers`` layers: `split`, or the even one."""
        placement = self.placement
        if self.split is not None:
            return LayerSplit(self.split, self.d)
        return LayerSplit.even(num_layers, self.d, placement.chunks)

    def problem(self, num_layers: int, tied: bool = True) -> str | None:
        """Why the training refuses this layout (None: it runs it): the rules of
        megatron_2bw.schedules.requirements, which megatron_2bw.arguments raises as flag
        errors (2BW needs m >= d; those in NO_RECOMPUTE run
        without recomputation; V > 1 needs an interleaving schedule, d >= 2, L a multiple of
        d V and m of d, and 2BW-interleaved m V >= 2(d - 1) + (V - 1)d; the V schedules need
        d >= 2, L a multiple of 2d, untied embeddings (``tied``: the model's) and, for
        dualpipev, m >= 2d)."""
        batch = Batch("--global-batch-size", self.global_batch, self.b, self.w)
        too_few = too_few_microbatches(self.schedule, self.d, batch)
        if too_few is not None:
            return too_few.message
        if self.recompute and self.selective:
            return "full and selective recomputation exclude each other"
        found = recompute_problem(self.schedule) if self.recompute or self.selective else None
        even = None if self.split else num_layers  # a split is checked below
        if found is None and self.schedule in V_SCHEDULES:
            found = v_placement_problem(self.schedule, self.d, self.v, even, [batch], tied)
        elif found is None and self.v > 1:
            found = virtual_stage_problem(self.schedule, self.d, self.v, even, [batch],
                                          "--num-virtual-stages-per-pipeline-rank")
        if found is None and self.split is not None:
            stages = self.d * self.placement.chunks
            if len(self.split) != stages or sum(self.split) != num_layers:
                return (f"split {'|'.join(map(str, self.split))} is not {num_layers} layers "
                        f"over {stages} virtual stages")
        elif found is None and num_layers % (self.d * self.placement.chunks):
            return (f"{num_layers} layers do not split evenly over "
                    f"{self.d * self.placement.chunks} virtual stages")
        return None if found is None else found.message


@dataclass(frozen=True)
class RankParts:
    """What one pipeline rank holds and sends under its layout's placement."""

    rank: int
    chunks: tuple[tuple[bool, bool], ...]
    """Per model chunk: (it holds the embedding, it holds the output layer)."""
    sends_forward: int
    """Activations the rank sends per microbatch: one per chunk whose next virtual stage is on
    another rank."""
    sends_backward: int
    """Input gradients it sends per microbatch: one per chunk whose previous virtual stage is
    on another rank."""

    @property
    def embedding(self) -> bool:
        return any(embedding for embedding, _ in self.chunks)

    @property
    def head(self) -> bool:
        return any(head for _, head in self.chunks)


@functools.lru_cache(maxsize=4096)
def _rank_parts(schedule: str, d: int, v: int, rank: int) -> RankParts:
    placement = placement_of(schedule, d, v if d > 1 else 1)

    def sends(chunk: int, step: int) -> bool:
        neighbour = placement.neighbour(rank, chunk, step)
        return neighbour is not None and neighbour[0] != rank

    chunks = range(placement.chunks)
    return RankParts(rank, tuple((placement.is_first(rank, c), placement.is_last(rank, c))
                                 for c in chunks),
                     sum(sends(c, 1) for c in chunks), sum(sends(c, -1) for c in chunks))


@functools.lru_cache(maxsize=1024)
def _chunk_parts(schedule: str, d: int, v: int) -> tuple[tuple[tuple[bool, ...], ...], ...]:
    """Per rank, per chunk: (the first virtual stage, the last, its output goes to another
    rank, its input gradient goes to another rank)."""
    placement = placement_of(schedule, d, v if d > 1 else 1)

    def sends(rank: int, chunk: int, step: int) -> bool:
        neighbour = placement.neighbour(rank, chunk, step)
        return neighbour is not None and neighbour[0] != rank

    return tuple(tuple((placement.is_first(i, c), placement.is_last(i, c), sends(i, c, 1),
                        sends(i, c, -1)) for c in range(placement.chunks)) for i in range(d))


def rank_parts(layout: Layout, rank: int) -> RankParts:
    """Where the model's pieces sit, the one map from virtual stages to ranks the memory and
    time models read (`schedules.placement_of`, as the executor and the training build them):
    in the loop (plain or interleaved) the embedding is on rank 0 and the output layer on rank
    d-1; in the V of zb-v and dualpipev both are on rank 0 (chunk 0 is virtual stage 0, chunk
    1 virtual stage 2d-1), and rank d-1 hands its chunk 0's output to its chunk 1 locally."""
    return _rank_parts(layout.schedule, layout.d, layout.v, rank)


@functools.lru_cache(maxsize=4096)
def _moe_layers_of(pattern: tuple[int, ...], schedule: str, d: int, v: int,
                   rank: int, split: tuple[int, ...] | None = None) -> tuple[int, ...]:
    placement = placement_of(schedule, d, v if d > 1 else 1)
    layers = (LayerSplit(split, d) if split is not None
              else LayerSplit.even(len(pattern), d, placement.chunks))
    virtual = [placement.virtual(rank, c) for c in range(placement.chunks)]
    return tuple(sum(pattern[layers.offset(s):layers.offset(s) + layers.count(s)])
                 for s in virtual)


def moe_layers_of(model: ModelSpec, layout: Layout, rank: int) -> tuple[int, ...]:
    """MoE layers in each model chunk of pipeline rank `rank` (the chunk holding virtual stage
    v has the layers `layout.layers` gives it, as megatron-core numbers them: v L/(d V) ...
    (v + 1) L/(d V) - 1 with the even split; the placement as `rank_parts`); zeros for a
    dense model."""
    return _moe_layers_of(model.moe_pattern, layout.schedule, layout.d, layout.v, rank,
                          layout.split)


def expert_problem(model: ModelSpec, t: int, w: int, e: int, device: str = "cuda"
                   ) -> str | None:
    """Why the training refuses expert-parallel size e with tensor size t and w data-parallel
    pipelines (None: it runs it), the rules of megatron_2bw.arguments.moe._validate_moe and
    megatron-core: E a multiple of e; e divides a stage's t w ranks (Megatron-LM: world
    divisible by expert tensor x expert x pipeline size, expert tensor size 1 here); experts
    with biases need e > 1 (a megatron-core 0.16.1 bug at e = 1); tensor parallelism needs
    sequence parallelism (megatron-core's MoE layer raises without it), which runs on CUDA
    only."""
    if not model.is_moe:
        return None if e == 1 else f"expert-parallel size {e} needs a Mixture-of-Experts model"
    if model.num_experts % e:
        return f"{model.num_experts} experts do not split over e={e} expert-parallel ranks"
    if (t * w) % e:
        return (f"e={e} does not divide the t x w = {t} x {w} ranks of a stage (expert tensor "
                f"parallelism 1)")
    if model.add_bias_linear and e == 1:
        return ("experts with biases at expert-parallel size 1 hit a megatron-core 0.16.1 bug: "
                "plan with --disable-bias-linear (as Megatron-LM's MoE examples)")
    if t > 1 and device != "cuda":
        return (f"t={t} with experts needs --sequence-parallel (megatron-core's MoE layer), "
                f"which runs on CUDA only")
    return None


def moe_placement_problem(model: ModelSpec, layout: Layout) -> str | None:
    """A pipeline rank without an MoE layer (megatron_2bw.arguments.moe._validate_moe_placement:
    the expert optimizer's grad-norm all-reduce spans the pipeline)."""
    if not model.is_moe or layout.d == 1:
        return None
    for rank in range(layout.d):
        if not sum(moe_layers_of(model, layout, rank)):
            return (f"pipeline stage {rank} holds no MoE layer (--moe-layer-freq); every stage "
                    f"needs one")
    return None
