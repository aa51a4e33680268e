"""The model flags (Megatron-LM's network-size group and TransformerConfig fields) and their
rules: :func:`_validate_model_features` (run after ``parallel._validate_layout``)."""

from __future__ import annotations

import argparse

from megatron_2bw.arguments.common import _COUNT, _POSITIVE, _PROBABILITY, _require
from megatron_2bw.flag_types import number_in


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""--attention-backend: megatron-core's AttnBackend names."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's model flags (megatron/training/arguments.py at core_v0.16.1: its
    "network size" group, and the TransformerConfig fields its ArgumentGroupFactory turns into
    flags, with their dests: --norm-epsilon -> layernorm_epsilon, --disable-bias-linear ->
    add_bias_linear)."""
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=_COUNT, default=None, help="required")
    g.add_argument("--hidden-size", type=_COUNT, default=None, help="required")
    g.add_argument("--ffn-hidden-size", type=_COUNT, default=None,
                   help="default: 4 x hidden size; with --swiglu int((4 x hidden x 2/3) / 64) "
                        "x 64, as Megatron-LM")
    g.add_argument("--num-attention-heads", type=_COUNT, default=None, help="required")
    g.add_argument("--kv-channels", type=_COUNT, default=None,
                   help="size of each attention head's projection; default: hidden / heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=_COUNT, default=None,
                   help="key/value head groups with --group-query-attention (default 1)")
    g.add_argument("--seq-length", type=_COUNT, default=None, help="required")
    g.add_argument("--max-position-embeddings", type=_COUNT, default=None,
                   help="required; at least --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=_COUNT, default=128)
    g.add_argument("--hidden-dropout", type=_PROBABILITY, default=0.1)
    g.add_argument("--attention-dropout", type=_PROBABILITY, default=0.1)
    g.add_argument("--init-method-std", type=_POSITIVE, default=0.02)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                   default="learned_absolute")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated: use --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_false",
                   dest="add_position_embedding",
                   help="deprecated: use --position-embedding-type none (accepted only with "
                        "rope, as Megatron-LM)")
    g.add_argument("--rotary-percent", type=number_in(0, 1, low_open=True), default=1.0,
                   help="fraction of each head's dimensions rotated by rope")
    g.add_argument("--rotary-base", type=_COUNT, default=10000)
    g.add_argument("--rotary-seq-len-interpolation-factor", type=_COUNT, default=None)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=_POSITIVE, default=1e-5)
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="the original BERT's residual order")
    g.add_argument("--swiglu", action="store_true",
                   help="gated linear unit with SiLU instead of GeLU")
    g.add_argument("--squared-relu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true",
                   help="OpenAI's tanh approximation of GeLU")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no bias in any linear layer (--add-qkv-bias keeps the QKV one)")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="--normalization applied to each head's queries and keys")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="scale Q K^T by 1/layer number (fp16); implies "
                        "--attention-softmax-in-fp32")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms and dropout over the sequence on tensor-parallel ranks "
                        "(CUDA only; off when the tensor-parallel size is 1, as Megatron-LM)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   default="auto",
                   help="transformer_engine's attention kernel (TransformerConfig."
                        "attention_backend); the local layer spec has one attention")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   dest="layernorm_zero_centered_gamma",
                   help="norms hold weight - 1 (TransformerConfig.layernorm_zero_centered_gamma)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="megatron-core's fused vocab-parallel cross entropy")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="loss and gradients averaged over all tokens of the batch, not per "
                        "microbatch (megatron-core's per-token loss)")
    g.add_argument("--context-parallel-size", type=_COUNT, default=1,
                   help="only 1: context parallelism needs transformer-engine attention on CUDA")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"),
                   default="transformer_engine",
                   help="layer implementation; transformer_engine is used only on CUDA where "
                        "transformer_engine imports, the local spec otherwise (said on rank 0)")


def _validate_model_features(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for the model-feature flags and the defaults it derives from them
    (``validate_args`` and ``core_transformer_config_from_args`` in
    megatron/training/arguments.py at core_v0.16.1; megatron-core's TransformerConfig checks,
    raised here as flag errors). Runs after :func:`_validate_layout` (hidden % heads)."""
    h, heads, tp = args.hidden_size, args.num_attention_heads, args.tensor_model_parallel_size
    if args.use_rotary_position_embeddings:  # its "Legacy RoPE arguments"
        args.position_embedding_type = "rope"
    _require(args.add_position_embedding or args.position_embedding_type == "rope",
             "--no-position-embedding", "deprecated (Megatron-LM accepts it only with rope); "
             "use --position-embedding-type none")
    _require(not (args.swiglu and args.squared_relu), "--squared-relu",
             "--swiglu and --squared-relu are exclusive")
    _require(not (args.openai_gelu and (args.swiglu or args.squared_relu)), "--openai-gelu",
             "exclusive with --swiglu and --squared-relu")
    if args.ffn_hidden_size is None:  # swiglu: two fc1 projections, ~the parameters of 4h
        args.ffn_hidden_size = int((4 * h * 2 / 3) / 64) * 64 if args.swiglu else 4 * h
        _require(args.ffn_hidden_size > 0, "--swiglu", f"the default FFN size int((4 x {h} x "
                 "2/3) / 64) x 64 is 0 for hidden sizes below 24; give --ffn-hidden-size")
    _require(args.ffn_hidden_size % tp == 0, "--ffn-hidden-size", f"{args.ffn_hidden_size} is "
             f"not divisible by tensor-parallel size {tp}")
    args.kv_channels = args.kv_channels or h // heads
    if args.num_query_groups not in (None, 1):  # 1: the default, ignored without GQA
        _require(args.group_query_attention, "--num-query-groups",
                 "needs --group-query-attention")
    if args.num_query_groups is None:  # Megatron-LM's default, saved with the flags
        args.num_query_groups = 1
    if args.group_query_attention:
        groups = args.num_query_groups
        _require(heads % groups == 0, "--num-query-groups",
                 f"{heads} attention heads do not split into {groups} query groups")
        _require(groups % tp == 0 or tp % groups == 0, "--num-query-groups",
                 f"{groups} query groups must be a multiple or a divisor of tensor-parallel "
                 f"size {tp}")
    if args.add_bias_linear:  # "keep the 'add bias' args in sync"
        args.add_qkv_bias = True
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    if tp == 1:  # Megatron-LM turns it off (with a warning) rather than change the numerics
        args.sequence_parallel = False
    if args.sequence_parallel:
        from megatron_2bw.runtime.device import device_kind

        if device_kind(args.cpu) != "cuda":  # the same values, the activations not split
            args.sequence_parallel = False
            args.validation_notes = getattr(args, "validation_notes", []) + [
                "note: --sequence-parallel has no effect on CPU (megatron-core's layers use "
                "torch's LayerNorm/RMSNorm there, WrappedTorchNorm, which refuses it; the "
                "tensor-parallel layers compute the same values without it); ignored"]
