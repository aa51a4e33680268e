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

import functools
import heapq
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from megatron_2bw.schedules import PIPELINE_SCHEDULES, V_SCHEDULES, Kind
from megatron_2bw.schedules import SCHEDULES as SCHEDULE_SPECS
from megatron_2bw.schedules import LayerSplit, call_actions, keeps_versions, placement_of
from megatron_2bw.schedules.interleaved import warmup_slots
from megatron_2bw.schedules.requirements import (RECOMPUTE_REFUSED, Batch, recompute_problem,
                                                  too_few_microbatches, v_placement_problem,
                                                  virtual_stage_problem)

from .cluster import Cluster
from .model import ModelSpec

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

GRAD_BYTES = 4
"""megatron-core's DDP keeps `main_grad` in fp32 (`grad_reduce_in_fp32=True` in
training/build.py), in every precision."""

MASTER_BYTES = 4
"""fp32 master copy the mixed-precision optimizer keeps of 16-bit parameters (Micikevicius et
al. 2018); none in fp32, where the parameters are the master."""

MOMENT_BYTES = {"adam": 8, "sgd": 4, "muon": 4}
"""Adam: fp32 exp_avg and exp_avg_sq; SGD: fp32 momentum (megatron's sgd_momentum=0.9); Muon:
fp32 momentum of the hidden matrices, which hold nearly all parameters (the embeddings, norms
and biases it leaves to Adam are counted at 4 bytes too)."""

