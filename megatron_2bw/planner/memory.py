"""The memory terms of the cost model: the bytes on each pipeline rank's devices (weights and
their versions, gradients, optimizer state, stashed activations, pending weight gradients,
transients) as `StageMemory`, PipeDream-2BW's MEMORY() (Section 4.3) for our schedules.

`MemoryTerms` is a mixin of `cost.CostModel`, built on `compute.ComputeTerms` (a part's bytes
from the profile or the closed forms). Invariant: a rank's pieces follow the placement
(`layout.rank_parts`), and its stash is what the schedule declares (schedules.SCHEDULES).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from megatron_2bw.schedules import SCHEDULES as SCHEDULE_SPECS
from megatron_2bw.schedules import V_SCHEDULES, Kind, call_actions
from megatron_2bw.schedules.interleaved import warmup_slots

from .compute import GRAD_BYTES, MASTER_BYTES, MOMENT_BYTES, ComputeTerms
from .layout import Layout, RankParts, moe_layers_of, rank_parts

__all__ = ["StageMemory", "MemoryEstimate", "MemoryTerms"]


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one device of one pipeline stage."""

    stage: int
    parameters: int
    """Parameters on this device."""
    weights: float
    """One weight version: parameters x bytes per parameter."""
    extra_versions: float
    """Weight versions beyond the first: 2BW keeps two (Section 3.1)."""
    gradients: float
    optimizer: float
    stashed_microbatches: int
    """Most microbatches forwarded and not yet backwarded at once (the schedule's stash; in the
    V, chunk passes / 2 rounded up)."""
    activations: float
    """Stashed microbatches x bytes one keeps; with a split backward the peak of the stash
    and the pending weight gradients' inputs and output gradients together."""
    transient: float
    """Alive only during a backward: a recomputed layer, the logits' gradient."""
    overhead: float
    """Runtime memory before any model (profile's; 0 without one)."""
    gradient_copy: float = 0.0
    """2BW's deferred step holds the optimizer's gradients of one batch while the next
    batch's accumulate (megatron_2bw.deferred)."""
    pending_weight_grads: int = 0
    """Most microbatches (chunk passes in the V) whose I ran and whose W has not, at once."""
    expert_parameters: int = 0
    """Of `parameters`, the experts' (E/e per MoE layer)."""

    @property
    def total(self) -> float:
        return (self.weights + self.extra_versions + self.gradients + self.optimizer
                + self.activations + self.transient + self.overhead + self.gradient_copy)


@dataclass(frozen=True)
class MemoryEstimate:
    stages: tuple[StageMemory, ...]
    """Every stage, or the first and the last, which bound the others."""

    @functools.cached_property
    def peak_stage(self) -> StageMemory:
        """The fullest stage."""
        return max(self.stages, key=lambda s: s.total)

    @property
    def peak(self) -> float:
        """Bytes on the fullest device."""
        return self.peak_stage.total


class _KeptBytes(NamedTuple):
    """Bytes one microbatch leaves, the same on every rank of a layout."""

    layer_full: float
    """A layer's, without full recomputation, plain (no sequence parallelism or selective)."""
    layer: float
    """A dense layer's, as the layout keeps it."""
    moe_whole: float
    moe: float
    """An MoE layer's, as the layout keeps it."""
    embedding: float
    head: float


