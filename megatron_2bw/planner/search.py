"""The search: PipeDream-2BW's Algorithm 1 (Section 4.2) extended with the tensor-parallel size
and the schedule. Every layout of the N devices is enumerated, the infeasible ones are kept
with the reason, the feasible ones ranked by predicted samples/s.

    request = PlanRequest(model, cluster, global_batch_size=1536, precision="bf16")
    plan = search(request)
    plan.best.layout, plan.best.samples_per_s, plan.rejected[0].reason

Feasible: t d w = N; t divides the heads; d divides the layers; B = b w m for a microbatch
size b from the list; what the training accepts (Layout.problem: 2BW needs m >= d,
Section 3.1; zb-h1 runs without recomputation; V > 1 only under megatron); the fullest device
within memory. A Mixture-of-Experts model adds the expert-parallel size e, a divisor of a
stage's t w ranks and of the experts (cost.expert_problem), with an MoE layer on every stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial

from megatron_2bw.schedules import SCHEDULES as SCHEDULE_SPECS
from megatron_2bw.schedules import VIRTUAL_STAGE_SCHEDULES, keeps_versions

from .cluster import GiB, Cluster
from .cost import (ALL_SCHEDULES, CostModel, Layout, MemoryEstimate, TimeEstimate,
                   expert_problem, moe_placement_problem)
from .model import ModelSpec

__all__ = ["PlanRequest", "Candidate", "Rejection", "Plan", "search", "ALL_SCHEDULES",
           "ITERATION_FACTOR", "ITERATION_FACTORS", "BF16_ITERATION_FACTORS", "iteration_factor"]

ITERATION_FACTORS = {
    ("2bw", "adam", "none"): 3.44,
    ("2bw", "adam", "predict"): 2.0,
    ("2bw", "adam", "dc"): 3.11,
    ("2bw", "adam", "ef"): 1.49,
    ("2bw", "muon", "none"): 1.23,
    ("2bw", "muon", "predict"): 1.06,
    ("2bw", "muon", "dc"): 1.28,
    ("2bw", "muon", "ef"): 1.02,
    ("pipedream", "adam", "none"): 1.38,
    ("pipedream", "muon", "none"): 1.03,
    ("pipemare", "adam", "none"): 1.38,
    ("pipemare", "muon", "none"): 1.03,
}
"""(schedule, optimizer, --stale-weight-correction) -> iterations the stale-weight schedule runs
per iteration of flush with the same optimizer to reach the same validation loss: 1 / the ratio
at the end of docs/convergence.md's larger model at lr 1e-3, the learning rate that trains
every run there best (PipeMare: PipeDream's, whose ratio it matched on the small model). The
ranking divides samples/s by it; SGD takes Adam's."""

BF16_ITERATION_FACTORS = {
    ("2bw", "adam", "ef"): 1.47,
    ("2bw", "muon", "none"): 1.22,
    ("2bw", "muon", "ef"): 1.03,
}
"""The same, from docs/convergence/bf16/large-lr1e-3 (--bf16) for the runs measured there; the
others take the fp32 factor (where both exist they agree within 0.02)."""

ITERATION_FACTOR = ITERATION_FACTORS[("2bw", "adam", "none")]
"""2BW's with Adam and no correction, the paper's update."""


def iteration_factor(schedule: str, optimizer: str = "adam", correction: str = "none",
                     precision: str = "fp32") -> float:
    """docs/convergence.md's iteration factor of a stale-weight schedule (``ITERATION_FACTORS``,
    ``BF16_ITERATION_FACTORS`` under bf16 and fp16 where measured; pipedream and pipemare have
    no correction)."""
    optimizer = optimizer if optimizer == "muon" else "adam"
    key = (schedule, optimizer, correction if schedule == "2bw" else "none")
    if precision != "fp32" and key in BF16_ITERATION_FACTORS:
        return BF16_ITERATION_FACTORS[key]
    return ITERATION_FACTORS[key]

# At depth 1 every schedule is the same computation; the first allowed one of these stands for
# them (those with two weight versions last: at d = 1 they only add a stale version).
_DEPTH_ONE_ORDER = ("megatron", "flush", "gpipe", "naive", "zb-h1", "2bw", "pipedream")


@dataclass(frozen=True)
class PlanRequest:
    model: ModelSpec
    cluster: Cluster
    global_batch_size: int
    """B: the largest global batch that still trains well; every layout uses exactly B."""
    precision: str = "bf16"
    schedules: tuple[str, ...] = ALL_SCHEDULES
    """Allowed schedules; leave out "2bw" and "pipedream" when stale weights are not
    acceptable."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    recompute: tuple[bool, ...] = (False, True)
    """Full recomputation off and on."""
    selective_recompute: bool = False
    """Also try selective recomputation (`--recompute-granularity selective`) where full is
    off."""
    sequence_parallel: bool = False
    """`--sequence-parallel` for every layout with t > 1 (CUDA only in the training)."""
    memory_fraction: float = 0.9
    """Share of device memory the plan may fill (the rest: CUDA context, fragmentation)."""
    optimizer: str = "adam"
    correction: str = "none"
    """2bw's --stale-weight-correction (its memory and its iteration factor)."""
    distributed_optimizer: bool = False
    clip_grad: bool = True
    deferred_step: bool = True
    """2BW defers its step when clipping or tied embeddings would make it pipeline-wide."""
    max_tensor_parallel: int | None = None
    expert_parallel: tuple[int, ...] | None = None
    """Expert-parallel sizes e to try (`--expert-model-parallel-size`); None: every e the
    model and the layout allow (1 for a dense model)."""
    virtual_stages: tuple[int, ...] = (1,)
    """V values tried under the schedules that interleave (VIRTUAL_STAGE_SCHEDULES)."""
    simulate_top: int = 5
    """Re-time the best this many with the schedule simulator (0: closed forms only) ..."""
    simulate_max_actions: int = 4_000
    """... when their action lists (d stages x 3 calls x (2m + 1)) are at most this long."""
    iteration_factor: float | None = None
    """Stale-weight schedules are ranked at samples/s / this (their convergence cost); None:
    each its own from ``ITERATION_FACTORS`` for the optimizer and correction."""
    uneven: bool = True
    """Also try each layout with the layers split to even out the stages' work
    (`CostModel.balanced_split`: the embedding, the output layer and the loss where they
    sit), written as Megatron-LM's layout flags; with it d need not divide the layers."""

    def __post_init__(self) -> None:
        unknown = set(self.schedules) - set(ALL_SCHEDULES)
        if unknown or not self.schedules:
            raise ValueError(f"schedules must be a non-empty subset of {ALL_SCHEDULES}, got "
                             f"{self.schedules}")
        if self.global_batch_size < 1:
            raise ValueError(f"global batch size must be >= 1, got {self.global_batch_size}")
        if not self.virtual_stages or min(self.virtual_stages) < 1:
            raise ValueError(f"virtual stages must be >= 1, got {self.virtual_stages}")
        if self.iteration_factor is not None and not self.iteration_factor > 0:
            raise ValueError(f"iteration factor must be > 0, got {self.iteration_factor}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory fraction must lie in (0, 1], got {self.memory_fraction}")
        if self.expert_parallel is not None:
            if not self.expert_parallel or min(self.expert_parallel) < 1:
                raise ValueError(f"expert-parallel sizes must be >= 1, got "
                                 f"{self.expert_parallel}")
            if not self.model.is_moe and set(self.expert_parallel) != {1}:
                raise ValueError(f"expert-parallel size {max(self.expert_parallel)} needs a "
                                 f"Mixture-of-Experts model (--num-experts)")

    def factor_of(self, schedule: str) -> float:
        """The iteration factor ``schedule`` is ranked with (1 for the exact schedules)."""
        if not _staleness(schedule):
            return 1.0
        if self.iteration_factor is not None:
            return self.iteration_factor
        return iteration_factor(schedule, self.optimizer, self.correction, self.precision)

    @property
    def memory_limit(self) -> float:
        return self.cluster.memory_bytes * self.memory_fraction


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate

    @property
    def samples_per_s(self) -> float:
        return self.time.samples_per_s


@dataclass(frozen=True)
class Rejection:
    """A layout that cannot run, or a family of layouts refused before their last fields are
    chosen, and why."""

    reason: str
    layout: Layout | None = None
    """The refused layout; None for a family (`family`)."""
    family: tuple[int, ...] = ()
    """A family's leading fields of FIELDS, the same for all its layouts: (t,), (t, d, w) or
    (t, d, w, b); empty with a layout."""
    memory_bytes: float | None = None
    """Peak memory of a layout refused for memory."""

    expert: int | None = None
    """A family's expert-parallel size e, where the family fixes it."""

    FIELDS = ("t", "d", "w", "b", "m", "recompute", "schedule", "e")
    """The layout's fields a rejection names (rejected.csv, `plan.py --explain`)."""

    def value(self, name: str):
        """The layout's field `name` (one of FIELDS); None where the family leaves it open."""
        if self.layout is not None:
            return getattr(self.layout, name)
        if name == "e":
            return self.expert
        i = self.FIELDS.index(name)
        return self.family[i] if i < len(self.family) else None

    def values(self) -> tuple:
        """`value` of each of FIELDS."""
        return tuple(self.value(name) for name in self.FIELDS)


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    ranked: tuple[Candidate, ...]
    """Feasible layouts, fastest first."""
    rejected: tuple[Rejection, ...]
    considered: int
    """Layouts (t, d, w, b, recompute, schedule) looked at, feasible or not."""
    seconds: float
    """Wall time of the search."""

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _schedules_at(depth: int, request: PlanRequest) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs to try at this depth."""
    allowed = request.schedules
    if depth == 1:
        return [(next(s for s in _DEPTH_ONE_ORDER if s in allowed), 1)]
    pairs = []
    for schedule in ALL_SCHEDULES:
        if schedule in allowed:
            vs = request.virtual_stages if schedule in VIRTUAL_STAGE_SCHEDULES else (1,)
            pairs += [(schedule, v) for v in vs]
    return pairs


def _recomputations(request: PlanRequest) -> list[tuple[bool, bool]]:
    """(full, selective) recomputation pairs to try."""
    pairs = [(rc, False) for rc in request.recompute]
    if request.selective_recompute and False in request.recompute:
        pairs.append((False, True))
    return pairs


def _staleness(schedule: str) -> int:
    """0: exact updates; 1: stale weights, each microbatch's forward and backward at the same
    version (2bw, pipedream); 2: a backward at newer weights than its forward (pipemare)."""
    if not keeps_versions(schedule):
        return 0
    return 1 if getattr(SCHEDULE_SPECS[schedule], "backward_version_of", None) is None else 2


def _rank_key(c: Candidate, request: PlanRequest) -> tuple:
    """Fastest to a given loss first: samples/s, divided by the request's iteration factor of
    a stale schedule; on a tie the least stale schedule (`_staleness`), then the smaller
    memory."""
    rate = c.samples_per_s / request.factor_of(c.layout.schedule)
    return (-round(rate, 9), _staleness(c.layout.schedule), c.memory.peak)


def search(request: PlanRequest, cost: CostModel | None = None) -> Plan:
    """Enumerate, filter and rank every layout of the request's cluster."""
    started = time.perf_counter()
    model, cluster = request.model, request.cluster
    cost = cost or CostModel(model, cluster, request.precision, optimizer=request.optimizer,
                             correction=request.correction,
                             distributed_optimizer=request.distributed_optimizer,
                             clip_grad=request.clip_grad, deferred_step=request.deferred_step,
                             sequence_parallel=request.sequence_parallel)
    n, B = cluster.num_gpus, request.global_batch_size
    feasible: list[Candidate] = []
    rejected: list[Rejection] = []
    to_split: list[Layout] = []
    considered = 0
    for t in _divisors(n):
        if model.num_attention_heads % t:
            rejected.append(Rejection(f"{model.num_attention_heads} attention heads are not "
                                      f"divisible by t={t}", family=(t,)))
            continue
        if request.max_tensor_parallel and t > request.max_tensor_parallel:
            rejected.append(Rejection(f"t={t} exceeds --max-tensor-parallel "
                                      f"{request.max_tensor_parallel}", family=(t,)))
            continue
        for d in _divisors(n // t):
            w = n // (t * d)
            if model.num_layers % d and not (request.uneven and d <= model.num_layers):
                rejected.append(Rejection(f"{model.num_layers} layers do not split into d={d} "
                                          f"equal stages", family=(t, d, w)))
                continue
            for e in _expert_sizes(t, w, request):
                problem = expert_problem(model, t, w, e, cluster.device)
                if problem:
                    rejected.append(Rejection(problem, family=(t, d, w), expert=e))
                    continue
                for b in request.micro_batch_sizes:
                    if B % (b * w):
                        rejected.append(Rejection(f"B={B} is not a multiple of b x w = {b} x "
                                                  f"{w}", family=(t, d, w, b), expert=e))
                        continue
                    m = B // (b * w)
                    for rc, selective in _recomputations(request):
                        for schedule, v in _schedules_at(d, request):
                            considered += 1
                            layout = Layout(t, d, w, b, m, rc, schedule, v, selective, e)
                            candidate = _candidate(layout, request, cost)
                            if isinstance(candidate, Rejection):
                                rejected.append(candidate)
                            else:
                                feasible.append(candidate)
                            if _splits(layout, request):
                                to_split.append(layout)
    feasible.sort(key=partial(_rank_key, request=request))
    if to_split:
        _add_splits(to_split, feasible, rejected, request, cost)
        feasible.sort(key=partial(_rank_key, request=request))
    feasible = _refine(feasible, request, cost)
    return Plan(request, tuple(feasible), tuple(rejected), considered,
                time.perf_counter() - started)


UNEVEN_BAR = 10
"""A layout gets a balanced split only where perfect balance could bring it among this many
of the fastest (`_add_splits`)."""


def _splits(layout: Layout, request: PlanRequest) -> bool:
    """Whether `layout` may get a balanced split: the request tries them, the model is dense
    (the balance assumes identical layers; an MoE model keeps the even split), it has stages,
    and the training refuses it for nothing but its layers' count (checked with one that
    splits evenly)."""
    return (request.uneven and layout.d > 1 and not request.model.is_moe
            and layout.problem(layout.d * layout.placement.chunks, request.model.tied) is None)


def _add_splits(layouts: list[Layout], feasible: list[Candidate], rejected: list[Rejection],
                request: PlanRequest, cost: CostModel) -> None:
    """Each layout with its balanced split (`CostModel.balanced_split`), judged as any other,
    where perfectly balanced stages could rank it among the `UNEVEN_BAR` fastest even
    layouts: its even time (or nearly even, where the layers do not split evenly) less m (F* +
    B* - the stages' mean F + B), the most balancing can take off 1F1B's steady state."""
    bar = 0.0
    if len(feasible) >= UNEVEN_BAR:
        bar = _rate(feasible[UNEVEN_BAR - 1], request)
    known = {c.layout: c.time for c in feasible}
    model = request.model
    for layout in layouts:
        stages = layout.d * layout.placement.chunks
        near, extra = divmod(model.num_layers, stages)  # the even split, or nearly
        even = known.get(layout) or cost.time(replace(layout, split=tuple(
            near + (v < extra) for v in range(stages))))
        work = [f + b for f, b in zip(even.forward, even.backward)]
        best = even.iteration - layout.m * (max(work) - sum(work) / len(work))
        if best <= 0 or layout.global_batch / best / request.factor_of(layout.schedule) < bar:
            continue
        split = cost.balanced_split(layout, request.memory_limit)
        if split is not None:
            found = _candidate(replace(layout, split=split), request, cost)
            (rejected if isinstance(found, Rejection) else feasible).append(found)


def _rate(candidate: Candidate, request: PlanRequest) -> float:
    """Samples/s as the ranking counts them (stale schedules divided by their factor)."""
    return candidate.samples_per_s / request.factor_of(candidate.layout.schedule)


def _expert_sizes(t: int, w: int, request: PlanRequest) -> list[int]:
    """The expert-parallel sizes to try at (t, w): the request's, or every divisor of the t w
    ranks of a stage for an MoE model (expert_problem refuses those the experts do not
    divide); 1 for a dense model."""
    if request.expert_parallel is not None:
        return list(request.expert_parallel)
    return _divisors(t * w) if request.model.is_moe else [1]


def _candidate(layout: Layout, request: PlanRequest, cost: CostModel) -> Candidate | Rejection:
    """The layout priced, or why it cannot run (the training's refusal, or its memory)."""
    model, cluster, limit = request.model, request.cluster, request.memory_limit
    problem = (layout.problem(model.num_layers, model.tied)
               or moe_placement_problem(model, layout))
    if problem:
        return Rejection(problem, layout)
    memory = cost.memory(layout, every_stage=False)
    if memory.peak > limit:
        worst = memory.peak_stage
        return Rejection(f"memory {memory.peak / GiB:.2f} GiB on stage {worst.stage} > "
                         f"{limit / GiB:.2f} GiB ({request.memory_fraction:.0%} of "
                         f"{cluster.memory_bytes / GiB:.0f} GiB)", layout,
                         memory_bytes=memory.peak)
    return Candidate(layout, memory, cost.time(layout))


def _refine(ranked: list[Candidate], request: PlanRequest, cost: CostModel) -> list[Candidate]:
    """Re-time the leading candidates with the schedule simulator until the best
    `simulate_top` are all simulated (or too long to simulate); the rest keep their closed-form
    times."""
    k = request.simulate_top
    if k <= 0:
        return ranked
    done: set[Layout] = set()
    while True:
        pending = [i for i, c in enumerate(ranked[:k])
                   if c.layout not in done and _simulatable(c.layout, request)]
        if not pending:
            return ranked
        for i in pending:
            c = ranked[i]
            done.add(c.layout)
            ranked[i] = Candidate(c.layout, c.memory, cost.time(c.layout, simulate=True))
        ranked.sort(key=partial(_rank_key, request=request))


def _simulatable(layout: Layout, request: PlanRequest) -> bool:
    actions = layout.d * 3 * (2 * layout.m + 1)
    return layout.d > 1 and actions <= request.simulate_max_actions
