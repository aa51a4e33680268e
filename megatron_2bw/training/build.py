"""Megatron-core objects from validated flags: TransformerConfig, DDP-wrapped model chunks,
the optimizer and its learning-rate schedule. Model-agnostic: GPT and BERT pass a provider."""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable

import torch

from megatron_2bw.training import moe

__all__ = ["transformer_config", "build_model", "virtual_stages", "build_optimizer",
           "build_scheduler", "attach_config_hooks", "params_dtype", "scheduler_steps",
           "ddp_config", "forward_pre_hook_paused"]


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
    kv_channels, num_query_groups and add_qkv_bias hold Megatron-LM's derived values). The
    masked-softmax, RoPE and gradient-accumulation fusions follow Megatron-LM's flags on CUDA
    where their kernels import (:mod:`megatron_2bw.training.fusions`)."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = device == "cuda"
    dtype = params_dtype(args)
    fields = dict(
        **_architecture_fields(args, on_gpu),
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
        **_fusions(args, device),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        **_pipeline_p2p_fields(args, on_gpu),
        layernorm_zero_centered_gamma=getattr(args, "layernorm_zero_centered_gamma", False),
        cross_entropy_loss_fusion=getattr(args, "cross_entropy_loss_fusion", False),
        calculate_per_token_loss=getattr(args, "calculate_per_token_loss", False),
        **_activation(args, on_gpu),
        **moe.config_fields(args),
    )
    if on_gpu:  # Megatron-LM's GPU-only flags, given: copied as Megatron-LM copies them
        from megatron_2bw.megatron_lm_flags import cuda_config_fields

        fields.update(cuda_config_fields(args))
    placement = _placement(args)
    if placement.shape == "loop":
        fields.update(_layout_fields(args))
    fields.update(overrides)
    config = _config_or_flag_error(TransformerConfig, fields)
    _number_layers_by_placement(args, config, placement)
    return config


def _architecture_fields(args: argparse.Namespace, on_gpu: bool) -> dict:
    """The model's shape, attention and norms (``transformer_config``'s first fields)."""
    return dict(
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
    )


def _pipeline_p2p_fields(args: argparse.Namespace, on_gpu: bool) -> dict:
    """Virtual stages and how the pipeline's sends run and free their outputs."""
    overlap_p2p = getattr(args, "overlap_p2p_comm", False)
    return dict(
        # core_transformer_config_from_args: "batch_p2p_comm = not args.overlap_p2p_comm"
        # (overlap_p2p_comm is on only with virtual stages)
        virtual_pipeline_model_parallel_size=getattr(
            args, "virtual_pipeline_model_parallel_size", None),
        overlap_p2p_comm=overlap_p2p,
        batch_p2p_comm=not overlap_p2p,
        # Megatron-LM frees each sent output's storage (keeping its grad_fn) right after the
        # send is issued. With overlapped p2p the send is still in flight then; CUDA's caching
        # allocator keeps the memory for the stream, but gloo would send the freed storage.
        deallocate_pipeline_outputs=on_gpu or not overlap_p2p,
    )


def _config_or_flag_error(config_class, fields: dict):
    """TransformerConfig(**fields); for a MoE model a rule of its own megatron-core checks there
    that megatron_2bw.arguments does not mirror becomes a one-line FlagError."""
    if not fields.get("num_moe_experts"):
        return config_class(**fields)
    from megatron_2bw.flag_types import FlagError

    try:
        return config_class(**fields)
    except (ValueError, AssertionError) as error:
        text = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise FlagError("--num-experts", f"megatron-core's TransformerConfig refuses these MoE "
                        f"flags: {text}") from None


def _placement(args: argparse.Namespace):
    from megatron_2bw.schedules import placement_of

    return placement_of(getattr(args, "pipeline_schedule", "flush"),
                        args.pipeline_model_parallel_size, virtual_stages(args))


