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

from .model_flops import FlopCounts
from .model_memory import MASK_BYTES, ActivationCounts
from .model_params import ParameterCounts

__all__ = ["ModelSpec", "MASK_BYTES"]

@dataclass(frozen=True)
class ModelSpec(ParameterCounts, FlopCounts, ActivationCounts):
    """A GPT or BERT model in Megatron's flags (`--num-layers` ...); its parameter, FLOP and
    activation counts come from the three mixins (model_params, model_flops, model_memory)."""

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
