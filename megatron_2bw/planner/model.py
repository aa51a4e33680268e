"""The model as the planner sees it: parameters, FLOPs and activation bytes of one transformer
layer and of the embedding and output layers, per tensor-parallel rank.

Symbols are those of the Megatron-LM papers: L layers, h hidden size, a attention heads,
s sequence length, V vocabulary (padded as Megatron pads it), f FFN hidden size (4h unless
given), b microbatch size, t tensor-parallel size, e bytes per activation element.

    spec = ModelSpec("gpt", num_layers=96, hidden_size=12288, num_attention_heads=96,
                     seq_length=2048, vocab_size=51200)
    spec.num_parameters(), spec.layer_forward_flops(b=1)   # 174.6e9, 24bsh^2 + 4bs^2h

Mixture of Experts: E experts of FFN size f_e, k per token, e expert-parallel ranks holding
E/e experts whole. Examples (Mixtral: 46.7e9 parameters, 12.9e9 active) and the MoE terms:
docs/planner.md, "The planner as a library" and "Mixture of Experts".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["ModelSpec", "MASK_BYTES"]

MASK_BYTES = 1
"""A dropout mask keeps one byte per element (Korthikanti et al. 2022, Section 4.1)."""


@dataclass(frozen=True)
class ModelSpec:
    """A GPT or BERT model in Megatron's flags (`--num-layers` ...)."""

    kind: Literal["gpt", "bert"]
    num_layers: int
    """L (`--num-layers`)."""
    hidden_size: int
    """h (`--hidden-size`)."""
    num_attention_heads: int
    """a (`--num-attention-heads`)."""
    seq_length: int
    """s (`--seq-length`)."""
    vocab_size: int
    """V before padding (the tokenizer's size, or `--vocab-size`)."""
    ffn_hidden_size: int | None = None
    """f (`--ffn-hidden-size`); None means 4h (with SwiGLU int(4h 2/3 / 64) 64, Megatron-LM's
    default)."""
    make_vocab_size_divisible_by: int = 128
    untie_embeddings: bool = False
    """GPT: `--untie-embeddings-and-output-weights` (separate output matrix)."""
    dropout: bool = True
    """Hidden and attention dropout on (Megatron's default 0.1): their masks are stashed."""
    num_query_groups: int | None = None
    """g key/value heads (`--group-query-attention --num-query-groups g`); None: a, one per
    query head."""
    gated_linear_unit: bool = False
    """`--swiglu`: FC1 makes the gate and the value, 2f wide, the activation multiplies them."""
    add_bias_linear: bool = True
    """Linear layers with biases (`--disable-bias-linear` turns them off, as Megatron-LM's MoE
    examples do)."""
    num_experts: int | None = None
    """E (`--num-experts`): an MoE layer's MLP is a router and E experts; None: dense."""
    moe_router_topk: int = 2
    """k (`--moe-router-topk`): the experts each token passes through."""
    moe_ffn_hidden_size: int | None = None
    """f_e (`--moe-ffn-hidden-size`); None: f, as Megatron-LM sets it."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """`--moe-layer-freq`: an MoE layer every N layers from the first, or one 0/1 per layer."""
    moe_shared_expert_intermediate_size: int | None = None
    """f_s (`--moe-shared-expert-intermediate-size`): a shared expert every token passes
    through, beside the routed ones; None: none."""

    def __post_init__(self) -> None:
        if self.kind not in ("gpt", "bert"):
            raise ValueError(f"model kind must be 'gpt' or 'bert', got {self.kind!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden size {self.hidden_size} is not divisible by "
                             f"{self.num_attention_heads} attention heads")
        if self.ffn < 1:
            raise ValueError(f"the SwiGLU FFN size int((4 x {self.hidden_size} x 2/3) / 64) x 64 "
                             f"is 0; give ffn_hidden_size")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"{self.num_attention_heads} attention heads do not split into "
                             f"{self.query_groups} query groups")
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if self.num_experts is not None:
            if self.num_experts < 1 or not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(f"need 1 <= top-k {self.moe_router_topk} <= "
                                 f"{self.num_experts} experts")
            pattern = self.moe_layer_freq
            if isinstance(pattern, tuple) and (len(pattern) != self.num_layers
                                               or set(pattern) - {0, 1}):
                raise ValueError(f"--moe-layer-freq pattern {list(pattern)}: one 0 or 1 per "
                                 f"layer of {self.num_layers}")
            if isinstance(pattern, int) and pattern < 1:
                raise ValueError(f"--moe-layer-freq must be >= 1, got {pattern}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, kind: str = "gpt") -> "ModelSpec":
        """From parsed Megatron flags (ours or Megatron-LM's)."""
        return cls(kind=kind, num_layers=args.num_layers, hidden_size=args.hidden_size,
                   num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                   vocab_size=args.vocab_size, ffn_hidden_size=args.ffn_hidden_size,
                   make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128),
                   untie_embeddings=getattr(args, "untie_embeddings_and_output_weights", False),
                   num_query_groups=(args.num_query_groups
                                     if getattr(args, "group_query_attention", False) else None),
                   gated_linear_unit=getattr(args, "swiglu", False),
                   add_bias_linear=getattr(args, "add_bias_linear", True),
                   **({} if not getattr(args, "num_experts", None) else dict(
                       num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                       moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                       moe_layer_freq=args.moe_layer_freq,
                       moe_shared_expert_intermediate_size=(
                           args.moe_shared_expert_intermediate_size))))

    _OPTIONAL = ("num_query_groups", "gated_linear_unit", "add_bias_linear", "num_experts",
                 "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                 "moe_shared_expert_intermediate_size")

    def to_json(self) -> dict:
        """The fields, less those added after the first files (grouped-query attention, the
        gated unit, biases, experts) where they hold their defaults: a file written before
        they existed reads back the same."""
        data = dataclasses.asdict(self)
        for name in self._OPTIONAL:
            if data[name] == getattr(ModelSpec, name):
                del data[name]
        if isinstance(data.get("moe_layer_freq"), tuple):
            data["moe_layer_freq"] = list(data["moe_layer_freq"])
        return data

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        h = self.hidden_size
        return int((4 * h * 2 / 3) / 64) * 64 if self.gated_linear_unit else 4 * h

    @property
    def query_groups(self) -> int:
        """g: key/value heads (a without grouped-query attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_width(self) -> int:
        """QKV's output features, all ranks: a query heads and g key and g value heads of h/a
        each, 3h without grouping (megatron-core's ``linear_qkv``)."""
        h = self.hidden_size
        return h + 2 * self.query_groups * (h // self.num_attention_heads)

    @property
    def fc1_width(self) -> int:
        """FC1's output features, all ranks: f, or 2f with a gated unit (SwiGLU)."""
        return self.ffn * (2 if self.gated_linear_unit else 1)

    # ---- Mixture of Experts ---------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @functools.cached_property
    def moe_pattern(self) -> tuple[int, ...]:
        """1 for each MoE layer, 0 for each dense one (megatron-core's
        ``get_gpt_decoder_layer_specs``: --moe-layer-freq N puts one at every N-th layer from
        the first); all 0 for a dense model."""
        if not self.is_moe:
            return (0,) * self.num_layers
        if isinstance(self.moe_layer_freq, tuple):
            return self.moe_layer_freq
        return tuple(int(i % self.moe_layer_freq == 0) for i in range(self.num_layers))

    @property
    def expert_ffn(self) -> int:
        """f_e: an expert's FFN size (`--moe-ffn-hidden-size`, default f)."""
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def expert_fc1_width(self) -> int:
        """An expert's FC1 output features: f_e, or 2 f_e with a gated unit."""
        return self.expert_ffn * (2 if self.gated_linear_unit else 1)

    @property
    def shared_ffn(self) -> int:
        """f_s: the shared expert's FFN size, 0 without one."""
        return self.moe_shared_expert_intermediate_size or 0

    @property
    def shared_fc1_width(self) -> int:
        return self.shared_ffn * (2 if self.gated_linear_unit else 1)

    def layer_matrices(self, t: int = 1) -> list[tuple[int, int]]:
        """(rows, columns) of one layer's weight matrices on one of t tensor-parallel ranks,
        QKV's query, key and value parts apart (Muon orthogonalizes each on its own):
        column-parallel QKV and FC1 split their rows, the projection and FC2 their columns."""
        h, kv = self.hidden_size, self.query_groups * (self.hidden_size // self.num_attention_heads)
        return [(h // t, h), (kv // t, h), (kv // t, h), (h, h // t),
                (self.fc1_width // t, h), (h, self.ffn // t)]

    def padded_vocab(self, t: int = 1) -> int:
        """V rounded up to a multiple of `make_vocab_size_divisible_by * t` (Megatron-LM's
        padding, so every tensor-parallel shard of the embedding has the same rows)."""
        multiple = self.make_vocab_size_divisible_by * t
        return math.ceil(self.vocab_size / multiple) * multiple

    @property
    def tied(self) -> bool:
        """Output layer shares the word embedding (GPT by default, BERT always)."""
        return self.kind == "bert" or not self.untie_embeddings

    # ---- parameters -----------------------------------------------------------------------
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

    # ---- FLOPs ----------------------------------------------------------------------------
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

    # ---- activations ----------------------------------------------------------------------
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