def _layout_fields(args: argparse.Namespace) -> dict:
    """Megatron-LM's uneven-split flags as ``core_transformer_config_from_args`` passes them
    (--decoder-first/last-pipeline-num-layers -> num_layers_in_first/last_pipeline_stage, the
    others by their own names): in the loop megatron-core places the layers itself."""
    return dict(
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers",
                                                   None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers",
                                                  None),
        account_for_embedding_in_pipeline_split=getattr(
            args, "account_for_embedding_in_pipeline_split", False),
        account_for_loss_in_pipeline_split=getattr(
            args, "account_for_loss_in_pipeline_split", False),
        pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout", None))


def _number_layers_by_placement(args: argparse.Namespace, config, placement) -> None:
    """Under zb-v and dualpipev, megatron-core builds and numbers the chunks' layers (and so
    keys them in checkpoints) by the V placement and its split, not its interleaved placement
    (:mod:`.layer_numbers`)."""
    from megatron_2bw.schedules import LayerSplit
    from megatron_2bw.training.layer_numbers import number_layers_by

    counts = getattr(args, "pipeline_layer_split", None)
    layers = (LayerSplit(tuple(counts), placement.depth) if counts is not None
              else LayerSplit.even(args.num_layers, placement.depth, placement.chunks))
    number_layers_by(config, placement, layers)


_noted: set[str] = set()  # notes printed once per process


def _fusions(args: argparse.Namespace, device: str) -> dict:
    """:func:`~megatron_2bw.training.fusions.fusion_fields` for this process's kernels; each
    note printed once, on rank 0."""
    from megatron_2bw.training.fusions import FusionKernels, fusion_fields

    kernels = FusionKernels.probe() if device == "cuda" else None
    fields, notes = fusion_fields(args, device, kernels)
    for note in notes:
        _note_once(note)
    return fields


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


def virtual_stages(args: argparse.Namespace) -> int:
    """V, the model chunks per pipeline rank (1 without virtual pipeline stages)."""
    return getattr(args, "virtual_pipeline_model_parallel_size", None) or 1


def build_model(args: argparse.Namespace, config, provider: Callable) -> list:
    """This pipeline rank's model chunks as Megatron-LM's ``get_model`` builds them
    (megatron/training/training.py at core_v0.16.1), each DDP-wrapped, on the training device
    (moved to ``cuda:<LOCAL_RANK>`` on CUDA; built in place on the CPU, ``--cpu`` on a GPU host
    included).

    Without virtual stages: one chunk, ``provider(config, pre_process, post_process)`` with
    pre_process on the first and post_process on the last pipeline stage. With V virtual
    stages: V chunks, chunk i built by ``provider(config, pre_process, post_process,
    vp_stage=i)``; it is virtual stage i x PP + (PP rank), its layers placed by megatron-core's
    ``get_transformer_layer_offset``; only chunk 0 of the first rank pre-processes (the
    embedding) and only chunk V-1 of the last rank post-processes (output layer and loss).
    Under zb-v and dualpipev (the V placement, ``schedules.Placement``) both are rank 0's:
    its chunk 0 embeds and its chunk 1 holds the output layer and the loss; chunk 1's layers
    are numbered as stage 2d-1-i's (``transformer_config``: ``layer_numbers``). Their chunks
    start from flush's weights at the same --seed (:func:`_v_chunks_as_flush`).
    Each chunk has its own DDP wrapper; chunks after the first, and all of them with
    --overlap-param-gather-with-optimizer-step, hold one bucket (Megatron-LM's
    ``disable_bucketing``: their communication overlaps with compute anyway).
    """
    from megatron.core.distributed import DistributedDataParallel

    from megatron_2bw.schedules import V_SCHEDULES

    if getattr(args, "pipeline_schedule", "flush") in V_SCHEDULES:
        modules = _v_chunks_as_flush(args, config, provider)
    else:
        modules = [_model_chunk(args, config, provider, stage) for stage in _chunk_stages(args)]
    if moe.is_moe(config) and config.use_cpu_initialization:
        for module in modules:  # experts by global index, not by expert-parallel rank
            moe.init_experts_by_global_index(module, config, args.seed)
    ddp = ddp_config(args, modules)
    one_bucket = getattr(args, "overlap_param_gather_with_optimizer_step", False)
    chunks = []
    for index, module in enumerate(modules):
        wrapped = DistributedDataParallel(config, ddp, module,
                                          disable_bucketing=index > 0 or one_bucket)
        wrapped.broadcast_params()  # DP replicas start from identical weights
        chunks.append(wrapped)
    return chunks