NS_STEPS = 5
"""Newton-Schulz iterations of Muon (--muon-num-ns-steps' default)."""


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
    pipelines (None: it runs it), the rules of megatron_2bw.arguments._validate_moe and
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
    """A pipeline rank without an MoE layer (megatron_2bw.arguments._validate_moe_placement:
    the expert optimizer's grad-norm all-reduce spans the pipeline)."""
    if not model.is_moe or layout.d == 1:
        return None
    for rank in range(layout.d):
        if not sum(moe_layers_of(model, layout, rank)):
            return (f"pipeline stage {rank} holds no MoE layer (--moe-layer-freq); every stage "
                    f"needs one")
    return None


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


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds; per-stage tuples are per microbatch."""

    forward: tuple[float, ...]
    """F_i: forward of one microbatch on stage i, tensor-parallel all-reduces and the send to
    stage i+1 included."""
    backward: tuple[float, ...]
    """B_i: its backward (with the recomputed forward when recomputing), the gradient's send
    to stage i-1 included."""
    tensor_parallel: tuple[float, ...]
    """Of F_i + B_i, the tensor-parallel all-reduces."""
    p2p: float
    """Latency of one activation or gradient between neighbouring stages (the sending time,
    bytes / bandwidth, is part of the sender's forward and backward)."""
    data_parallel: float
    """Gradient all-reduce over the w replicas (slowest stage), once per iteration."""
    embedding_sync: float
    """All-reduce of the tied word embedding's gradient between first and last stage."""
    optimizer: float
    """Optimizer step of the slowest stage, gradient clipping included."""
    step: float
    """Everything between an iteration's last backward and the next forward that needs the new
    weights: data_parallel + embedding_sync + optimizer + the gradient-norm all-reduce."""
    iteration: float
    """Time per iteration."""
    bubble_fraction: float
    """Idle share of the pipeline part: 1 - m (F* + B*) / (iteration - step), F* + B* the
    slowest stage."""
    global_batch: int
    method: str
    """"closed-form" or "simulated"."""
    expert_parallel: tuple[float, ...] = ()
    """Of F_i + B_i, the experts' all-to-alls (dispatch and combine, forward and backward);
    empty for a dense model."""
    chunk_forward: tuple[tuple[float, ...], ...] = ()
    """Per rank, F of each of its model chunks (its layers, and the embedding or the head
    where the chunk holds them; sums to `forward`)."""
    chunk_backward: tuple[tuple[float, ...], ...] = ()

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.iteration


def _sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


@functools.lru_cache(maxsize=4096)
def _simulate_normalized(schedule: str, d: int, m: int, forward: tuple, backward: tuple,
                         p2p: float, step: float, sync: str) -> float:
    from megatron_2bw.schedules import Costs, pipeline_actions, placement_of, simulate

    placement = placement_of(schedule, d)
    if placement.shape == "v" and not isinstance(forward[0], tuple):  # even chunks: halves
        forward, backward = tuple(f / 2 for f in forward), tuple(b / 2 for b in backward)
    result = simulate(pipeline_actions(schedule, d, m, 3),
                      Costs(forward=forward, backward=backward, p2p=p2p, step=step),
                      step_sync=sync, placement=placement)
    ends = [max(result.batch_ends(i)[k] for i in range(d)) for k in range(2)]
    return ends[1] - ends[0]  # call 1: filled by call 0, not draining: the steady state


def simulated_iteration(schedule: str, d: int, m: int, forward: tuple, backward: tuple,
                        p2p: float, step: float, sync: str) -> float:
    """Time of one steady-state iteration from the schedule simulator
    (`megatron_2bw.schedules.simulate` on the action lists the executor runs), memoized on the
    costs normalised to the slowest forward and rounded to 3 digits: layouts that differ only
    in scale share one simulation."""
    def scaled(costs: tuple) -> tuple:  # per stage, or per stage and chunk
        return tuple(scaled(c) if isinstance(c, tuple) else _sig(c / unit) for c in costs)

    unit = max(max(f) if isinstance(f, tuple) else f for f in forward)
    key = (scaled(forward), scaled(backward), _sig(p2p / unit), _sig(step / unit))
    return unit * _simulate_normalized(schedule, d, m, *key, sync)


@dataclass
class CostModel:
    """MEMORY() and THROUGHPUT() of PipeDream-2BW Section 4.3 for our layouts."""

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

    # ---- memory ---------------------------------------------------------------------------
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
        t, d, b, m = layout.t, layout.d, layout.b, layout.m
        spec = _schedule_spec(layout.schedule)
        mixed = self.precision != "fp32"
        optimizer_bytes = (MASTER_BYTES if mixed else 0) + MOMENT_BYTES[self.optimizer]
        # The distributed optimizer shards over the data-parallel ranks: the w replicas of a
        # stage, the t w / e expert-data-parallel ones for the experts (megatron-core's
        # expert optimizer over its expert data-parallel group).
        dense_shard = layout.w if self.distributed_optimizer else 1
        expert_shard = t * layout.w // layout.e if self.distributed_optimizer else 1
        layer_full = self._activation_bytes("layer", b, t, recompute=False)
        layer_kept = (self._activation_bytes("layer", b, t, recompute=True) if layout.recompute
                      else self._layer_options(layer_full, layout, "bytes"))
        # An MoE layer: the dense layer's bytes scaled by the closed forms' ratio; with
        # recomputation it keeps its input alone, as a dense layer.
        moe_whole = layer_full * self._moe_scale(layout, "bytes", selective=False)
        moe_kept = (layer_kept if layout.recompute
                    else layer_full * self._moe_scale(layout, "bytes"))
        overhead = self.profile.runtime_overhead_bytes if self.profile else 0.0
        embedding = self._activation_bytes("embedding", b, t)
        if self._sequence_parallel(t):
            embedding /= t  # its dropout runs on 1/t of the sequence
        head = self._activation_bytes("head", b, t)
        logits_gradient = model.logits_gradient_bytes(b, t)
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
            # Activations one microbatch leaves in each chunk: each layer's (its input only
            # with recomputation; Section 4.1), plus the embedding's and the head's.
            chunk_bytes = [(layers - n) * layer_kept + n * moe_kept + has_embedding * embedding
                           + has_head * head for layers, n, (has_embedding, has_head)
                           in zip(chunk_layers, moe, parts.chunks)]
            per_microbatch = sum(chunk_bytes)
            # Stashed microbatches: GPipe m, Flush and 2BW d - i (1F1B, Sections 2.2, 3.1),
            # naive 1; as the schedule declares it (schedules.SCHEDULES[...].stash).
            stash = _stash(layout, spec, i)
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
                                          self._weight_grad_bytes(layout, parts, chunk_layers,
                                                                  moe))
            # A recomputed layer (or attention core) exists again during its backward.
            whole_layer = self._layer_options(layer_full, layout, "bytes", selective=False)
            replayed = whole_layer if layout.recompute else whole_layer - layer_kept
            if sum(moe):
                replayed = max(replayed, moe_whole if layout.recompute else moe_whole - moe_kept)
            transient = replayed + last * logits_gradient
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
                transient=transient,
                overhead=overhead,
                gradient_copy=deferred * params * GRAD_BYTES,
                pending_weight_grads=pending,
                expert_parameters=expert_params)

        return stage

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

    def _moe_scale(self, layout: Layout, what: str, selective: bool | None = None) -> float:
        """An MoE layer's activation bytes (`what="bytes"`) or forward seconds ("time") over a
        plain dense layer's (no sequence parallelism, no selective recomputation), by the
        closed forms: a dense layer's profiled numbers carry over to the MoE layers."""
        if not self.model.is_moe:
            return 1.0
        model, b, t, e = self.model, layout.b, layout.t, self.element_bytes
        selective = layout.selective if selective is None else selective
        if what == "bytes":
            return (model.moe_layer_activation_bytes(b, t, e, selective_recompute=selective,
                                                     flash_attention=self.flash_attention)
                    / model.layer_activation_bytes(b, t, e))
        return (self.kernel_time("moe_layer", b, t, flash_attention=self.flash_attention,
                                 e=layout.e) / self.kernel_time("layer", b, t))

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

    def _predict_summed(self, schedule: str, w: int) -> bool:
        """Whether predict's R is made on each replica's shards and summed over them (an
        all-reduce of the stage's weights a step): with a sharded optimizer."""
        return (schedule == "2bw" and self.correction == "predict" and w > 1
                and self.distributed_optimizer)

    def _deferred(self, schedule: str, d: int) -> bool:
        """Whether 2BW's (and PipeDream's) step is deferred (it is whenever it would span the
        pipeline)."""
        return (keeps_versions(schedule) and d > 1 and self.deferred_step
                and self.precision != "fp16")

    # ---- time -----------------------------------------------------------------------------
    def time(self, layout: Layout, simulate: bool = False) -> TimeEstimate:
        """Seconds per iteration (PipeDream-2BW Section 4.3, THROUGHPUT, with the pipeline
        part from the schedule: closed forms, or the simulator when `simulate`).

        One structure for every layout: each stage's compute (GEMMs at their shape's sustained
        rate, element-wise kernels at the memory bandwidth), its tensor-parallel all-reduces
        and its sends; the schedule's bubble over those; then the step (data-parallel
        all-reduce, tied-embedding all-reduce, optimizer). No global efficiency factor."""
        model, cluster, e = self.model, self.cluster, self.element_bytes
        t, d, w, b, m, v = layout.t, layout.d, layout.w, layout.b, layout.m, layout.v
        rc = layout.recompute
        split, placement = layout.layers(model.num_layers), layout.placement

        # Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, Section 3 and Figure 3): each
        # layer all-reduces its (s, b, h) output twice in the forward (after attention and
        # after the MLP) and its input gradient twice in the backward; recomputation replays
        # the forward's two. Ring all-reduce over the t ranks: NVLink inside a node, the
        # members' NICs across nodes (Cluster.group_link).
        tp_link = cluster.group_link(t, stride=1)
        tp_ar = tp_link.all_reduce(model.boundary_bytes(b, e), t)
        tp_small = tp_link.all_reduce(4 * b * model.seq_length, t)  # cross-entropy max/sum
        # Pipeline: stage i+1's ranks sit t w ranks after stage i's. A stage sends its output
        # after each forward and its input gradient after each backward, once per model chunk
        # (V chunks per rank under interleaving); the send occupies it for n / beta
        # (PipeDream-2BW Section 4.3 counts the stage's communication in its time), the latency
        # alpha delays the receiver. With t > 1 each rank sends its 1/t slice (Megatron's
        # scatter/gather, SC'21 Section 4.1) when the next stage is in another node.
        pp_link = cluster.p2p_link(d, stride=t * w)
        scatter = t if pp_link is not cluster.intra_node else 1
        send = model.boundary_bytes(b, e) / scatter / pp_link.bandwidth if d > 1 else 0.0
        p2p = pp_link.latency if d > 1 else 0.0

        lf, lb = self._compute("layer", b, t, rc)
        # An MoE layer: the dense layer's times scaled by the closed forms' ratio (its router,
        # k experts per token, permutation; moe_layer_gemms), the attention's additions alike.
        mf, mb = lf * self._moe_scale(layout, "time"), lb * self._moe_scale(layout, "time")
        lf, lb = self._layer_options(lf, layout, "time"), self._layer_options(lb, layout, "time")
        attention_extra = self._replayed_core(lf, layout) + self._flash_scores(lf, layout)
        lb, mb = lb + attention_extra, mb + attention_extra
        ef, eb = self._compute("embedding", b, t, False)
        hf, hb = self._compute("head", b, t, False)
        # Expert parallelism (megatron-core's alltoall dispatcher): each MoE layer sends its
        # rank's k bs/t token copies to their experts' ranks and the results back, dispatch and
        # combine, in the forward and again (their gradients) in the backward, and once more
        # forward when recomputing; not overlapped with compute (megatron-core overlaps them
        # only with --overlap-moe-expert-parallel-comm). The e ranks are consecutive
        # (Cluster.all_to_all: NVLink inside a node, the NICs across).
        a2a = cluster.all_to_all(model.dispatch_bytes(b, t, e), layout.e, stride=1) \
            if model.is_moe else 0.0
        shared = bool(model.shared_ffn)
        # Per model chunk (virtual stage): its layers (`layout.layers`), the embedding on the
        # first virtual stage, the head on the last, a send where the next (previous) virtual
        # stage is on another rank; a rank's F_i and B_i are its chunks' sums.
        chunk_forward, chunk_backward, tp_time, ep_time = [], [], [], []
        ranks = [rank_parts(layout, i) for i in range(d)]
        rank_layers, moe_counts = [], []
        for i, chunks in enumerate(_chunk_parts(layout.schedule, d, layout.v)):
            fs, bs, tps, eps = [], [], 0.0, 0.0
            counts, moes = split.of_rank(placement, i), moe_layers_of(model, layout, i)
            rank_layers.append(sum(counts))
            moe_counts.append(sum(moes))
            for layers, moe, (first, last, ahead, behind) in zip(counts, moes, chunks):
                # A dense layer all-reduces twice per pass; an MoE layer once (the attention's;
                # its experts hold whole weights) and once more for a shared expert.
                collectives = 2 * (layers - moe) + (1 + shared) * moe
                tp_f = collectives * tp_ar + first * tp_ar + last * 3 * tp_small
                tp_b = collectives * (1 + rc) * tp_ar + last * tp_ar
                ep_f, ep_b = moe * 2 * a2a, moe * (2 + 2 * rc) * a2a
                fs.append((layers - moe) * lf + moe * mf + first * ef + last * hf + tp_f
                          + ep_f + ahead * send)
                bs.append((layers - moe) * lb + moe * mb + first * eb + last * hb + tp_b
                          + ep_b + behind * send)
                tps, eps = tps + tp_f + tp_b, eps + ep_f + ep_b
            chunk_forward.append(tuple(fs))
            chunk_backward.append(tuple(bs))
            tp_time.append(tps)
            ep_time.append(eps)
        forward = [sum(fs) for fs in chunk_forward]
        backward = [sum(bs) for bs in chunk_backward]

        # Step: data-parallel ring all-reduce of each stage's fp32 gradients over its w
        # replicas, t apart (PipeDream-2BW Section 4.3: all_reduce(|W|/d) over w workers; not
        # overlapped with the backward: megatron-core's DDP default overlap_grad_reduce=False);
        # the experts' over their t w / e expert-data-parallel replicas, e apart
        # (megatron-core's expert DDP buffer); the tied embedding's gradient between first and
        # last stage; the optimizer.
        dp_link = cluster.group_link(w, stride=t)
        stage_params = [model.rank_parameters(t, n, embedding=p.embedding, head=p.head,
                                              moe_layers=moe, e=layout.e)
                        for n, p, moe in zip(rank_layers, ranks, moe_counts)]
        expert_params = [moe * model.moe_layer_parameters(t, layout.e)[1] if moe else 0
                         for moe in moe_counts]
        expert_dp = t * w // layout.e
        edp_link = cluster.group_link(expert_dp, stride=layout.e)
        data_parallel = max(dp_link.all_reduce((p - x) * GRAD_BYTES, w)
                            + (edp_link.all_reduce(x * GRAD_BYTES, expert_dp) if x else 0.0)
                            for p, x in zip(stage_params, expert_params))
        embedding_sync = 0.0
        if model.tied and not ranks[0].head:  # the output layer's copy is on another rank
            embedding = model.padded_vocab(t) // t * model.hidden_size
            embedding_sync = cluster.group_link(2, stride=t * w * (d - 1)).all_reduce(
                embedding * GRAD_BYTES, 2)
        # The experts have an optimizer of their own (megatron-core's chain of two).
        optimizer = max(self._optimizer_step(p - x, w)
                        + (self._optimizer_step(x, expert_dp) if x else 0.0)
                        for p, x in zip(stage_params, expert_params)) \
            + max(self._orthogonalization(n, t) for n in rank_layers) / self._muon_shards(w)
        if self._muon_shards(w) > 1:  # dist_muon all-gathers the updated parameters
            optimizer += max(dp_link.all_reduce(p * e, w) for p in stage_params) / 2
        if self._predict_summed(layout.schedule, w):
            optimizer += max(dp_link.all_reduce(p * e, w) for p in stage_params)
        pp_group = cluster.group_link(d, stride=t * w)
        # Muon's chain of two optimizers takes the norm also without clipping
        takes_norm = self.clip_grad or self.optimizer == "muon"
        norm = (tp_link.all_reduce(4, t) + pp_group.all_reduce(4, d)) if takes_norm else 0.0
        step = data_parallel + embedding_sync + optimizer + norm
        # The grad norm and fp16's found-inf span all stages; the tied embedding's all-reduce
        # makes the last stage wait for the first, and the stages between follow the last.
        pipeline_wide = self.precision == "fp16" or (
            (takes_norm or model.tied) and not self._deferred(layout.schedule, d))
        sync = "pipeline" if pipeline_wide and d > 1 else "local"

        work = [f + bw for f, bw in zip(forward, backward)]
        bottleneck = max(work)
        schedule = "flush" if layout.schedule == "megatron" and v == 1 else layout.schedule
        if simulate and d > 1 and v == 1:
            by_chunk = placement.shape == "v"  # the V's two chunks timed each on its own
            iteration = simulated_iteration(
                schedule, d, m, tuple(chunk_forward) if by_chunk else tuple(forward),
                tuple(chunk_backward) if by_chunk else tuple(backward), p2p, step, sync)
            method = "simulated"
        else:
            iteration = self._closed_form(schedule, d, m, forward, backward, p2p, step, sync,
                                          v=v)
            method = "closed-form"
        pipeline = iteration - step
        bubble = 1 - m * bottleneck / pipeline if pipeline > 0 else 0.0
        return TimeEstimate(
            forward=tuple(forward), backward=tuple(backward), tensor_parallel=tuple(tp_time),
            chunk_forward=tuple(chunk_forward), chunk_backward=tuple(chunk_backward),
            expert_parallel=tuple(ep_time) if model.is_moe else (),
            p2p=p2p, data_parallel=data_parallel, embedding_sync=embedding_sync,
            optimizer=optimizer, step=step, iteration=iteration,
            bubble_fraction=max(bubble, 0.0), global_batch=layout.global_batch, method=method)

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

    @staticmethod
    def _closed_form(schedule: str, d: int, m: int, forward: list, backward: list, p2p: float,
                     step: float, sync: str, v: int = 1) -> float:
        """One iteration of m microbatches over d stages, the slowest doing F* + B*."""
        work = [f + b for f, b in zip(forward, backward)]
        bottleneck = max(work)
        if d == 1:
            return m * work[0] + step
        if schedule == "gpipe" or (schedule == "flush" and v == 1):
            # Fill and drain every iteration: the first microbatch crosses all stages, the
            # other m - 1 follow at the bottleneck's pace; uniform stages give (m + d - 1)(F+B),
            # the bubble (d - 1)/(m + d - 1) (GPipe; PipeDream-2BW Section 2.2 and 3.2).
            return (m - 1) * bottleneck + sum(work) + 2 * (d - 1) * p2p + step
        if schedule in ("megatron", "flush"):
            # Interleaved 1F1B, V chunks per rank (megatron-core's, or ours under flush): the
            # fill and drain cross d chunks of 1/V of a stage each, the bubble (d - 1)/V of a
            # microbatch's F + B (SC'21 Section 2.2.2: bubble fraction (d - 1)/(V m)); V = 1 is
            # the flush above. 2BW-interleaved runs the same order without the flush: the
            # versions branch below, for any V.
            return (m * bottleneck + (sum(work) - bottleneck) / v
                    + 2 * (d - 1) * p2p + step)
        if schedule == "zb-h1":
            # Flush's fill and drain less two weight gradients per stage off the bottleneck:
            # uniform stages give m (F + B) + (d - 1)(F + I - W) with B = I + W (Section 2.1,
            # while W <= min(F, I)); W is half the backward (the simulator's default split), so
            # each other stage adds F + I - W = its forward.
            slowest = work.index(bottleneck)
            fill = sum(f for i, f in enumerate(forward) if i != slowest)
            return m * bottleneck + fill + 2 * (d - 1) * p2p + step
        if schedule in V_SCHEDULES:
            # Two chunks of half a stage each, the V's bubble: ZB-V idles (d - 1) T_F of a
            # chunk per rank (Qi et al., Section 6), DualPipeV (d - 1)(F&B + B - 3W) of a chunk
            # (DeepSeek-V3, Table 2), the same F/2 where W is half the backward; the slowest
            # stage's F as the bound (tests/test_vshape.py derives both).
            return m * bottleneck + (d - 1) * max(forward) / 2 + 2 * (d - 1) * p2p + step
        if keeps_versions(schedule):
            # Steady state: no flush, no bubble (Section 3.1): m (F* + B*). A pipeline-wide step
            # (global gradient norm) waits for stage 0's last backward: after the last stage's,
            # the backward wave runs through stages d - 2, ..., 0.
            lag = sum(backward[:-1]) + (d - 1) * p2p if sync == "pipeline" else 0.0
            return m * bottleneck + lag + step
        if schedule == "naive":
            # One stage busy at a time: every microbatch crosses all stages (d-fold).
            return m * (sum(work) + 2 * (d - 1) * p2p) + step
        raise ValueError(f"unknown schedule {schedule!r}")

    # ---- parts ----------------------------------------------------------------------------
    def _sequence_parallel(self, t: int) -> bool:
        """--sequence-parallel at t > 1; always for an MoE model (megatron-core's MoE layer
        refuses tensor parallelism without it)."""
        return (self.sequence_parallel or self.model.is_moe) and t > 1

    def _layer_options(self, plain: float, layout: Layout, what: str,
                       selective: bool | None = None) -> float:
        """A layer's activation bytes (`what="bytes"`) or its forward or backward seconds
        ("time") without full recomputation, scaled from `plain` (no sequence parallelism, no
        selective recomputation: the profile's or the closed form's) by the closed forms'
        ratio, so that a profile taken without them carries over."""
        b, t, e = layout.b, layout.t, self.element_bytes
        sp = self._sequence_parallel(t)
        selective = layout.selective if selective is None else selective
        flash = self.flash_attention
        if what == "bytes":
            ratio = (self.model.layer_activation_bytes(b, t, e, sequence_parallel=sp,
                                                       selective_recompute=selective,
                                                       flash_attention=flash)
                     / self.model.layer_activation_bytes(b, t, e))
        else:
            ratio = (self.kernel_time("layer", b, t, sequence_parallel=sp, flash_attention=flash)
                     / self.kernel_time("layer", b, t))
        return plain * ratio

    def _replayed_core(self, layer_forward: float, layout: Layout) -> float:
        """Seconds selective recomputation adds to a layer's backward: the attention core's
        forward, its share of the layer's forward by the closed forms."""
        if not layout.selective:
            return 0.0
        b, t = layout.b, layout.t
        gemms, streamed = self.model.attention_core_kernels(
            b, t, self.element_bytes, flash_attention=self.flash_attention)
        return self._share_of_layer(layer_forward, layout, gemms, streamed)

    def _flash_scores(self, layer_forward: float, layout: Layout) -> float:
        """Seconds FlashAttention's backward adds: QK^T once more (the attention core's first
        GEMM), its share of the layer's forward by the closed forms."""
        if not self.flash_attention:
            return 0.0
        scores = self.model.attention_core_kernels(layout.b, layout.t, self.element_bytes,
                                                   flash_attention=True)[0][:1]
        return self._share_of_layer(layer_forward, layout, scores, 0.0)

    def _share_of_layer(self, layer_forward: float, layout: Layout, gemms: list,
                        streamed: float) -> float:
        """`layer_forward` x (these kernels' time / the layer forward's), by the closed forms."""
        b, t = layout.b, layout.t
        rate = self.cluster.gemm_flops
        part = (sum(flops / rate(self.precision, n) for flops, n in gemms)
                + streamed / self.cluster.stream_bandwidth)
        whole = self.kernel_time("layer", b, t, sequence_parallel=self._sequence_parallel(t),
                                 flash_attention=self.flash_attention)
        return layer_forward * part / whole

    def _compute(self, part: str, b: int, t: int, recompute: bool) -> tuple[float, float]:
        """(forward, backward) seconds of one part on one of t ranks, no communication: the
        profile's when there is one, else `kernel_time`."""
        measured = self._from_profile(part, b, t, recompute)
        if measured is not None:
            return measured[0], measured[1]
        forward = self.kernel_time(part, b, t)
        # Backward = 2 x forward (input and weight gradients: two GEMMs of the forward's shape
        # per GEMM, twice the element-wise traffic); recomputation adds a forward: 4/3 of the
        # work in all (PipeDream-2BW Section 4.1; Megatron-LM SC'21 Eq. 3, 4 passes).
        backward = 2 * forward + (forward if recompute else 0.0)
        return forward, backward

    def kernel_time(self, part: str, b: int, t: int, sequence_parallel: bool = False,
                    flash_attention: bool = False, e: int = 1) -> float:
        """Forward seconds of a part on one of t ranks (e expert-parallel ranks for
        "moe_layer") from its kernels: each GEMM's FLOPs at the rate of its shape
        (Cluster.gemm_flops), plus element-wise bytes at the sustained memory bandwidth."""
        gemms, streamed = kernels(self.model, part, b, t, self.element_bytes,
                                  sequence_parallel=sequence_parallel,
                                  flash_attention=flash_attention, experts=e)
        rate = self.cluster.gemm_flops
        return (sum(flops / rate(self.precision, n) for flops, n in gemms)
                + streamed / self.cluster.stream_bandwidth)

    def _activation_bytes(self, part: str, b: int, t: int, recompute: bool = False) -> float:
        measured = self._from_profile(part, b, t, recompute)
        if measured is not None:
            return measured[2]
        return _closed_form_bytes(self.model, part, b, t, recompute, self.element_bytes)

    def _from_profile(self, part: str, b: int, t: int, recompute: bool):
        """(forward s, backward s, activation bytes) from the profile, scaled from the profiled
        sizes and tensor-parallel size to this model's by FLOPs and closed-form bytes."""
        if self.profile is None:
            return None
        sample = self.profile.lookup(part, t, b, recompute)
        if sample is None:
            return None
        pm, e = self.profile.model, self.element_bytes
        time_ratio = (_part_work(self.model, part, b, t, e)
                      / _part_work(pm, part, b, sample.tp, e))
        bytes_ratio = (_closed_form_bytes(self.model, part, b, t, recompute, e)
                       / max(_closed_form_bytes(pm, part, b, sample.tp, recompute, e), 1.0))
        time_ratio *= self.profile.compute_scale
        return (sample.forward_s * time_ratio, sample.backward_s * time_ratio,
                sample.activation_bytes * bytes_ratio)

    def _orthogonalization(self, layers: int, t: int) -> float:
        """Seconds of Muon's Newton-Schulz iterations on a stage's ``layers`` layers, each
        tensor-parallel rank its own blocks (`_ns_flops`): the profile's measured time scaled
        by FLOPs where it has one, else at the GEMM rate of each block's smaller side (bf16
        products, as the default runs them)."""
        if self.optimizer != "muon":
            return 0.0
        profile = self.profile
        if profile is not None and profile.orthogonalize_layer_s > 0:  # measured, by FLOPs
            scale = _ns_flops(self.model, t) / _ns_flops(profile.model, 1)
            return layers * profile.orthogonalize_layer_s * scale * profile.compute_scale
        precision = "bf16" if "bf16" in self.cluster.peak_flops else "fp32"
        seconds = 0.0
        for rows, cols in self.model.layer_matrices(t):
            m = min(rows, cols)
            seconds += _ns_flops(self.model, t, [(rows, cols)]) / self.cluster.gemm_flops(
                precision, m)
        return layers * seconds

    def _muon_shards(self, w: int) -> int:
        """Ranks a stage's Newton-Schulz work is dealt over: its w replicas under dist_muon
        (each orthogonalizes the parameters it steps), else 1."""
        return w if self.optimizer == "muon" and self.distributed_optimizer else 1

    def _optimizer_step(self, params: int, w: int) -> float:
        """Seconds of the optimizer step on `params` parameters."""
        shard = params / w if self.distributed_optimizer else params
        if self.profile is not None and self.profile.optimizer_per_param_s > 0:
            return self.profile.optimizer_step_s(shard) * self.profile.compute_scale
        # Memory-bound: Adam reads and writes fp32 master and both moments (24 bytes), reads
        # the fp32 gradient (4) and writes the parameter (e); SGD one moment instead of two.
        moments = MOMENT_BYTES[self.optimizer]
        touched = 2 * (MASTER_BYTES + moments) + GRAD_BYTES + self.element_bytes
        return shard * touched / self.cluster.stream_bandwidth


