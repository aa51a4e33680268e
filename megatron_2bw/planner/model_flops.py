"""FLOP counts of a model spec and the kernels the time model charges: each layer's GEMMs as
(FLOPs, smallest dimension) and the bytes its element-wise kernels stream, per tensor-parallel
rank, for dense and MoE layers, the embedding and the output layer.

`FlopCounts` is a mixin of `model.ModelSpec`: it reads the spec's fields and size properties
and `boundary_bytes` (model_memory). Invariant: a part's GEMMs sum to its forward FLOPs over t.
"""

from __future__ import annotations

from .model_memory import MASK_BYTES

__all__ = ["FlopCounts"]


class FlopCounts:
    """FLOPs and kernels of `model.ModelSpec` (Megatron-LM SC'21, Section 5.1, Eq. 3)."""

    def layer_forward_flops(self, b: int) -> float:
        """Forward FLOPs of one layer for b sequences (all tensor-parallel ranks together):
        2bs(4h^2 + 2hf) for the four GEMMs plus 4bs^2h for QK^T and attention x V; with
        f = 4h this is 24bsh^2 + 4bs^2h (Megatron-LM SC'21, Section 5.1, Eq. 3's terms).
        The backward costs twice the forward (input and weight gradients). GQA and SwiGLU:
        QKV and FC1 at `qkv_width` and `fc1_width`."""
        h, s, f = self.hidden_size, self.seq_length, self.ffn
        dense = h * self.qkv_width + h * h + h * self.fc1_width + f * h
        return 2 * b * s * dense + 4 * b * s * s * h

    def moe_layer_forward_flops(self, b: int, router: bool = True) -> float:
        """Forward FLOPs of one MoE layer for b sequences (all ranks together): the attention's
        of `layer_forward_flops`, the router's logits 2bshE, k experts per token
        2bs k(h f_e' + f_e h) and the shared expert 2bs(h f_s' + f_s h) (megatron-core's MoE
        layer; Megatron-LM's ``num_floating_point_operations`` counts the same experts, k per
        token, and the shared expert, and no router: `router=False`)."""
        h, s, k = self.hidden_size, self.seq_length, self.moe_router_topk
        attention = h * self.qkv_width + h * h
        experts = k * (h * self.expert_fc1_width + self.expert_ffn * h)
        shared = h * self.shared_fc1_width + self.shared_ffn * h
        logits = h * self.num_experts if router else 0
        return 2 * b * s * (attention + experts + shared + logits) + 4 * b * s * s * h

    def head_forward_flops(self, b: int, t: int = 1) -> float:
        """Logits on one of t ranks: 2bsh V/t (the output GEMM; Eq. 3's V/(16lh) term), V
        padded for t; BERT adds its LM-head dense layer, 2bsh^2, which is not split."""
        h, s = self.hidden_size, self.seq_length
        flops = 2 * b * s * h * self.padded_vocab(t) / t
        if self.kind == "bert":
            flops += 2 * b * s * h * h
        return flops

    def model_flops_per_iteration(self, global_batch: int, recompute: bool = False) -> float:
        """FLOPs of one training iteration as Megatron-LM SC'21 counts them (Eq. 3, Section
        5.1): the layers 3x their forward (4x with recomputation), the logits 3x:
        96 B s l h^2 (1 + s/(6h) + V/(16 l h)) for f = 4h with recomputation, V unpadded."""
        passes = 4 if recompute else 3
        logits = 2 * self.seq_length * self.hidden_size * self.vocab_size
        moe = sum(self.moe_pattern)
        layers = (self.num_layers - moe) * self.layer_forward_flops(1)
        if moe:  # k experts per token and the shared expert, no router (Megatron-LM's count)
            layers += moe * self.moe_layer_forward_flops(1, router=False)
        return global_batch * (passes * layers + 3 * logits)

    # ---- kernels: what the time model charges ---------------------------------------------
    def layer_gemms(self, b: int, t: int) -> list[tuple[float, int]]:
        """(FLOPs, smallest dimension) of each matrix multiply of one layer's forward on one of
        t ranks: QKV (bs x h -> 3h/t), projection (h/t -> h), FC1 (h -> f/t), FC2 (f/t -> h),
        and per head QK^T and attention x V (s x h/a x s, batch b a/t). Their FLOPs sum to
        layer_forward_flops(b) / t."""
        h, f, s, a = self.hidden_size, self.ffn, self.seq_length, self.num_attention_heads
        tokens, head_dim = b * s, h // a
        dense = [(h, self.qkv_width // t), (h // t, h), (h, self.fc1_width // t),
                 (f // t, h)]  # (K, N) per GEMM; GQA and SwiGLU: the widths of QKV and FC1
        gemms = [(2 * tokens * k * n, min(tokens, k, n)) for k, n in dense]
        bmm = 2 * b * a * s * s * head_dim / t
        return gemms + [(bmm, min(s, head_dim)), (bmm, min(s, head_dim))]

    def layer_streamed_bytes(self, b: int, t: int, element_bytes: int, *,
                             sequence_parallel: bool = False,
                             flash_attention: bool = False) -> float:
        """Bytes the element-wise kernels of one layer's forward read and write on one of t
        ranks (Megatron's fused kernels, no flash attention): two LayerNorms (read, write) and
        two bias-dropout-adds (read two, write one, and the mask), replicated over TP; the
        fused bias-GeLU (read and write f/t); the fused scale-mask-softmax (read and write the
        a/t score matrices) and the attention dropout (read, write, mask). Sequence
        parallelism splits the replicated kernels over t (Korthikanti et al. 2022, 4.2.2)."""
        h, f, s, e = self.hidden_size, self.ffn, self.seq_length, element_bytes
        masks = MASK_BYTES if self.dropout else 0
        tokens = b * s
        replicated = tokens * h * (2 * 2 * e + 2 * (3 * e + masks))
        if sequence_parallel:
            replicated /= t
        gelu = 2 * tokens * f // t * e
        return replicated + gelu + self.attention_core_kernels(
            b, t, e, flash_attention=flash_attention)[1]

    def attention_core_kernels(self, b: int, t: int, element_bytes: int, *,
                               flash_attention: bool = False
                               ) -> tuple[list[tuple[float, int]], float]:
        """(GEMMs, streamed bytes) of the attention core on one of t ranks, what selective
        recomputation replays (Korthikanti et al. 2022, Section 5): per head QK^T and
        attention x V (the last two of layer_gemms), the scale-mask-softmax and the attention
        dropout over the a/t score matrices. FlashAttention (Dao et al. 2022) keeps the score
        tiles on chip: it streams Q, K, V in and the output out (4sbh/t elements) and no
        s x s matrix; its dropout mask is regenerated from the RNG state."""
        s, a, e = self.seq_length, self.num_attention_heads, element_bytes
        if flash_attention:
            return self.layer_gemms(b, t)[-2:], 4 * s * b * self.hidden_size * e / t
        masks = MASK_BYTES if self.dropout else 0
        scores = a * s * s * b / t
        streamed = scores * (2 * e + ((2 * e + masks) if self.dropout else 0))
        return self.layer_gemms(b, t)[-2:], streamed

    def moe_layer_gemms(self, b: int, t: int, e: int) -> list[tuple[float, int]]:
        """(FLOPs, smallest dimension) of each matrix multiply of one MoE layer's forward on
        one of t tensor- and e expert-parallel ranks: the attention's of `layer_gemms`; the
        router over the rank's bs/t tokens (sequence parallelism) h -> E; the rank's E/e
        experts over the k bs/t token copies it receives on average (uniform routing: k bs
        e/(tE) per expert, the GEMMs' short side), FC1 h -> f_e' and FC2 f_e -> h whole; the
        shared expert h -> f_s'/t and f_s/t -> h over all bs tokens. Their FLOPs sum to
        moe_layer_forward_flops(b) / t."""
        h, s, k, E = self.hidden_size, self.seq_length, self.moe_router_topk, self.num_experts
        tokens = b * s / t  # the rank's tokens
        per_expert = k * tokens * e / E
        fe, fe1 = self.expert_ffn, self.expert_fc1_width
        attention = self.layer_gemms(b, t)
        gemms = attention[:2] + [
            (2 * tokens * h * E, min(tokens, h, E)),
            (2 * k * tokens * h * fe1, min(per_expert, h, fe1)),
            (2 * k * tokens * fe * h, min(per_expert, fe, h))]
        if self.shared_ffn:
            fs, fs1 = self.shared_ffn, self.shared_fc1_width
            gemms += [(2 * b * s * h * fs1 / t, min(b * s, h, fs1 // t)),
                      (2 * b * s * fs * h / t, min(b * s, fs // t, h))]
        return gemms + attention[4:]

    def moe_layer_streamed_bytes(self, b: int, t: int, element_bytes: int, *,
                                 flash_attention: bool = False) -> float:
        """Bytes the element-wise kernels of one MoE layer's forward read and write on one of
        t ranks (sequence parallelism on when t > 1: megatron-core's MoE layer refuses tensor
        parallelism without it): the LayerNorms, bias-dropout-adds and attention core of
        `layer_streamed_bytes`; the router's fp32 scores (write, read: 2 x 4 sbE/t); the
        permutation of the bs/t tokens into k copies by expert and the weighted sum back
        (read sbh/t, write k sbh/t, and the reverse: megatron-core's ``permute`` and
        ``unpermute``); the experts' activation over the k copies (read, write k sbf_e/t) and
        the shared expert's (2 sbf_s/t)."""
        h, s, k, e = self.hidden_size, self.seq_length, self.moe_router_topk, element_bytes
        tokens = b * s / t
        dense = self.layer_streamed_bytes(b, t, e, sequence_parallel=t > 1,
                                          flash_attention=flash_attention)
        gelu = 2 * b * s * self.ffn // t * e  # the dense MLP's, not in an MoE layer
        router = 2 * 4 * tokens * self.num_experts
        permutation = 2 * (1 + k) * tokens * h * e
        activation = 2 * k * tokens * self.expert_ffn * e + 2 * tokens * self.shared_ffn * e
        return dense - gelu + router + permutation + activation

    def dispatch_bytes(self, b: int, t: int, element_bytes: int) -> float:
        """What one rank's all-to-all of an MoE layer moves (the dispatch; the combine moves
        the same back): its bs/t tokens, k copies each, h elements a copy
        (megatron-core's ``MoEAlltoAllTokenDispatcher``; the routing probabilities it sends
        beside them, k fp32 numbers a token, are left out)."""
        return self.moe_router_topk * b * self.seq_length / t * self.hidden_size * element_bytes

    def head_gemms(self, b: int, t: int) -> list[tuple[float, int]]:
        """The output layer's logits GEMM (bs x h -> V/t); BERT adds its LM-head dense h x h."""
        h, tokens, v = self.hidden_size, b * self.seq_length, self.padded_vocab(t) // t
        gemms = [(2 * tokens * h * v, min(tokens, h, v))]
        if self.kind == "bert":
            gemms.append((2 * tokens * h * h, min(tokens, h)))
        return gemms

    def head_streamed_bytes(self, b: int, t: int, element_bytes: int) -> float:
        """The final LayerNorm (read, write sbh) and the vocab-parallel cross entropy over fp32
        logits (write, read for the max, read for the exp-sum: 3 x 4 bsV/t)."""
        tokens = b * self.seq_length
        return (2 * tokens * self.hidden_size * element_bytes
                + 3 * 4 * tokens * self.padded_vocab(t) / t)

    def embedding_streamed_bytes(self, b: int, element_bytes: int) -> float:
        """Word and position lookups and their sum, the embedding dropout: ~3 sbh reads and
        writes."""
        return 3 * self.boundary_bytes(b, element_bytes)
