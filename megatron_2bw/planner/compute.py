"""The compute terms of the cost model: a part's (layer, MoE layer, embedding, output layer)
forward and backward seconds and activation bytes on one rank, from a profile scaled to the model
or from the closed forms (`kernels`: GEMMs at their shape's rate, element-wise bytes at the
memory bandwidth), and the optimizer step's and Muon's Newton-Schulz seconds.

`ComputeTerms` is a mixin of `cost.CostModel`, reading its fields (model, cluster, precision,
profile, optimizer, ...) and `element_bytes`. Invariant: no communication in any of these
numbers; the bytes per parameter of the optimizer's state are the constants below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_2bw.schedules import keeps_versions

if TYPE_CHECKING:
    from .layout import Layout
    from .model import ModelSpec

__all__ = ["ComputeTerms", "kernels", "GRAD_BYTES", "MASTER_BYTES", "MOMENT_BYTES", "NS_STEPS"]

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


class ComputeTerms:
    """Per-part seconds and bytes of `cost.CostModel` (no communication)."""

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

    def _deferred(self, schedule: str, d: int) -> bool:
        """Whether 2BW's (and PipeDream's) step is deferred (it is whenever it would span the
        pipeline)."""
        return (keeps_versions(schedule) and d > 1 and self.deferred_step
                and self.precision != "fp16")

    def _optimizer_time(self, layout: Layout, stage_params: list[int],
                        expert_params: list[int], rank_layers: list[int]) -> float:
        """Seconds of the slowest stage's optimizer steps (the experts have an optimizer of
        their own: megatron-core's chain of two) plus Muon's Newton-Schulz on the stage with
        the most layers, dealt over `_muon_shards`; no communication."""
        t, w = layout.t, layout.w
        expert_dp = t * w // layout.e
        return max(self._optimizer_step(p - x, w)
                   + (self._optimizer_step(x, expert_dp) if x else 0.0)
                   for p, x in zip(stage_params, expert_params)) \
            + max(self._orthogonalization(n, t) for n in rank_layers) / self._muon_shards(w)


def _ns_flops(model: ModelSpec, t: int, matrices: list | None = None) -> float:
    """Newton-Schulz FLOPs on one layer's matrices (or `matrices`) on one of t ranks: per
    m x n block (m <= n) NS_STEPS x (4 m^2 n + 2 m^3)."""
    total = 0.0
    for rows, cols in matrices or model.layer_matrices(t):
        m, n = sorted((rows, cols))
        total += NS_STEPS * (4 * m * m * n + 2 * m ** 3)
    return total


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
