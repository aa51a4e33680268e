"""Megatron-core objects from validated flags: TransformerConfig, DDP-wrapped model chunks,
the optimizer and its learning-rate schedule. Model-agnostic: GPT and BERT pass a provider."""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable

import torch

__all__ = ["transformer_config", "build_model", "build_optimizer", "build_scheduler",
           "attach_config_hooks", "params_dtype"]


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return torch.float32


def transformer_config(args: argparse.Namespace, device: str, **overrides):
    """The TransformerConfig Megatron-LM would build from these flags (its
    ``core_transformer_config_from_args``, megatron/training/arguments.py at core_v0.16.1:
    flags named like a config field are copied, GQA and the activation are translated), with
    fused kernels off on the CPU. ``args`` went through ``validate_args`` (ffn_hidden_size,
    kv_channels, num_query_groups and add_qkv_bias hold Megatron-LM's derived values)."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = device == "cuda"
    dtype = params_dtype(args)
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels,
        # "if args.group_query_attention: kw_args['num_query_groups'] = args.num_query_groups
        #  else: kw_args['num_query_groups'] = None"
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        attention_backend=_attention_backend(args, on_gpu),
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        deallocate_pipeline_outputs=True,
        **_activation(args, on_gpu),
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _activation(args: argparse.Namespace, on_gpu: bool) -> dict:
    """The MLP's activation fields as ``core_transformer_config_from_args`` sets them:
    --swiglu -> SiLU with a gated linear unit, --squared-relu -> megatron-core's squared_relu,
    GeLU otherwise. --openai-gelu is Megatron-LM's legacy-model flag (its core path ignores
    it); here it picks megatron-core's ``openai_gelu`` as the legacy MLP did. The bias+activation
    fusion exists for GeLU with a bias and for SwiGLU (Megatron-LM turns bias_gelu_fusion off
    with --disable-bias-linear), on CUDA only."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.utils import openai_gelu

    if args.swiglu:
        return dict(activation_func=F.silu, gated_linear_unit=True,
                    bias_activation_fusion=on_gpu)
    if args.squared_relu:
        return dict(activation_func=squared_relu, bias_activation_fusion=False)
    if args.openai_gelu:
        return dict(activation_func=openai_gelu, bias_activation_fusion=False)
    return dict(activation_func=F.gelu, bias_activation_fusion=on_gpu and args.add_bias_linear)


def build_model(args: argparse.Namespace, config, provider: Callable) -> list:
    """One DDP-wrapped model chunk for this pipeline stage, on the training device (moved to
    ``cuda:<LOCAL_RANK>`` on CUDA; built in place on the CPU, ``--cpu`` on a GPU host included).

    ``provider(config, pre_process, post_process)`` returns the bare megatron-core model.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_2bw.runtime.distributed import training_device

    with _model_fits(args):
        model = provider(config, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage())
    if config.params_dtype != torch.float32 or config.fp16 or config.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    device = training_device()
    if device.type == "cuda":
        model.cuda(device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    wrapped = DistributedDataParallel(config, ddp_config, model)
    wrapped.broadcast_params()  # DP replicas start from identical weights
    return [wrapped]


@contextlib.contextmanager
def _model_fits(args: argparse.Namespace):
    """A model that cannot be allocated (sizes beyond memory, or beyond an index) raises
    FlagError naming the size flags, not the allocator's traceback."""
    from megatron_2bw.arguments import FlagError

    try:
        yield
    except (MemoryError, OverflowError, torch.OutOfMemoryError, RuntimeError) as error:
        text = str(error)
        if isinstance(error, RuntimeError) and not isinstance(error, torch.OutOfMemoryError) \
                and "allocate" not in text:
            raise
        reason = text.strip().splitlines()[0][:160] if text.strip() else type(error).__name__
        raise FlagError("--num-layers/--hidden-size", f"this stage's model ({args.num_layers} "
                        f"layers of hidden size {args.hidden_size}, "
                        f"{args.max_position_embeddings} positions, TP="
                        f"{args.tensor_model_parallel_size} PP="
                        f"{args.pipeline_model_parallel_size}) cannot be allocated here "
                        f"({reason}): use a smaller model or more model parallelism") from None


def build_optimizer(args: argparse.Namespace, model: list):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return _unchained(get_megatron_optimizer(config, model))


def _unchained(optimizer):
    """The one inner optimizer of a single-member ChainedOptimizer.

    megatron-core wraps even a single optimizer in a ChainedOptimizer, whose step() all-reduces
    the gradient norm over the model-parallel group (every pipeline stage) although nothing
    reads it without clipping. That collective syncs all stages at each step, which stalls
    2BW's pipeline by (d-1) backward passes per batch. The inner optimizer computes the norm
    only when --clip-grad > 0."""
    from megatron.core.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer) and len(optimizer.chained_optimizers) == 1:
        return optimizer.chained_optimizers[0]
    return optimizer


def _attention_backend(args: argparse.Namespace, on_gpu: bool):
    """--attention-backend; transformer_engine's kernels (flash, fused, unfused) exist only
    with its layer spec: elsewhere (the CPU, the local spec) megatron-core's own attention runs
    (``auto``; said on rank 0)."""
    from megatron.core.models.gpt.gpt_layer_specs import HAVE_TE
    from megatron.core.transformer.enums import AttnBackend

    from megatron_2bw.entry import use_transformer_engine

    name = getattr(args, "attention_backend", "auto")
    use_te, why = use_transformer_engine(getattr(args, "transformer_impl", "local"), HAVE_TE,
                                         on_gpu)
    if not use_te and name not in ("auto", "local"):
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f" --attention-backend {name}: a transformer_engine kernel, not used ({why}); "
                  "megatron-core's attention runs", flush=True)
        name = "auto"
    return AttnBackend[name]


def warmup_iterations(args: argparse.Namespace) -> float:
    """--lr-warmup-iters, or Megatron-LM's --lr-warmup-fraction of the decay iterations."""
    fraction = getattr(args, "lr_warmup_fraction", None)
    return args.lr_warmup_iters if fraction is None else fraction * args.lr_decay_iters


def build_scheduler(args: argparse.Namespace, optimizer):
    """Linear warm-up from 0 to --lr over --lr-warmup-iters, then --lr-decay-style down to
    --min-lr at --lr-decay-iters; stepped once per iteration."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_iterations(args),
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
    )


def attach_config_hooks(config, model: list, optimizer) -> None:
    """The hooks megatron-core's schedules read from the config, set as Megatron-LM's
    training loop sets them (loss scaling, no_sync, grad finalization)."""
    from megatron.core.distributed import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