def _ns_flops(model: ModelSpec, t: int, matrices: list | None = None) -> float:
    """Newton-Schulz FLOPs on one layer's matrices (or `matrices`) on one of t ranks: per
    m x n block (m <= n) NS_STEPS x (4 m^2 n + 2 m^3)."""
    total = 0.0
    for rows, cols in matrices or model.layer_matrices(t):
        m, n = sorted((rows, cols))
        total += NS_STEPS * (4 * m * m * n + 2 * m ** 3)
    return total


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


def _closed_form_bytes(model: ModelSpec, part: str, b: int, t: int, recompute: bool,
                       e: int) -> float:
    if part == "layer":
        return (model.layer_input_bytes(b, e) if recompute
                else model.layer_activation_bytes(b, t, e))
    if part == "embedding":
        return model.embedding_activation_bytes(b, t, e)
    return model.head_activation_bytes(b, t, e)


def kernels(model: ModelSpec, part: str, b: int, t: int, e: int,
            sequence_parallel: bool = False,
            flash_attention: bool = False, experts: int = 1
            ) -> tuple[list[tuple[float, int]], float]:
    """(GEMMs as (FLOPs, smallest dimension), streamed bytes) of one part's forward on one of t
    ranks ("moe_layer": of `experts` expert-parallel ranks)."""
    if part == "moe_layer":
        return model.moe_layer_gemms(b, t, experts), model.moe_layer_streamed_bytes(
            b, t, e, flash_attention=flash_attention)
    if part == "layer":
        return model.layer_gemms(b, t), model.layer_streamed_bytes(
            b, t, e, sequence_parallel=sequence_parallel, flash_attention=flash_attention)
    if part == "head":
        return model.head_gemms(b, t), model.head_streamed_bytes(b, t, e)
    return [], model.embedding_streamed_bytes(b, e)


def _part_work(model: ModelSpec, part: str, b: int, t: int, e: int) -> float:
    """What a part's time scales with: FLOPs on one of t ranks (bytes moved for the
    embedding)."""
    if part == "layer":
        return model.layer_forward_flops(b) / t
    if part == "head":
        return model.head_forward_flops(b, t)
    return model.boundary_bytes(b, e)