def _chunk_stages(args: argparse.Namespace) -> list[int | None]:
    """The vp_stage of each chunk this rank builds: [None] without virtual stages."""
    V = virtual_stages(args)
    return [None] if V == 1 else list(range(V))


def _v_chunks_as_flush(args: argparse.Namespace, config, provider: Callable) -> list:
    """This rank's two chunks under the V placement (rank i: virtual stages i and 2d-1-i),
    with the initial weights flush gives those layers at the same --seed and d.

    Flush's rank r holds virtual stages 2r and 2r+1 (the same layers; the embedding on stage
    0, the final norm and output layer on stage 2d-1) and builds them as one model from its
    seed (``runtime.distributed.set_seed``): the embedding, the layers in order, the output
    layer, each drawing from the generators in that order. So stage s is built here under
    rank r = s // 2's seeding (``distributed.seeded_as_rank``), and for an odd s right after
    stage 2r, built and dropped when this rank does not hold it (a transient chunk). Every
    draw, CPU or GPU initialization, TP ranks included, then equals flush's; this rank's own
    random state (dropout) is left as it was before."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.runtime import distributed
    from megatron_2bw.schedules import Placement
    from megatron_2bw.training.layer_numbers import building_virtual_stage

    depth, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    placement = Placement.v(depth)
    chunk_of = {placement.virtual(rank, chunk): chunk for chunk in range(placement.chunks)}
    built = {}
    for owner in sorted({stage // 2 for stage in chunk_of}):
        with distributed.seeded_as_rank(args.seed, owner):
            for stage in range(2 * owner, max(s for s in chunk_of if s // 2 == owner) + 1):
                if stage in chunk_of:
                    built[stage] = _model_chunk(args, config, provider, chunk_of[stage])
                else:  # flush's rank `owner` draws its weights first: advance as it does
                    with _model_fits(args):
                        provider(building_virtual_stage(config, stage),
                                 pre_process=stage == 0, post_process=False, vp_stage=0)
    return [built[stage] for stage in sorted(chunk_of, key=chunk_of.get)]


def _cast_by_placement(wrapper, first: bool, last: bool) -> None:
    """megatron-core's ``Float16Module`` casts the inputs of the loop placement's first chunk
    to half precision and the outputs of its last (rank d-1's last chunk) to fp32. Under the V
    the last stage is rank 0's second chunk and rank d-1's second chunk is mid-pipeline (its
    output goes on, in half precision): this chunk's casts follow the placement instead."""
    from megatron.core.transformer.module import float16_to_fp32, fp32_to_float16

    def forward(*inputs, fp32_output=True, **kwargs):
        if first:
            inputs = fp32_to_float16(inputs, wrapper.float16_convertor)
        outputs = wrapper.module(*inputs, **kwargs)
        return float16_to_fp32(outputs) if last and fp32_output else outputs

    wrapper.forward = forward


def _model_chunk(args: argparse.Namespace, config, provider: Callable, vp_stage: int | None):
    """One bare chunk (in a Float16Module with fp16/bf16) on the training device; with virtual
    stages it carries Megatron-LM's ``vp_stage`` attribute."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.runtime.device import training_device

    from megatron_2bw.schedules import placement_of

    placement = placement_of(getattr(args, "pipeline_schedule", "flush"),
                             ps.get_pipeline_model_parallel_world_size(), virtual_stages(args))
    stage = ps.get_pipeline_model_parallel_rank()
    first, last = ((ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()) if vp_stage is None
                   else (placement.is_first(stage, vp_stage), placement.is_last(stage, vp_stage)))
    with _model_fits(args):
        if vp_stage is None:
            model = provider(config, pre_process=first, post_process=last)
        else:
            model = provider(config, pre_process=first, post_process=last, vp_stage=vp_stage)
            model.vp_stage = vp_stage
    if config.params_dtype != torch.float32 or config.fp16 or config.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
        if placement.shape == "v":
            _cast_by_placement(model, first, last)
    device = training_device()
    if device.type == "cuda":
        model.cuda(device)
    return model


def ddp_config(args: argparse.Namespace, model: torch.nn.Module | list):
    """megatron-core's DistributedDataParallelConfig as Megatron-LM's ``get_model`` builds it
    (megatron/training/training.py at core_v0.16.1): every config field named like a flag,
    then grad_reduce_in_fp32 from --accumulate-allreduce-grads-in-fp32, the bucket size from
    --ddp-num-buckets (the parameters of this rank's chunks, ``model`` one bare chunk or a list
    of them, / N) or --ddp-bucket-size, defaulting to max(40M, 1M x data-parallel size) with
    --overlap-grad-reduce and to one bucket without it.

    Unlike Megatron-LM, check_for_nan_in_grad stays off: the run guard checks the loss and the
    gradient norm every iteration and ends every rank with one line (megatron-core's check
    would raise on one rank inside backward instead)."""
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(
        DistributedDataParallelConfig) if hasattr(args, f.name)}
    fields.update(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        check_for_nan_in_grad=False,
        check_for_large_grads=args.check_for_large_grads,
        pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
        reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
        average_in_collective=args.ddp_average_in_collective,
        bucket_size=args.ddp_bucket_size,
    )
    if args.ddp_num_buckets is not None:
        chunks = model if isinstance(model, list) else [model]
        parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        fields["bucket_size"] = parameters // args.ddp_num_buckets
    config = DistributedDataParallelConfig(**fields)
    if config.bucket_size is None:
        config.bucket_size = max(40_000_000, 1_000_000 * ps.get_data_parallel_world_size(
            with_context_parallel=True))
    if not config.overlap_grad_reduce:
        config.bucket_size = None
    return config


@contextlib.contextmanager
def _model_fits(args: argparse.Namespace):
    """A model that cannot be allocated (sizes beyond memory, or beyond an index) raises
    FlagError naming the size flags, not the allocator's traceback."""
    from megatron_2bw.flag_types import FlagError

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
        # the input embedding and output layer's own schedule (megatron-core's
        # get_standard_config_overrides: params with is_embedding_or_output_parameter)
        decoupled_lr=getattr(args, "decoupled_lr", None),
        decoupled_min_lr=getattr(args, "decoupled_min_lr", None),
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        overlap_param_gather_with_optimizer_step=args.overlap_param_gather_with_optimizer_step,
        **{name: getattr(args, name) for name in _MUON_FIELDS if hasattr(args, name)},
    )
    if args.optimizer == "muon":
        from megatron_2bw.training.muon import build_muon_optimizer, which_muon

        layer_wise = getattr(args, "use_layer_wise_distributed_optimizer", False)
        _note_once(f" --optimizer muon: {which_muon()}"
                   + (", state sharded by layer over the data-parallel ranks" if layer_wise
                      else ""))
        optimizer = build_muon_optimizer(config, model, layer_wise)
    else:
        optimizer = _unchained(get_megatron_optimizer(config, model))
    if all(p.device.type == "cpu" for chunk in model for p in chunk.parameters()):
        _fused_cpu_adam(optimizer)
    return optimizer


