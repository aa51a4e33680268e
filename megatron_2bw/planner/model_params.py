"""Parameter counts of a model spec: one layer's, an MoE layer's, the embedding's, the output
layer's, a pipeline rank's and the whole model's, per tensor-parallel (and expert-parallel) rank.

`ParameterCounts` is a mixin of `model.ModelSpec`: it reads only the spec's fields and its size
properties (`ffn`, `qkv_width`, `fc1_width`, `padded_vocab`, the experts' widths). Invariant:
every count is an exact integer, and a rank's count is the sum of the parts it holds.
"""

from __future__ import annotations

import functools

__all__ = ["ParameterCounts"]


class ParameterCounts:
    """The parameter counts of `model.ModelSpec` (Megatron-LM SC'21, Section 5.1)."""

    def layer_parameters(self, t: int = 1) -> int:
        """One transformer layer's parameters held by one of t tensor-parallel ranks.

        QKV (3h^2 + 3h) and FC1 (hf + f) are column-parallel, the attention projection (h^2)
        and FC2 (fh) row-parallel with replicated biases (h each), two LayerNorms (2h each) are
        replicated: (4h^2 + 2hf + 3h + f)/t + 6h, which is 12h^2 + 13h for t = 1, f = 4h
        (Megatron-LM SC'21, Section 5.1). Grouped-query attention and SwiGLU widen QKV and FC1
        to `qkv_width` and `fc1_width`."""
        h, f, qkv, fc1 = self.hidden_size, self.ffn, self.qkv_width, self.fc1_width
        if not self.add_bias_linear:  # --disable-bias-linear: the two LayerNorms alone
            return (h * qkv + h * h + h * fc1 + f * h) // t + 4 * h
        return (h * qkv + qkv + h * h + h * fc1 + fc1 + f * h) // t + 6 * h

    @functools.lru_cache(maxsize=256)
    def moe_layer_parameters(self, t: int = 1, e: int = 1) -> tuple[int, int]:
        """(parameters outside the experts, the experts' parameters) of one MoE layer on one of
        t tensor- and e expert-parallel ranks. Outside: the attention and the two LayerNorms
        as `layer_parameters`, the router's E x h weight (replicated; megatron-core's
        ``TopKRouter``), the shared expert's FC1 and FC2 split over t like a dense MLP. The
        experts: E/e on the rank, each FC1 h x f_e' and FC2 f_e x h whole (expert tensor
        parallelism 1), with their biases where the linear layers have them (megatron-core's
        ``SequentialMLP``/``TEGroupedMLP``)."""
        h, qkv, fe, fe1 = self.hidden_size, self.qkv_width, self.expert_ffn, self.expert_fc1_width
        fs, fs1 = self.shared_ffn, self.shared_fc1_width
        bias = int(self.add_bias_linear)
        attention = (h * qkv + bias * qkv + h * h) // t + bias * h + 2 * 2 * h
        shared = (h * fs1 + bias * fs1 + fs * h) // t + bias * h * (fs > 0)
        router = self.num_experts * h
        experts = self.num_experts // e * (h * fe1 + fe * h + bias * (fe1 + h))
        return attention + router + shared, experts

    def embedding_parameters(self, t: int = 1) -> int:
        """First stage: word embedding (V/t rows per rank), learned positions (s x h,
        replicated); BERT adds 2 token types."""
        h = self.hidden_size
        tokentypes = 2 * h if self.kind == "bert" else 0
        return self.padded_vocab(t) * h // t + self.seq_length * h + tokentypes

    def head_parameters(self, t: int = 1, separate_stage: bool = True) -> int:
        """Last stage after the layers: final LayerNorm (2h), the output matrix (V/t x h) when
        it is not the first stage's word embedding (untied, or tied across stages: Megatron keeps
        a copy on the last stage and all-reduces its gradient with the first), and for BERT the
        LM head (dense h^2 + h, LayerNorm 2h, output bias V/t), pooler (h^2 + h) and binary
        head (2h + 2)."""
        h, v = self.hidden_size, self.padded_vocab(t) // t
        params = 2 * h
        if not self.tied or separate_stage:
            params += v * h
        if self.kind == "bert":
            params += (h * h + h) + 2 * h + v + (h * h + h) + (2 * h + 2)
        return params

    def stage_parameters(self, t: int, d: int, stage: int) -> int:
        """Parameters on one GPU of pipeline stage `stage` of d, tensor-parallel size t, the
        embedding on the first stage and the output layer on the last."""
        return self.rank_parameters(t, self.num_layers // d, embedding=stage == 0,
                                    head=stage == d - 1)

    def rank_parameters(self, t: int, layers: int, *, embedding: bool, head: bool,
                        moe_layers: int = 0, e: int = 1) -> int:
        """Parameters on one GPU holding `layers` layers, `moe_layers` of them MoE layers (e
        expert-parallel ranks), and the embedding and the output layer where it holds them
        (the output layer reads the embedding's matrix when tied and on the same rank)."""
        params = (layers - moe_layers) * self.layer_parameters(t)
        if moe_layers:
            params += moe_layers * sum(self.moe_layer_parameters(t, e))
        if embedding:
            params += self.embedding_parameters(t)
        if head:
            params += self.head_parameters(t, separate_stage=not embedding)
        return params

    def num_parameters(self) -> int:
        """The whole model, each tensor counted once."""
        return self.rank_parameters(1, self.num_layers, embedding=True, head=True,
                                    moe_layers=sum(self.moe_pattern))

    def num_active_parameters(self) -> int:
        """Parameters one token passes through: the whole model less, in each MoE layer, the
        E - k experts the router did not choose."""
        if not self.is_moe:
            return self.num_parameters()
        one_expert = self.moe_layer_parameters(1, self.num_experts)[1]
        idle = (self.num_experts - self.moe_router_topk) * one_expert
        return self.num_parameters() - sum(self.moe_pattern) * idle
