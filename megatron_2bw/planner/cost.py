"""Memory per device and time per iteration of a layout: PipeDream-2BW's MEMORY() and
THROUGHPUT() (Section 4.3, "closed-form cost functions"), extended with tensor parallelism
and the choice of pipeline schedule. A layout is (t, d, w, b, m, recompute, schedule), plus e
expert-parallel ranks for MoE.

    cm = CostModel(model, cluster, precision="bf16")            # closed forms
    cm = CostModel(model, cluster, "fp32", profile=Profile.load("tools/profiles/cpu.json"))
    cm.memory(layout).peak      # bytes on the fullest device
    cm.time(layout).iteration   # seconds per iteration (simulate=True: our schedule simulator)

Invariants: ranks are placed as megatron-core places them (tensor fastest, then data, then
pipeline; expert groups carved from a stage's t*w ranks in tp-ep-dp-pp order); a profile's
measured times and bytes are scaled to this model by FLOPs and closed-form bytes.
What each term charges: docs/planner.md ("The planner as a library", "One structure ...").
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from megatron_2bw.schedules import PIPELINE_SCHEDULES
from megatron_2bw.schedules.requirements import RECOMPUTE_REFUSED

# The byte constants, NS_STEPS and the underscored helpers are re-exported for their callers.
from .bubble import _simulate_normalized, simulated_iteration
from .cluster import Cluster
from .compute import (GRAD_BYTES, MASTER_BYTES, MOMENT_BYTES, NS_STEPS,
                      _closed_form_bytes, kernels)
from .layout import (Layout, RankParts, expert_problem, moe_layers_of, moe_placement_problem,
                     rank_parts)
from .memory import MemoryEstimate, MemoryTerms, StageMemory, _held_counts
from .model import ModelSpec
from .timing import TimeEstimate, TimeTerms

if TYPE_CHECKING:
    from .profile import Profile

__all__ = ["Layout", "RankParts", "rank_parts", "moe_layers_of", "expert_problem",
           "moe_placement_problem", "StageMemory", "MemoryEstimate",
           "TimeEstimate", "CostModel", "PRECISIONS", "OPTIMIZERS", "SCHEDULE_NOTES",
           "ALL_SCHEDULES", "NO_RECOMPUTE",
           "simulated_iteration", "kernels"]

PRECISIONS = {"fp32": 4, "fp16": 2, "bf16": 2}
"""Bytes of a parameter and of an activation element."""

OPTIMIZERS = ("adam", "sgd", "muon")

SCHEDULE_NOTES = {
    "2bw": "PipeDream-2BW: no flush, bubble only when training starts; 2 weight versions; "
           "1-stale update W(t+1) = W(t) - lr grad(W(t-1)) (Section 3.1); stash d - i",
    "flush": "PipeDream-Flush 1F1B: flush every batch, exact update; 1 version; stash "
             "d - i; bubble (d - 1)/(m + d - 1)",
    "gpipe": "GPipe: all forwards, then all backwards; exact; stash m; bubble "
             "(d - 1)/(m + d - 1)",
    "naive": "no pipelining: one stage busy at a time; exact; stash 1; bubble (d - 1)/d",
    "pipedream": "PipeDream-1F1B with weight stashing: no flush, bubble only when training "
                 "starts; 1 + ceil((d - 1 - i)/m) weight versions (2 at m >= d, d - i at "
                 "m = 1); each stage updates after its own "
                 "backwards (stale by up to d - 1 - i microbatches' look-ahead); stash d - i",
    "pipemare": "PipeMare: PipeDream's order and forwards, backwards at the newest weights "
                "(no stash of versions for the backward); no flush; 1 version; "
                "stash d - i; no recomputation",
    "zb-h1": "ZB-H1: flush's order with the backward split into input (I) and weight (W) "
             "gradients, W of stage i delayed by i microbatches; exact; 1 version; stash "
             "d - i plus min(i + 1, m) pending W (each the linear layers' inputs and output "
             "gradients, 16 sbh e per layer); bubble "
             "(d - 1)(F + I - W) (Qi et al., ICLR 2024, Section 2.1); no recomputation",
    "zb-v": "ZB-V: two chunks per rank in a V (rank i holds stages i and 2d-1-i; rank 0 the "
            "embedding and the output layer), split backward; exact; 1 version; stash at most "
            "2d chunk halves = d microbatches, plus the pending W's; bubble (d - 1) F/2 per "
            "rank (Qi et al., ICLR 2024, Section 6); untied embeddings, no recomputation",
    "dualpipev": "DualPipeV: DualPipe cut in half, two chunks per rank in a V, split backward "
                 "in the cool-down; exact; 1 version; stash d + 1/2 microbatches plus the "
                 "pending W's; embedding and output layer on rank 0; bubble "
                 "(d - 1)(F&B + B - 3W) of a chunk (DeepSeek-V3, Table 2); m >= 2d, untied "
                 "embeddings, no recomputation",
    "megatron": "megatron-core 1F1B, interleaved over V chunks per rank when V > 1; exact; "
                "stash d + (d - 1)/V on stage 0; bubble (d - 1)/(V m) (SC'21 Section 2.2)",
}
"""What each schedule costs and means, as the time and memory models charge it."""

ALL_SCHEDULES = PIPELINE_SCHEDULES
"""Every `--pipeline-schedule` the training accepts."""

NO_RECOMPUTE = tuple(RECOMPUTE_REFUSED)
"""Schedules the training runs without recomputation (megatron_2bw.arguments refuses
--recompute-granularity with them: zb-h1's W and pipemare's newer backward weights would replay
the forward differently)."""


@dataclass
class CostModel(MemoryTerms, TimeTerms):
    """MEMORY() and THROUGHPUT() of PipeDream-2BW Section 4.3 for our layouts: its memory
    terms (memory.MemoryTerms), time terms (timing.TimeTerms: compute.ComputeTerms,
    comm_cost.CommTerms, bubble) and the uneven split that balances them."""

    model: ModelSpec
    cluster: Cluster
    precision: str = "bf16"
    profile: "Profile | None" = None
    optimizer: str = "adam"
    distributed_optimizer: bool = False
    """`--use-distributed-optimizer`: master weights and moments sharded over the w replicas."""
    clip_grad: bool = True
    """Gradient clipping (Megatron's default 1.0) all-reduces the norm over all stages, so the
    optimizer step is a pipeline-wide synchronisation; so are fp16's found-inf check and the
    tied embedding's gradient all-reduce between the first and the last stage."""
    deferred_step: bool = True
    """2BW defers a step whose norm or embedding all-reduce spans the pipeline to the first
    reader of its result (megatron_2bw.deferred): no wait, one more fp32 gradient copy. fp16's
    found-inf check is not deferred."""
    sequence_parallel: bool = False
    """`--sequence-parallel` (t > 1; off at t = 1 as in Megatron-LM): LayerNorms and dropouts
    on 1/t of the sequence, their activations split over t; each all-reduce becomes a
    reduce-scatter and an all-gather of the same volume (Korthikanti et al. 2022, 4.2.2)."""

    correction: str = "none"
    """2BW's --stale-weight-correction: predict and dc keep one more weight version per stage,
    ef one fp32 tensor of the last update (megatron_2bw.corrections; `_correction_bytes`)."""

    flash_attention: bool = False
    """FlashAttention (`--attention-backend flash` or `fused`, or `auto` where
    `Cluster.flash_attention`; `Cluster.attention_is_flash`): the attention core keeps no s x s
    matrix and streams none (ModelSpec.attention_core_kernels), and its backward computes
    QK^T again (one more attention GEMM of the forward's; Dao et al. 2022, Algorithm 4)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got "
                             f"{self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        self.element_bytes = PRECISIONS[self.precision]
        self.cluster.check_precision(self.precision)
        if self.profile is not None and self.profile.intra_node_link is not None:
            self.cluster = self.cluster.with_(intra_node=self.profile.intra_node_link)

    # ---- the split --------------------------------------------------------------------------
    def balanced_split(self, layout: Layout,
                       memory_limit: float | None = None) -> tuple[int, ...] | None:
        """The layers per virtual stage (model order) that even out the ranks' work per
        microbatch, the embedding, the output layer and the loss counted where they sit
        (`rank_parts`), each rank within `memory_limit` bytes; None where that is the even
        split or no split fits.

        A rank's F + B and its memory are affine in its layers (``time`` and ``memory`` at
        no layer and at one per chunk give both lines). The layers go one at a time to the
        rank whose work grows least with it (to its least busy chunk), among the ranks whose
        memory takes one more layer: the least slowest stage there is for identical layers
        (the bottleneck sets 1F1B's steady state, PipeDream-2BW Section 4.3)."""
        d, L = layout.d, self.model.num_layers
        V = layout.placement.chunks
        if d == 1:
            return None
        if layout.schedule == "megatron":  # flush's costs and memory (`_schedule_spec`)
            return self.balanced_split(replace(layout, schedule="flush"), memory_limit)
        key = (layout, memory_limit)
        cache = self.__dict__.setdefault("_balanced", {})
        if key not in cache:
            cache[key] = self._balanced_split(layout, memory_limit)
        return cache[key]

    def _balanced_split(self, layout: Layout,
                        memory_limit: float | None) -> tuple[int, ...] | None:
        d, L = layout.d, self.model.num_layers
        V = layout.placement.chunks
        zero = replace(layout, split=(0,) * (d * V))
        one = replace(layout, split=(1,) * (d * V))
        base, per = self.chunk_work(zero), self.chunk_work(one)
        slope = [[p - b for p, b in zip(ps, bs)] for ps, bs in zip(per, base)]
        room = [L] * d
        if memory_limit is not None:  # each rank's room for layers within the limit
            room = [-1 if empty > memory_limit else
                    int((memory_limit - empty) // grows) if grows > 0 else L
                    for empty, grows in self.memory_lines(layout)]
        split = self._fill(layout, base, slope, room)
        if split is None or (L % (d * V) == 0 and len(set(split)) == 1):
            return None
        return split

    def _fill(self, layout: Layout, base: list, slope: list, room: list[int]
              ) -> tuple[int, ...] | None:
        """`balanced_split`'s assignment: one layer at a time to the rank whose work grows
        least (a heap of the work each rank would reach) among those with `room` for one
        more, then within it to its least busy chunk; None when the layers do not fit."""
        d, L, placement = layout.d, self.model.num_layers, layout.placement
        layer = [min(s) for s in slope]
        heap = [(sum(base[i]) + layer[i], i) for i in range(d) if room[i] > 0]
        heapq.heapify(heap)
        totals = [0] * d
        for _ in range(L):
            if not heap:
                return None
            reached, i = heapq.heappop(heap)
            totals[i] += 1
            if totals[i] < room[i]:
                heapq.heappush(heap, (reached + layer[i], i))
        split = [0] * (d * placement.chunks)
        for i in range(d):
            work = list(base[i])
            for _ in range(totals[i]):
                c = min(range(placement.chunks), key=lambda k: (work[k] + slope[i][k], k))
                work[c] += slope[i][c]
                split[placement.virtual(i, c)] += 1
        return tuple(split)

    def chunk_work(self, layout: Layout) -> list[tuple[float, ...]]:
        """Per rank, each chunk's F + B per microbatch (``time``'s parts), which depend on the
        schedule only through its placement (memoized on the rest)."""
        key = (replace(layout, schedule="", m=0), layout.placement)
        cache = self.__dict__.setdefault("_chunk_works", {})
        if key not in cache:
            estimate = self.time(layout)
            cache[key] = [tuple(f + b for f, b in zip(fs, bs))
                          for fs, bs in zip(estimate.chunk_forward, estimate.chunk_backward)]
        return cache[key]