_MUON_FIELDS = ("muon_momentum", "muon_split_qkv", "muon_use_nesterov", "muon_scale_mode",
                "muon_fp32_matmul_prec", "muon_num_ns_steps", "muon_tp_mode",
                "muon_extra_scale_factor")
"""OptimizerConfig's Muon fields, named as Megatron-LM's --muon-* flags' destinations."""


def _note_once(note: str) -> None:
    """Print ``note`` once per process, on rank 0."""
    if note not in _noted and (not torch.distributed.is_initialized()
                               or torch.distributed.get_rank() == 0):
        print(note, flush=True)
    _noted.add(note)


def _fused_cpu_adam(optimizer) -> None:
    """Step torch's Adam/AdamW inside megatron-core's wrappers with its fused CPU kernel.

    Without apex or transformer-engine megatron-core builds ``torch.optim.AdamW`` with torch's
    defaults, and on the CPU those step parameter by parameter (foreach and fused are
    CUDA-only defaults): 25 ms per step for 3.5M parameters on one core, against 4 ms fused,
    the same update to within float rounding (about 1e-10). A step pre-hook sets it before
    every step, so a checkpoint's loaded param groups cannot turn it off."""

    def fused(torch_optimizer, args, kwargs):
        for group in torch_optimizer.param_groups:
            group["fused"], group["foreach"] = True, False

    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(member, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            inner.register_step_pre_hook(fused)


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

    from megatron_2bw.training.specs import use_transformer_engine

    name = getattr(args, "attention_backend", "auto")
    use_te, why = use_transformer_engine(getattr(args, "transformer_impl", "local"), HAVE_TE,
                                         on_gpu)
    if not use_te and name not in ("auto", "local"):
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f" --attention-backend {name}: a transformer_engine kernel, not used ({why}); "
                  "megatron-core's attention runs", flush=True)
        name = "auto"
    return AttnBackend[name]


