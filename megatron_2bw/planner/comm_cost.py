"""The communication terms of the cost model: tensor-parallel all-reduces, the pipeline's sends,
the experts' all-to-alls, and the step's collectives (data-parallel and expert-data-parallel
gradient all-reduces, the tied embedding's, the gradient norm's, dist_muon's and predict's).

`CommTerms` is a mixin of `cost.CostModel`, reading its model, cluster and settings. Invariant:
ranks sit as megatron-core places them (tensor fastest, then data, then pipeline: a stage's t w
ranks, the next stage t w ranks on; the e expert-parallel ranks consecutive), and every group's
link is `Cluster.group_link` (or `p2p_link`, `all_to_all`) at that size and stride.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .compute import GRAD_BYTES

if TYPE_CHECKING:
    from .cluster import Link
    from .layout import Layout, RankParts

__all__ = ["CommTerms"]


class CommTerms:
    """Seconds of the collectives and sends of `cost.CostModel`."""

    def _tensor_parallel(self, layout: Layout) -> tuple[Link, float, float]:
        """(the t ranks' link, an (s, b, h) activation's all-reduce, the cross entropy's
        max/sum all-reduce) of tensor parallelism (Megatron-LM, Shoeybi et al. 2019, Section 3
        and Figure 3): ring all-reduce over the t ranks, NVLink inside a node, the members'
        NICs across nodes (Cluster.group_link)."""
        model, t, b = self.model, layout.t, layout.b
        tp_link = self.cluster.group_link(t, stride=1)
        tp_ar = tp_link.all_reduce(model.boundary_bytes(b, self.element_bytes), t)
        tp_small = tp_link.all_reduce(4 * b * model.seq_length, t)  # cross-entropy max/sum
        return tp_link, tp_ar, tp_small

    def _p2p(self, layout: Layout) -> tuple[float, float]:
        """(the seconds a send occupies its sender, the latency that delays its receiver)
        between neighbouring pipeline stages, t w ranks apart. The send occupies it for n / beta
        (PipeDream-2BW Section 4.3 counts the stage's communication in its time), the latency
        alpha delays the receiver. With t > 1 each rank sends its 1/t slice (Megatron's
        scatter/gather, SC'21 Section 4.1) when the next stage is in another node."""
        t, d = layout.t, layout.d
        pp_link = self.cluster.p2p_link(d, stride=t * layout.w)
        scatter = t if pp_link is not self.cluster.intra_node else 1
        send = (self.model.boundary_bytes(layout.b, self.element_bytes) / scatter
                / pp_link.bandwidth if d > 1 else 0.0)
        return send, pp_link.latency if d > 1 else 0.0

    def _all_to_all(self, layout: Layout) -> float:
        """One all-to-all of an MoE layer (megatron-core's alltoall dispatcher: each MoE layer
        sends its rank's k bs/t token copies to their experts' ranks and the results back,
        dispatch and combine, in the forward and again in the backward, and once more forward
        when recomputing; not overlapped with compute). The e ranks are consecutive
        (Cluster.all_to_all: NVLink inside a node, the NICs across); 0 for a dense model."""
        model = self.model
        if not model.is_moe:
            return 0.0
        return self.cluster.all_to_all(model.dispatch_bytes(layout.b, layout.t,
                                                            self.element_bytes),
                                       layout.e, stride=1)

    def _data_parallel(self, layout: Layout, stage_params: list[int],
                       expert_params: list[int]) -> float:
        """The slowest stage's ring all-reduce of its fp32 gradients over its w replicas, t
        apart (PipeDream-2BW Section 4.3: all_reduce(|W|/d) over w workers; not overlapped with
        the backward: megatron-core's DDP default overlap_grad_reduce=False); the experts' over
        their t w / e expert-data-parallel replicas, e apart (its expert DDP buffer)."""
        t, w = layout.t, layout.w
        dp_link = self.cluster.group_link(w, stride=t)
        expert_dp = t * w // layout.e
        edp_link = self.cluster.group_link(expert_dp, stride=layout.e)
        return max(dp_link.all_reduce((p - x) * GRAD_BYTES, w)
                   + (edp_link.all_reduce(x * GRAD_BYTES, expert_dp) if x else 0.0)
                   for p, x in zip(stage_params, expert_params))

    def _embedding_sync(self, layout: Layout, first: RankParts) -> float:
        """The tied embedding's gradient all-reduce between the first and the last stage, where
        the output layer's copy is on another rank than the embedding (`first`: rank 0's)."""
        model, t = self.model, layout.t
        if not model.tied or first.head:
            return 0.0
        embedding = model.padded_vocab(t) // t * model.hidden_size
        return self.cluster.group_link(2, stride=t * layout.w * (layout.d - 1)).all_reduce(
            embedding * GRAD_BYTES, 2)

    def _optimizer_collectives(self, layout: Layout, stage_params: list[int]) -> list[float]:
        """The optimizer step's collectives, in the order it adds them: dist_muon all-gathers
        the updated parameters; predict's R summed over the replicas (`_predict_summed`)."""
        t, w, e = layout.t, layout.w, self.element_bytes
        dp_link = self.cluster.group_link(w, stride=t)
        added = []
        if self._muon_shards(w) > 1:
            added.append(max(dp_link.all_reduce(p * e, w) for p in stage_params) / 2)
        if self._predict_summed(layout.schedule, w):
            added.append(max(dp_link.all_reduce(p * e, w) for p in stage_params))
        return added

    def _predict_summed(self, schedule: str, w: int) -> bool:
        """Whether predict's R is made on each replica's shards and summed over them (an
        all-reduce of the stage's weights a step): with a sharded optimizer."""
        return (schedule == "2bw" and self.correction == "predict" and w > 1
                and self.distributed_optimizer)

    def _takes_norm(self) -> bool:
        """Whether the step takes the gradient norm: with clipping, and always for Muon's chain
        of two optimizers."""
        return self.clip_grad or self.optimizer == "muon"

    def _norm(self, layout: Layout) -> float:
        """The gradient norm's all-reduces, over the t ranks and over the d stages."""
        t, d = layout.t, layout.d
        if not self._takes_norm():
            return 0.0
        return (self.cluster.group_link(t, stride=1).all_reduce(4, t)
                + self.cluster.group_link(d, stride=t * layout.w).all_reduce(4, d))
