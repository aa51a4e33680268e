"""Which of megatron-core's transformer layer specs a model is built with: transformer-engine's
where ``--transformer-impl transformer_engine`` asks, it imports and the process trains on CUDA;
the local spec otherwise (said once, on rank 0). The entry scripts' model providers, the
training's attention-backend choice and the planner's profiler all ask here.
"""

from __future__ import annotations

import argparse

from megatron_2bw.flag_types import FlagError
from megatron_2bw.runtime import device
from megatron_2bw.runtime.distributed import is_rank_zero

__all__ = ["use_transformer_engine", "gpt_layer_spec", "bert_layer_spec"]

_reported_layer_spec = False


def use_transformer_engine(transformer_impl: str, have_te: bool, on_cuda: bool) -> tuple[bool, str]:
    """Whether to build transformer-engine's layer specs, and why (pure): only when
    ``--transformer-impl transformer_engine`` asks, transformer_engine imports, and the process
    trains on CUDA."""
    if transformer_impl != "transformer_engine":
        return False, f"--transformer-impl {transformer_impl}"
    if not on_cuda:
        return False, "this process runs on the CPU; transformer_engine needs CUDA"
    if not have_te:
        return False, "transformer_engine is not importable"
    return True, "--transformer-impl transformer_engine"


def _choose_layer_spec(args: argparse.Namespace, have_te: bool) -> bool:
    """:func:`use_transformer_engine` for these flags; says on rank 0, once per process, when
    transformer_engine was asked for but the local spec is used."""
    global _reported_layer_spec
    impl = getattr(args, "transformer_impl", "local")
    use_te, why = use_transformer_engine(impl, have_te, device.on_cuda(args.cpu))
    if impl == "transformer_engine" and not use_te and not _reported_layer_spec:
        _reported_layer_spec = True
        if is_rank_zero():
            print(f" --transformer-impl transformer_engine: using the local layer spec ({why})",
                  flush=True)
    return use_te


def gpt_layer_spec(args: argparse.Namespace, config=None, vp_stage: int | None = None):
    """transformer-engine's layer spec when :func:`use_transformer_engine` says so, the local
    spec otherwise, with the arguments Megatron-LM's gpt_builders.py passes them
    (``_get_transformer_layer_spec``: qk_layernorm to both, normalization to the local one; TE's
    norms read ``config.normalization``). With --num-experts, as there, megatron-core's
    per-layer block spec (``get_gpt_decoder_block_spec``: MoE or dense layers by
    --moe-layer-freq, this chunk's layers; ``vp_stage`` the chunk's virtual stage). No
    multi-latent attention."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = _choose_layer_spec(args, gpt_layer_specs.HAVE_TE)
    _check_sequence_parallel_norm(args, use_te, gpt_layer_specs.HAVE_APEX)
    if getattr(args, "num_experts", None):
        from megatron_2bw.training import moe

        if config is None:
            raise ValueError("a MoE model's block spec needs its TransformerConfig")
        moe.close_gaps()
        return gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization,
            vp_stage=vp_stage)
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm,
                                                    normalization=args.normalization)
    if config is not None and config.layernorm_zero_centered_gamma \
            and not gpt_layer_specs.HAVE_APEX:  # apex's FusedLayerNorm has it
        from megatron_2bw.training.norms import with_zero_centered_norms

        return with_zero_centered_norms(spec, config)
    return spec


def _check_sequence_parallel_norm(args: argparse.Namespace, use_te: bool,
                                  have_apex: bool) -> None:
    """Sequence parallelism needs a norm that supports it: transformer-engine's, or apex's
    FusedLayerNorm (LayerNorm only); the local spec's torch norms (WrappedTorchNorm) assert."""
    if not args.sequence_parallel or use_te:
        return
    if not have_apex or args.normalization != "LayerNorm":
        raise FlagError("--sequence-parallel", "needs transformer_engine's layers, or apex with "
                        "--normalization LayerNorm: the local spec's torch "
                        f"{args.normalization} refuses sequence parallelism")


def bert_layer_spec(args: argparse.Namespace):
    """transformer-engine's BERT layer spec when :func:`use_transformer_engine` says so, the
    local spec otherwise (Megatron-LM's pretrain_bert.py uses both as they are: fixed specs
    without a query/key norm, so --qk-layernorm is refused; the norms follow
    ``config.normalization``)."""
    from megatron.core.models.bert import bert_layer_specs

    if args.qk_layernorm:
        raise FlagError("--qk-layernorm", "megatron-core's BERT layer specs have no query/key "
                        "norm (GPT only)")
    use_te = _choose_layer_spec(args, bert_layer_specs.HAVE_TE)
    _check_sequence_parallel_norm(args, use_te, bert_layer_specs.HAVE_APEX)
    if use_te:
        return bert_layer_specs.get_bert_layer_with_transformer_engine_spec()
    if args.layernorm_zero_centered_gamma and not bert_layer_specs.HAVE_APEX:
        raise FlagError("--apply-layernorm-1p", "needs transformer_engine's or apex's norms for "
                        "BERT: its LM head builds megatron-core's torch LayerNorm, which "
                        "refuses zero_centered_gamma")
    if bert_layer_specs.HAVE_APEX and args.normalization != "LayerNorm":
        raise FlagError("--normalization", f"{args.normalization} needs transformer_engine's "
                        "layers for BERT: the local BERT spec's apex FusedLayerNorm is "
                        "LayerNorm only")
    return bert_layer_specs.bert_layer_local_spec
