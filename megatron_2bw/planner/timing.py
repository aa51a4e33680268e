"""The time terms of the cost model: seconds per iteration of a layout as one structure, each
stage's compute (compute.ComputeTerms), its tensor-parallel and expert-parallel collectives and
its sends (comm_cost.CommTerms), the schedule's bubble over those (bubble), then the step.

`TimeTerms` is a mixin of `cost.CostModel`; `TimeEstimate` is what it returns. Invariant: a
rank's F and B are the sums of its chunks' (`layout.rank_parts`' placement), and no global
efficiency factor scales any term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .bubble import closed_form_iteration, simulated_iteration
from .comm_cost import CommTerms
from .compute import ComputeTerms
from .layout import Layout, _chunk_parts, moe_layers_of, rank_parts

__all__ = ["TimeEstimate", "TimeTerms"]


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


class _PartTimes(NamedTuple):
    """(forward, backward) seconds of one microbatch through each part on one rank, no
    communication: a dense layer, an MoE layer, the embedding, the output layer."""

    layer: tuple[float, float]
    moe_layer: tuple[float, float]
    embedding: tuple[float, float]
    head: tuple[float, float]


class _StageTimes(NamedTuple):
    """Per rank, each chunk's F and B (its collectives and sends included) and the rank's
    tensor- and expert-parallel shares of them; per rank its layers and MoE layers."""

    chunk_forward: list[tuple[float, ...]]
    chunk_backward: list[tuple[float, ...]]
    tensor_parallel: list[float]
    expert_parallel: list[float]
    rank_layers: list[int]
    moe_counts: list[int]
    p2p: float

    @property
    def forward(self) -> list[float]:
        return [sum(fs) for fs in self.chunk_forward]

    @property
    def backward(self) -> list[float]:
        return [sum(bs) for bs in self.chunk_backward]


class _StepTimes(NamedTuple):
    """The step's parts, and their sum `total` (`TimeEstimate.step`)."""

    data_parallel: float
    embedding_sync: float
    optimizer: float
    total: float