def scheduler_steps(args: argparse.Namespace) -> dict:
    """The schedule's lengths in samples, as Megatron-LM's ``get_optimizer_param_scheduler``
    (megatron/training/training.py at core_v0.16.1) computes them: iteration flags times
    --global-batch-size with --train-iters, the sample flags as given with --train-samples;
    a --lr-warmup-fraction of the decay length with either."""
    B = args.global_batch_size
    if args.train_samples is None:
        decay, total = args.lr_decay_iters * B, args.train_iters * B
        warmup = args.lr_warmup_iters * B
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * B
    else:
        decay, total = args.lr_decay_samples, args.train_samples
        warmup, wsd = args.lr_warmup_samples, args.lr_wsd_decay_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return dict(lr_warmup_steps=warmup, lr_decay_steps=decay, wd_incr_steps=total,
                wsd_decay_steps=wsd)


def build_scheduler(args: argparse.Namespace, optimizer):
    """Linear warm-up from 0 to --lr, then --lr-decay-style down to --min-lr; counted in
    samples and stepped by each iteration's global batch (its current size under
    --rampup-batch-size), as in Megatron-LM, so its checkpointed state is Megatron-LM's."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_style="constant",
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        **scheduler_steps(args),
    )


def attach_config_hooks(config, model: list, optimizer, align_grad_reduce: bool = True) -> None:
    """The hooks megatron-core's schedules read from the config, set as Megatron-LM's
    ``train`` sets them (megatron/training/training.py at core_v0.16.1) from the chunks'
    DistributedDataParallelConfig and --align-grad-reduce: loss scaling, grad finalization,
    and the DDP hooks, one per model chunk (a list with virtual stages; the one chunk's own
    function without). ``no_sync_func`` holds back the bucket reductions of all but the last
    microbatch; with --overlap-grad-reduce and --align-grad-reduce, ``grad_sync_func``
    (``start_grad_sync``) launches them after the chunk's last backward pass on every pipeline
    stage but the first (which launches them during it); with --overlap-param-gather and
    --align-param-gather (on only with virtual stages), ``param_sync_func``
    (``start_param_sync``) lets the interleaved schedule launch each chunk's parameter
    all-gathers ahead of its first forward; without virtual stages the DDP forward pre-hooks
    launch them."""
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(name: str):
        functions = [getattr(chunk, name) for chunk in model]
        return functions[0] if len(functions) == 1 else functions

    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = per_chunk("no_sync")
    ddp = model[0].ddp_config
    if ddp.overlap_grad_reduce and align_grad_reduce:
        config.grad_sync_func = per_chunk("start_grad_sync")
    if ddp.overlap_param_gather and ddp.align_param_gather:
        config.param_sync_func = per_chunk("start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads


@contextlib.contextmanager
def forward_pre_hook_paused(model: list):
    """Around an evaluation or a checkpoint save (Megatron-LM's ``disable_forward_pre_hook`` /
    ``enable_forward_pre_hook``, its ``should_disable_forward_pre_hook`` case: the distributed
    optimizer with --overlap-param-gather, where the DDP chunks all-gather the updated
    parameters from forward pre-hooks): the last step's all-gather is completed synchronously,
    on every data-parallel rank at the same point of the loop, and the hooks are off until the
    block ends. A no-op for chunks without those hooks."""
    paused = [chunk for chunk in model if getattr(chunk, "use_forward_hook", False)]
    for chunk in paused:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in paused:
            chunk.enable_forward_pre_hook()