class MemoryTerms(ComputeTerms):
    """Bytes per device of `cost.CostModel` (PipeDream-2BW Section 4.3, MEMORY)."""

    def memory(self, layout: Layout, every_stage: bool = True) -> MemoryEstimate:
        """Bytes on each stage's devices (PipeDream-2BW Section 4.3, MEMORY).

        `every_stage=False` gives the first and the last stage only, which bound the rest: a
        middle stage holds the same layers as the first without the embedding, and stashes at
        most as many microbatches (d - i is largest at i = 0); in the V rank 0 holds the
        embedding and the output layer, rank d-1 the most stashed and pending chunk passes.
        Each rank's pieces follow the placement (`rank_parts`)."""
        split = layout.layers(self.model.num_layers)
        stage = self._stage_memory(layout)
        ranks = (range(layout.d) if every_stage or layout.split
                 else sorted({0, layout.d - 1} | self._most_experts(layout)))
        return MemoryEstimate(tuple(stage(i, split.of_rank(layout.placement, i))
                                    for i in ranks))

    def memory_lines(self, layout: Layout) -> list[tuple[float, float]]:
        """Per rank, its bytes with no layer and what each more layer adds (one per chunk,
        `memory`'s parts; a split backward's activations bounded from above): the lines
        `balanced_split` fits layers under."""
        stage, chunks = self._stage_memory(layout, bound=True), layout.placement.chunks
        lines, none = [], (0,) * chunks  # dense layers (`balanced_split` is for dense models)
        for i in range(layout.d):
            empty, full = stage(i, none, none).total, stage(i, (1,) * chunks, none).total
            lines.append((empty, (full - empty) / chunks))
        return lines

    def _stage_memory(self, layout: Layout, bound: bool = False):
        """`memory`'s function (rank, its chunks' layers) -> StageMemory for `layout`;
        `bound`: a split backward's activations bounded from above by the stash's and the
        pending W's peaks each in the fullest chunk (without walking the action list)."""
        model, e = self.model, self.element_bytes
        t, d, m = layout.t, layout.d, layout.m
        spec = _schedule_spec(layout.schedule)
        mixed = self.precision != "fp32"
        optimizer_bytes = (MASTER_BYTES if mixed else 0) + MOMENT_BYTES[self.optimizer]
        # The distributed optimizer shards over the data-parallel ranks: the w replicas of a
        # stage, the t w / e expert-data-parallel ones for the experts (megatron-core's
        # expert optimizer over its expert data-parallel group).
        dense_shard = layout.w if self.distributed_optimizer else 1
        expert_shard = t * layout.w // layout.e if self.distributed_optimizer else 1
        kept = self._kept_bytes(layout)
        overhead = self.profile.runtime_overhead_bytes if self.profile else 0.0

        def stage(i: int, chunk_layers: tuple[int, ...],
                  moe: tuple[int, ...] | None = None) -> StageMemory:
            parts = rank_parts(layout, i)
            first, last = parts.embedding, parts.head
            moe = moe_layers_of(model, layout, i) if moe is None else moe
            params = model.rank_parameters(t, sum(chunk_layers), embedding=first, head=last,
                                           moe_layers=sum(moe), e=layout.e)
            expert_params = sum(moe) * (model.moe_layer_parameters(t, layout.e)[1]
                                        if model.is_moe else 0)
            deferred = self._deferred(layout.schedule, d) and (
                self.clip_grad or (model.tied and (first or last)))
            stash = _stash(layout, spec, i)
            activations, pending = self._activations(layout, i, parts, chunk_layers, moe, kept,
                                                     stash, bound)
            return StageMemory(
                stage=i, parameters=params,
                weights=params * e,
                # 2BW: "at most two weight versions" per stage (Section 3.1), 2|W|/d in total;
                # PipeDream 1 + ceil((d-1-i)/m): d - i at m = 1 (2BW paper, Section 2).
                extra_versions=(spec.versions_on(d, m, i) - 1) * params * e
                + self._correction_bytes(layout.schedule, params, layout.w),
                gradients=params * GRAD_BYTES,
                optimizer=self._optimizer_state(params, expert_params, dense_shard,
                                                expert_shard, first or last, t)
                * optimizer_bytes,
                stashed_microbatches=math.ceil(stash),
                activations=activations,
                transient=self._transient(layout, kept, moe, last),
                overhead=overhead,
                gradient_copy=deferred * params * GRAD_BYTES,
                pending_weight_grads=pending,
                expert_parameters=expert_params)

        return stage

    def _kept_bytes(self, layout: Layout) -> _KeptBytes:
        """What one microbatch leaves per layer and part, the same on every rank of `layout`
        (a layer's input alone with recomputation; Section 4.1)."""
        b, t = layout.b, layout.t
        layer_full = self._activation_bytes("layer", b, t, recompute=False)
        layer_kept = (self._activation_bytes("layer", b, t, recompute=True) if layout.recompute
                      else self._layer_options(layer_full, layout, "bytes"))
        # An MoE layer: the dense layer's bytes scaled by the closed forms' ratio; with
        # recomputation it keeps its input alone, as a dense layer.
        moe_whole = layer_full * self._moe_scale(layout, "bytes", selective=False)
        moe_kept = (layer_kept if layout.recompute
                    else layer_full * self._moe_scale(layout, "bytes"))
        embedding = self._activation_bytes("embedding", b, t)
        if self._sequence_parallel(t):
            embedding /= t  # its dropout runs on 1/t of the sequence
        head = self._activation_bytes("head", b, t)
        return _KeptBytes(layer_full, layer_kept, moe_whole, moe_kept, embedding, head)

    def _activations(self, layout: Layout, i: int, parts: RankParts,
                     chunk_layers: tuple[int, ...], moe: tuple[int, ...], kept: _KeptBytes,
                     stash: float, bound: bool) -> tuple[float, int]:
        """(activation bytes, most pending W's) of rank `i` at its peak: `stash` microbatches
        of its chunks' bytes, or with a split backward the stash and the pending W's together
        (at their joint peak along the action list, or bounded from above when `bound`)."""
        d, m = layout.d, layout.m
        # Activations one microbatch leaves in each chunk: each layer's (its input only
        # with recomputation; Section 4.1), plus the embedding's and the head's.
        chunk_bytes = [(layers - n) * kept.layer + n * kept.moe
                       + has_embedding * kept.embedding + has_head * kept.head
                       for layers, n, (has_embedding, has_head)
                       in zip(chunk_layers, moe, parts.chunks)]
        per_microbatch = sum(chunk_bytes)
        activations, pending = stash * per_microbatch, 0
        if d > 1 and _splits_backward(layout.schedule) and bound:
            # at most: the stash's peak and the pending W's peak, each in its fullest chunk
            pending = _weight_grads(layout.schedule, d, min(m, 2 * d + 1), i)
            waiting = self._weight_grad_bytes(layout, parts, chunk_layers, moe)
            activations = (stash * len(chunk_bytes) * max(chunk_bytes)
                           + pending * max(waiting))
        elif d > 1 and _splits_backward(layout.schedule):
            # Split backward: the stash and the pending W's at their joint peak.
            held = _held_counts(layout.schedule, d, min(m, 2 * d + 1), i)
            pending = max(sum(counts[len(chunk_bytes):]) for counts in held)
            activations = _split_peak(held, chunk_bytes,
                                      self._weight_grad_bytes(layout, parts, chunk_layers, moe))
        return activations, pending

    def _transient(self, layout: Layout, kept: _KeptBytes, moe: tuple[int, ...],
                   last: bool) -> float:
        """Bytes alive only during a backward: a recomputed layer (or attention core) exists
        again, and on the output layer's rank the logits' fp32 gradient."""
        whole_layer = self._layer_options(kept.layer_full, layout, "bytes", selective=False)
        replayed = whole_layer if layout.recompute else whole_layer - kept.layer
        if sum(moe):
            replayed = max(replayed,
                           kept.moe_whole if layout.recompute else kept.moe_whole - kept.moe)
        return replayed + last * self.model.logits_gradient_bytes(layout.b, layout.t)

    def _weight_grad_bytes(self, layout: Layout, parts: RankParts,
                           chunk_layers: tuple[int, ...], moe: tuple[int, ...]) -> list[float]:
        """Per chunk of the rank: bytes one microbatch's pending W keeps (its layers' and, on
        the output layer's chunk, that layer's inputs and output gradients;
        ModelSpec.layer_weight_grad_bytes, moe_layer_weight_grad_bytes for the chunk's `moe`
        MoE layers)."""
        b, t, e = layout.b, layout.t, self.element_bytes
        sp = self._sequence_parallel(t)
        layer = self.model.layer_weight_grad_bytes(b, t, e, sequence_parallel=sp)
        moe_layer = self.model.moe_layer_weight_grad_bytes(b, t, e) if any(moe) else 0.0
        head = self.model.head_weight_grad_bytes(b, t, e, sequence_parallel=sp,
                                                 with_embedding=parts.embedding)
        return [(layers - n) * layer + n * moe_layer + has_head * head
                for layers, n, (_, has_head) in zip(chunk_layers, moe, parts.chunks)]

    def _most_experts(self, layout: Layout) -> set[int]:
        """The pipeline rank holding the most MoE layers (a middle one can hold more than the
        first and the last under a --moe-layer-freq pattern); none for a dense model."""
        if not self.model.is_moe:
            return set()
        counts = [sum(moe_layers_of(self.model, layout, i)) for i in range(layout.d)]
        return {counts.index(max(counts))}

    def _optimizer_state(self, params: int, expert_params: int, dense_shard: int,
                         expert_shard: int, embedding: bool, t: int) -> float:
        """Parameters whose optimizer state a rank of the stage keeps. Muon's sharded form
        (--optimizer dist_muon, megatron-core's layer-wise optimizer) deals out whole
        parameters: the fullest rank keeps up to one largest tensor more than an even share
        (the experts' over their expert data-parallel ranks: one expert's FC1 more)."""
        dense = params - expert_params
        if self.optimizer == "muon" and dense_shard > 1:
            experts = expert_params / expert_shard
            if expert_params and expert_shard > 1:
                experts += self.model.expert_fc1_width * self.model.hidden_size
            return dense / dense_shard + self._largest_tensor(t, embedding) + experts
        return dense / dense_shard + expert_params / expert_shard

    def _largest_tensor(self, t: int, embedding: bool) -> int:
        """Elements of a stage's largest weight tensor on one of t ranks: a layer's matrix, or
        the word embedding's (output layer's) shard where the stage holds it."""
        model = self.model
        largest = max(rows * cols for rows, cols in model.layer_matrices(t))
        if embedding:
            largest = max(largest, model.padded_vocab(t) // t * model.hidden_size)
        return largest

    def _correction_bytes(self, schedule: str, params: int, w: int) -> float:
        """What 2BW's stale-weight correction keeps beyond the two versions: predict's and
        dc's third version of the weights, ef's last update (fp32, weight-shaped); under bf16
        and fp16 dc's fp32 W(t-1) of the masters (weight-shaped), and ef's and predict's copy
        of the masters before the step (of this rank's 1/w of them with a sharded optimizer)."""
        if schedule != "2bw" or self.correction == "none":
            return 0.0
        mixed = self.precision != "fp32"
        masters_before = 4.0 / (w if self.distributed_optimizer else 1) if mixed else 0.0
        if self.correction == "ef":
            return params * (4.0 + masters_before)
        if self.correction == "predict":
            return params * (self.element_bytes + masters_before)
        return params * (self.element_bytes + (4.0 if mixed else 0.0))


def _stash(layout: Layout, spec, stage: int) -> float:
    """Microbatches' worth of activations stage `stage` keeps at its peak.

    GPipe m, Flush and 2BW d - i (1F1B, PipeDream-2BW Sections 2.2, 3.1), naive 1, as the
    schedule declares it (schedules.SCHEDULES[...].stash). Megatron's interleaved 1F1B with V
    chunks per rank holds (d - i - 1) 2 + (V - 1) d + 1 chunk-microbatches (megatron-core's
    warm-up count plus the one in flight), each 1/V of the stage: d + (d - 1)/V on the first
    stage (Korthikanti et al. 2022, Section 4.2.3). The split-backward schedules' pending
    weight gradients are counted with their stash along the action list (`_split_peak`)."""
    d, m, v = layout.d, layout.m, layout.v
    if d == 1:
        return 1
    if layout.schedule in V_SCHEDULES:
        # Chunk passes, each half a stage's activations (ZB-V at most 2d, DualPipeV 2d + 1).
        return min(spec.stash(d, m, stage), 2 * m) / 2
    if v > 1:
        # Every interleaved order (megatron's, flush's, 2BW-interleaved's) has the same warm-up.
        return min(m * v, warmup_slots(d, stage, v) + 1) / v
    return spec.stash(d, m, stage)


@functools.lru_cache(maxsize=4096)
def _weight_grads(schedule: str, d: int, m: int, rank: int) -> int:
    """The schedule's peak pending weight gradients on `rank` (its `weight_grads`)."""
    return _schedule_spec(schedule).weight_grads(d, m, rank)


@functools.lru_cache(maxsize=None)
def _splits_backward(schedule: str) -> bool:
    """Whether `schedule` runs a microbatch's I and W apart (zb-h1, zb-v, dualpipev)."""
    return schedule in SCHEDULE_SPECS and SCHEDULE_SPECS[schedule].weight_grads(2, 4, 0) > 0


def _split_peak(held: tuple[tuple[int, ...], ...], stash_bytes: list[float],
                pending_bytes: list[float]) -> float:
    """Peak activation bytes of a split-backward schedule on a rank whose action list passes
    through the counts `held` (`_held_counts`): per chunk, the passes forwarded and not yet
    through their I (`stash_bytes` each) and those whose I ran and whose W has not
    (`pending_bytes` each: the linear layers' inputs and output gradients,
    schedules/wgrad.py)."""
    weights = (*stash_bytes, *pending_bytes)
    return max(sum(n * x for n, x in zip(counts, weights)) for counts in held)


@functools.lru_cache(maxsize=4096)
def _held_counts(schedule: str, d: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """The (stashed per chunk, pending W per chunk) counts `rank` passes through in one call of
    its action list, only those no other count dominates (the peak of any non-negative
    weighting is at one of them). The I that makes a W pending ends that pass's stash. From
    m = 2d + 1 on the steady state only repeats: the counts are those of m = 2d + 1
    (tests/test_planner.py checks it over a grid), which the memory model asks for."""
    actions = call_actions(schedule, d, m, rank, 0, fill=True, drain=True)
    chunks = 1 + max(a.chunk for a in actions)
    held, seen = [0] * (2 * chunks), set()
    for a in actions:
        if a.kind is Kind.FORWARD:
            held[a.chunk] += 1
        elif a.kind in (Kind.BACKWARD, Kind.INPUT_GRAD):
            held[a.chunk] -= 1
            held[chunks + a.chunk] += a.kind is Kind.INPUT_GRAD
        elif a.kind is Kind.WEIGHT_GRAD:
            held[chunks + a.chunk] -= 1
        seen.add(tuple(held))
    maxima: list[tuple[int, ...]] = []  # largest sums first: a dominating count comes earlier
    for c in sorted(seen, key=lambda c: (-sum(c), c)):
        if not any(all(x >= y for x, y in zip(o, c)) for o in maxima):
            maxima.append(c)
    return tuple(maxima)


def _schedule_spec(schedule: str):
    """What a schedule declares about memory; Megatron's 1F1B stashes as Flush does."""
    return SCHEDULE_SPECS["flush" if schedule == "megatron" else schedule]
