"""Activation counts of a model spec: the bytes a layer (dense or MoE), the embedding and the
output layer keep for their backward, a pending weight gradient keeps from its I to its W, and
one activation sent between stages, per microbatch on one tensor-parallel rank.

`ActivationCounts` is a mixin of `model.ModelSpec`: it reads only the spec's fields and size
properties. Invariant: bytes are Korthikanti et al. 2022's accounting, term by term.
"""

from __future__ import annotations

__all__ = ["ActivationCounts", "MASK_BYTES"]

MASK_BYTES = 1
"""A dropout mask keeps one byte per element (Korthikanti et al. 2022, Section 4.1)."""


class ActivationCounts:
    """The activation bytes of `model.ModelSpec` (Korthikanti et al. 2022, Sections 4-5)."""

    def layer_activation_bytes(self, b: int, t: int, element_bytes: int, *,
                               sequence_parallel: bool = False,
                               selective_recompute: bool = False,
                               flash_attention: bool = False) -> float:
        """Bytes one layer keeps for its backward pass, per microbatch of b sequences, on one
        of t tensor-parallel ranks.

        Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
        Models", Section 4.1 (Eq. 1) and 4.2 (Eq. 2): sbh(10 + 24/t + 5as/(ht)) bytes for
        16-bit activations with dropout, f = 4h. Here per term, e bytes per element:
          replicated on all t ranks: the inputs of the two LayerNorms, of QKV and of FC1
            (4sbh e) and the two hidden-dropout masks (2sbh);
          split over t: Q, K, V and the projection input (4sbh e; GQA: sb(qkv_width + h) e),
            the GeLU input and output (2sbf e; SwiGLU: sb(2f + f) e), and per head the
            softmax output, its dropout mask and the dropout output (as^2b (2e + 1)); without
            dropout only the softmax output (as^2b e).
        Sequence parallelism (Section 4.2.2) splits the replicated part over t too: sbh 34/t;
        selective recomputation (Section 5) recomputes the attention core and keeps none of
        its per-head tensors: the 5as/h term goes. FlashAttention keeps of them only the
        softmax's log-sum-exp per row, in fp32 (4asb/t bytes; Dao et al. 2022, Algorithm 2)."""
        h, a, s, f, e = (self.hidden_size, self.num_attention_heads, self.seq_length,
                         self.ffn, element_bytes)
        masks = MASK_BYTES if self.dropout else 0
        replicated = s * b * h * (4 * e + 2 * masks)
        if sequence_parallel:
            replicated /= t
        attention = a * s * s * b * ((2 * e + masks) if self.dropout else e)
        if flash_attention:
            attention = 4 * a * s * b
        if selective_recompute:
            attention = 0
        split = (s * b * (self.qkv_width + h + self.fc1_width + f) * e + attention) / t
        return replicated + split

    def moe_layer_activation_bytes(self, b: int, t: int, element_bytes: int, *,
                                   selective_recompute: bool = False,
                                   flash_attention: bool = False) -> float:
        """Bytes one MoE layer keeps for its backward, per microbatch of b sequences on one of
        t ranks (sequence parallelism on when t > 1): `layer_activation_bytes` with the dense
        MLP's own tensors (its GeLU input and output, sb(f' + f) e/t) taken out and, in their
        place, what the router and the experts keep (Korthikanti et al. 2022's accounting
        applied to megatron-core's MoE layer): the router's fp32 scores (4 sbE/t); the k bs/t
        dispatched token copies, the experts' FC1 input; their FC1 output and activation, the
        FC2 input (k sb/t (f_e' + f_e) e); the shared expert's FC1 output and activation
        (sb(f_s' + f_s) e/t). The FC1 input the dense MLP kept (the LayerNorm's output) is the
        router's and the shared expert's input: still counted."""
        h, s, k, e = self.hidden_size, self.seq_length, self.moe_router_topk, element_bytes
        tokens = b * s / t
        dense = self.layer_activation_bytes(b, t, e, sequence_parallel=t > 1,
                                            selective_recompute=selective_recompute,
                                            flash_attention=flash_attention)
        mlp = s * b * (self.fc1_width + self.ffn) * e / t
        router = 4 * tokens * self.num_experts
        experts = k * tokens * (h + self.expert_fc1_width + self.expert_ffn) * e
        shared = tokens * (self.shared_fc1_width + self.shared_ffn) * e
        return dense - mlp + router + experts + shared

    def moe_layer_weight_grad_bytes(self, b: int, t: int, element_bytes: int) -> float:
        """`layer_weight_grad_bytes` for an MoE layer (sequence parallelism when t > 1): the
        attention's QKV and projection as there; each expert's FC1 and FC2 keep their input and
        output gradient over the k bs/t token copies: k sb/t (h + f_e' + f_e + h) e; the
        shared expert's as a dense MLP's over sb/t tokens with f_s/t wide; the router's
        weight takes its gradient in I (megatron-core's gating function is not one of its
        linear layers)."""
        h, s, k, e = self.hidden_size, self.seq_length, self.moe_router_topk, element_bytes
        tokens = b * s / t
        # QKV's input and output gradient, the projection's input and output gradient
        attention = tokens * (3 * h + self.qkv_width) * e
        experts = k * tokens * (2 * h + self.expert_fc1_width + self.expert_ffn) * e
        shared = 0.0
        if self.shared_ffn:
            shared = tokens * (2 * h + self.shared_fc1_width + self.shared_ffn) * e
        return attention + experts + shared

    def layer_weight_grad_bytes(self, b: int, t: int, element_bytes: int, *,
                                sequence_parallel: bool = False) -> float:
        """Bytes one layer's pending weight gradient keeps from its I to its W, per microbatch
        of b sequences on one of t ranks: for each megatron-core linear layer, its input as
        saved for the backward and its output gradient (`schedules/wgrad.py`, the zero-bubble
        store; Qi et al. 2024, Section 2):
            QKV   input sbh, output gradient sb qkv_width/t (3sbh/t without GQA)
            proj  input sbh/t, output gradient sbh
            FC1   input sbh, output gradient sb fc1_width/t (sbf/t; SwiGLU 2sbf/t)
            FC2   input sbf/t (the activation's output), output gradient sbh
        16 sbh e for t = 1, f = 4h. Sequence parallelism splits the sbh terms outside the
        attention and the MLP over t (the layers keep their local input, gather it again in W,
        and their row-parallel outputs are reduce-scattered). Norms and biases take their
        gradients in I."""
        h, f, e = self.hidden_size, self.ffn, element_bytes
        replicated = 4 * h  # QKV's and FC1's inputs, proj's and FC2's output gradients
        if sequence_parallel:
            replicated /= t
        split = (self.qkv_width + h + self.fc1_width + f) / t
        return self.seq_length * b * (replicated + split) * e

    def head_weight_grad_bytes(self, b: int, t: int, element_bytes: int, *,
                               sequence_parallel: bool = False,
                               with_embedding: bool = False) -> float:
        """The output layer's pending weight gradient, as `layer_weight_grad_bytes`: its input
        sbh (sbh/t under sequence parallelism) and the logits' gradient sbV/t, in the
        activations' type (the fp32 cross entropy's gradient is cast back at the logits).
        None where the output layer reads the word embedding on its own rank
        (`with_embedding`, tied): that weight takes its gradient in I."""
        if with_embedding and self.tied:
            return 0.0
        h = self.hidden_size / (t if sequence_parallel else 1)
        return self.seq_length * b * (h + self.padded_vocab(t) / t) * element_bytes

    def layer_input_bytes(self, b: int, element_bytes: int) -> float:
        """One layer's input, sbh e: all a checkpointed layer keeps (Megatron's full
        recomputation checkpoints each layer's input; the tensor is replicated over TP)."""
        return self.seq_length * b * self.hidden_size * element_bytes

    def embedding_activation_bytes(self, b: int, t: int, element_bytes: int) -> float:
        """First stage, beyond the layers: the embedding dropout mask (sbh); the embedding
        output itself is the first layer's input, counted there."""
        return self.seq_length * b * self.hidden_size * (MASK_BYTES if self.dropout else 0)

    def head_activation_bytes(self, b: int, t: int, element_bytes: int) -> float:
        """Last stage, beyond the layers: the final LayerNorm's and the output layer's inputs
        (2sbh e) and the softmax Megatron's vocab-parallel cross entropy keeps in fp32
        (4 bsV/t); BERT's LM head adds its dense layer's input and GeLU (2sbh e)."""
        s, h = self.seq_length, self.hidden_size
        bert = 2 * s * b * h * element_bytes if self.kind == "bert" else 0
        return 2 * s * b * h * element_bytes + 4 * b * s * self.padded_vocab(t) / t + bert

    def logits_gradient_bytes(self, b: int, t: int) -> float:
        """Transient on the last stage during a backward: the fp32 gradient of the logits."""
        return 4 * b * self.seq_length * self.padded_vocab(t) / t

    def boundary_bytes(self, b: int, element_bytes: int) -> float:
        """One activation (or its gradient) sent between pipeline stages: sbh e."""
        return self.seq_length * b * self.hidden_size * element_bytes