class TimeTerms(CommTerms, ComputeTerms):
    """Seconds per iteration of `cost.CostModel` (PipeDream-2BW Section 4.3, THROUGHPUT)."""

    _closed_form = staticmethod(closed_form_iteration)

    def time(self, layout: Layout, simulate: bool = False) -> TimeEstimate:
        """Seconds per iteration (PipeDream-2BW Section 4.3, THROUGHPUT, with the pipeline
        part from the schedule: closed forms, or the simulator when `simulate`).

        One structure for every layout: each stage's compute (GEMMs at their shape's sustained
        rate, element-wise kernels at the memory bandwidth), its tensor-parallel all-reduces
        and its sends; the schedule's bubble over those; then the step (data-parallel
        all-reduce, tied-embedding all-reduce, optimizer). No global efficiency factor."""
        stages = self._stage_times(layout)
        forward, backward = stages.forward, stages.backward
        step = self._step_times(layout, stages)
        iteration, method = self._iteration(layout, forward, backward, stages, step.total,
                                            simulate)
        bottleneck = max(f + bw for f, bw in zip(forward, backward))
        pipeline = iteration - step.total
        bubble = 1 - layout.m * bottleneck / pipeline if pipeline > 0 else 0.0
        return TimeEstimate(
            forward=tuple(forward), backward=tuple(backward),
            tensor_parallel=tuple(stages.tensor_parallel),
            chunk_forward=tuple(stages.chunk_forward),
            chunk_backward=tuple(stages.chunk_backward),
            expert_parallel=tuple(stages.expert_parallel) if self.model.is_moe else (),
            p2p=stages.p2p, data_parallel=step.data_parallel,
            embedding_sync=step.embedding_sync, optimizer=step.optimizer, step=step.total,
            iteration=iteration, bubble_fraction=max(bubble, 0.0),
            global_batch=layout.global_batch, method=method)

    def _part_times(self, layout: Layout) -> _PartTimes:
        """Each part's compute per microbatch on one rank: an MoE layer is the dense layer's
        times scaled by the closed forms' ratio (its router, k experts per token,
        permutation; moe_layer_gemms), the attention's additions (selective recomputation's
        replayed core, FlashAttention's QK^T again) alike."""
        b, t = layout.b, layout.t
        lf, lb = self._compute("layer", b, t, layout.recompute)
        mf, mb = lf * self._moe_scale(layout, "time"), lb * self._moe_scale(layout, "time")
        lf, lb = self._layer_options(lf, layout, "time"), self._layer_options(lb, layout, "time")
        attention_extra = self._replayed_core(lf, layout) + self._flash_scores(lf, layout)
        lb, mb = lb + attention_extra, mb + attention_extra
        return _PartTimes((lf, lb), (mf, mb), self._compute("embedding", b, t, False),
                          self._compute("head", b, t, False))

    def _stage_times(self, layout: Layout) -> _StageTimes:
        """Per model chunk (virtual stage): its layers (`layout.layers`), the embedding on the
        first virtual stage, the head on the last, a send where the next (previous) virtual
        stage is on another rank; a rank's F_i and B_i are its chunks' sums. A dense layer
        all-reduces twice per pass (after attention and after the MLP; recomputation replays
        the forward's two); an MoE layer once (the attention's; its experts hold whole
        weights) and once more for a shared expert; each MoE layer two all-to-alls a pass."""
        model, rc = self.model, layout.recompute
        split, placement = layout.layers(model.num_layers), layout.placement
        _, tp_ar, tp_small = self._tensor_parallel(layout)
        send, p2p = self._p2p(layout)
        (lf, lb), (mf, mb), (ef, eb), (hf, hb) = self._part_times(layout)
        a2a, shared = self._all_to_all(layout), bool(model.shared_ffn)
        times = _StageTimes([], [], [], [], [], [], p2p)
        for i, chunks in enumerate(_chunk_parts(layout.schedule, layout.d, layout.v)):
            fs, bs, tps, eps = [], [], 0.0, 0.0
            counts, moes = split.of_rank(placement, i), moe_layers_of(model, layout, i)
            times.rank_layers.append(sum(counts))
            times.moe_counts.append(sum(moes))
            for layers, moe, (first, last, ahead, behind) in zip(counts, moes, chunks):
                collectives = 2 * (layers - moe) + (1 + shared) * moe
                tp_f = collectives * tp_ar + first * tp_ar + last * 3 * tp_small
                tp_b = collectives * (1 + rc) * tp_ar + last * tp_ar
                ep_f, ep_b = moe * 2 * a2a, moe * (2 + 2 * rc) * a2a
                fs.append((layers - moe) * lf + moe * mf + first * ef + last * hf + tp_f
                          + ep_f + ahead * send)
                bs.append((layers - moe) * lb + moe * mb + first * eb + last * hb + tp_b
                          + ep_b + behind * send)
                tps, eps = tps + tp_f + tp_b, eps + ep_f + ep_b
            times.chunk_forward.append(tuple(fs))
            times.chunk_backward.append(tuple(bs))
            times.tensor_parallel.append(tps)
            times.expert_parallel.append(eps)
        return times

    def _step_times(self, layout: Layout, stages: _StageTimes) -> _StepTimes:
        """Everything between an iteration's last backward and the next forward that needs
        the new weights: the gradients' all-reduces, the optimizer (the slowest stage's,
        with its collectives) and the gradient norm."""
        model, t = self.model, layout.t
        ranks = [rank_parts(layout, i) for i in range(layout.d)]
        stage_params = [model.rank_parameters(t, n, embedding=p.embedding, head=p.head,
                                              moe_layers=moe, e=layout.e)
                        for n, p, moe in zip(stages.rank_layers, ranks, stages.moe_counts)]
        expert_params = [moe * model.moe_layer_parameters(t, layout.e)[1] if moe else 0
                         for moe in stages.moe_counts]
        data_parallel = self._data_parallel(layout, stage_params, expert_params)
        embedding_sync = self._embedding_sync(layout, ranks[0])
        optimizer = self._optimizer_time(layout, stage_params, expert_params,
                                         stages.rank_layers)
        for collective in self._optimizer_collectives(layout, stage_params):
            optimizer += collective
        step = data_parallel + embedding_sync + optimizer + self._norm(layout)
        return _StepTimes(data_parallel, embedding_sync, optimizer, step)

    def _sync(self, layout: Layout) -> str:
        """"pipeline" where the step waits for every stage: the grad norm and fp16's found-inf
        span all stages; the tied embedding's all-reduce makes the last stage wait for the
        first, and the stages between follow the last; unless 2BW defers the step."""
        pipeline_wide = self.precision == "fp16" or (
            (self._takes_norm() or self.model.tied)
            and not self._deferred(layout.schedule, layout.d))
        return "pipeline" if pipeline_wide and layout.d > 1 else "local"

    def _iteration(self, layout: Layout, forward: list[float], backward: list[float],
                   stages: _StageTimes, step: float, simulate: bool) -> tuple[float, str]:
        """(seconds, method) of one iteration: the schedule's closed form over the stages'
        F and B, or the simulator's (`bubble`) when `simulate` at d > 1 without interleaving
        (the V's two chunks timed each on its own)."""
        d, m, v, sync = layout.d, layout.m, layout.v, self._sync(layout)
        schedule = "flush" if layout.schedule == "megatron" and v == 1 else layout.schedule
        if simulate and d > 1 and v == 1:
            by_chunk = layout.placement.shape == "v"
            return simulated_iteration(
                schedule, d, m,
                tuple(stages.chunk_forward) if by_chunk else tuple(forward),
                tuple(stages.chunk_backward) if by_chunk else tuple(backward),
                stages.p2p, step, sync), "simulated"
        return self._closed_form(schedule, d, m, forward, backward, stages.p2p, step, sync,
                                 v=v), "closed-form"
