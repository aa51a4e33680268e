"""Mixture of Experts: megatron-core's MoE layers from Megatron-LM's flags, on every device.

What this module guarantees:
  * :func:`config_fields`: the TransformerConfig fields Megatron-LM's
    ``core_transformer_config_from_args`` sets from the MoE flags (``num_moe_experts`` from
    --num-experts, every other MoE flag by its own name).
  * :func:`close_gaps`: megatron-core 0.16.1's router runs without transformer-engine, and on
    the CPU runtime its alltoall dispatcher's split sizes reach gloo as numbers.
  * :func:`init_experts_by_global_index`: with CPU initialization each expert's weights are
    drawn from a generator seeded by (--seed, its layer, its global expert index), so an expert
    starts alike whatever the expert-parallel size and no two experts alike.

What is per microbatch lives with the schedules (:mod:`megatron_2bw.schedules.moe_microbatches`).
Why each is needed: docs/moe.md, "What megatron-core 0.16.1 needs on the CPU".
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["config_fields", "close_gaps", "init_experts_by_global_index", "is_moe",
           "moe_layers", "expert_seed"]

_FIELDS = ("moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
           "moe_shared_expert_gate", "moe_router_topk", "moe_router_score_function",
           "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
           "moe_router_group_topk", "moe_router_dtype", "moe_router_load_balancing_type",
           "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_enable_expert_bias",
           "moe_router_bias_update_rate", "moe_token_dispatcher_type",
           "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
           "moe_token_drop_policy", "moe_per_layer_logging", "moe_grouped_gemm",
           "moe_permute_fusion", "moe_router_fusion", "expert_model_parallel_size",
           "expert_tensor_parallel_size")
"""MoE flags whose dest is a TransformerConfig field of the same name."""


def is_moe(args_or_config) -> bool:
    """Whether the flags (``num_experts``) or the config (``num_moe_experts``) have experts."""
    return bool(getattr(args_or_config, "num_experts", None)
                or getattr(args_or_config, "num_moe_experts", None))


def config_fields(args: argparse.Namespace) -> dict:
    """TransformerConfig fields of the MoE flags (none for a dense model)."""
    if not is_moe(args):
        return {}
    fields = {name: getattr(args, name) for name in _FIELDS if hasattr(args, name)}
    fields["num_moe_experts"] = args.num_experts
    return fields


def close_gaps() -> None:
    """megatron-core 0.16.1's ``RouterGatingLinearFunction`` tests ``te_general_gemm is not
    None``, a name ``moe_utils`` defines only where transformer-engine imports: define it as
    None elsewhere (the router then runs torch's matmul); and where the CPU runtime is
    installed, its MoE part. Idempotent; harmless with TE."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_2bw.runtime import cpu

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if cpu.is_installed():
        cpu.install_moe()


def moe_layers(model: torch.nn.Module) -> list:
    """megatron-core's MoE layers of a model chunk, in module order."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    return [m for m in model.modules() if isinstance(m, BaseMoELayer)]


def expert_seed(seed: int, layer_number: int, expert: int) -> int:
    """The generator seed of global expert ``expert`` of layer ``layer_number`` (1-based, as
    megatron-core numbers layers)."""
    return (seed * 1_000_003 + layer_number * 10_007 + expert * 101 + 17) % (2 ** 63)


@torch.no_grad()
def init_experts_by_global_index(model: torch.nn.Module, config, seed: int) -> None:
    """Redraw every local expert's linear weights as megatron-core's CPU initialization draws
    a weight (``_initialize_affine_weight_cpu``: the whole master weight from the config's
    init method, this expert-tensor-parallel rank's slice copied), from a generator seeded by
    :func:`expert_seed` (fc1 with ``config.init_method``, fc2 with
    ``config.output_layer_init_method``; biases stay megatron-core's zeros). For CPU
    initialization only: on a GPU megatron-core draws experts from its expert-parallel RNG
    tracker, per rank already."""
    from megatron.core import parallel_state as ps

    etp = ps.get_expert_tensor_parallel_world_size()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    for layer in moe_layers(model):
        experts = getattr(layer.experts, "local_experts", None)
        if experts is None:
            raise RuntimeError(f"{type(layer.experts).__name__}: only SequentialMLP experts are "
                               "re-initialized by global index (CPU initialization)")
        for index, expert in zip(layer.local_expert_indices, experts):
            state = torch.get_rng_state()
            torch.manual_seed(expert_seed(seed, layer.layer_number, index))
            try:
                for linear, init in ((expert.linear_fc1, config.init_method),
                                     (expert.linear_fc2, config.output_layer_init_method)):
                    _draw(linear.weight, init, etp, etp_rank)
            finally:
                torch.set_rng_state(state)


def _draw(weight: torch.nn.Parameter, init, world: int, rank: int) -> None:
    """The master weight (the weight's shape times ``world`` along its partition dimension),
    drawn by ``init`` in fp32; this rank's slice copied into ``weight``."""
    dim = getattr(weight, "partition_dim", 0) if getattr(weight, "tensor_model_parallel",
                                                         False) else None
    shape = list(weight.shape)
    if dim is not None:
        shape[dim] *= world
    master = torch.empty(shape, dtype=torch.float)
    init(master)
    if dim is not None:
        master = master.chunk(world, dim=dim)[rank]
    weight.data.copy_(master.to(weight.dtype))


# ---- logging: the load-balancing losses per layer, as Megatron-LM logs them ------------------

def track_names(args: argparse.Namespace) -> list[str]:
    """The tracker's names Megatron-LM's training_log logs (core_v0.16.1): by
    --moe-router-load-balancing-type, and z_loss with --moe-z-loss-coeff."""
    kinds = args.moe_router_load_balancing_type
    kinds = kinds if isinstance(kinds, list) else [kinds]
    names = [name for kind, name in (("aux_loss", "load_balancing_loss"),
                                     ("seq_aux_loss", "seq_load_balancing_loss"),
                                     ("global_aux_loss", "global_load_balancing_loss"))
             if kind in kinds]
    return names + (["z_loss"] if args.moe_z_loss_coeff is not None else [])


def moe_metrics(args: argparse.Namespace, num_microbatches: int) -> dict[str, list[float]]:
    """Megatron-LM's ``track_moe_metrics`` (training_log, core_v0.16.1) up to its writing:
    each tracked loss per layer, summed over the pipeline stages, over its router's reduce
    group, averaged over data-parallel replicas where that group has none (megatron-core's
    ``reduce_aux_losses_tracker_across_ranks``; here with SUM all-reduces, as gloo has no
    AVG), times 1/m; then the tracker is cleared. A collective: every rank calls it, every
    iteration. Returns name -> the per-layer values (the logged value is their sum over the
    number of MoE layers: :func:`logged_value`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)

    tracker = get_moe_layer_wise_logging_tracker()
    device = next((e["values"].device for e in tracker.values()), torch.device("cpu"))
    out = {}
    for name in track_names(args):
        if name not in tracker:  # Megatron-LM's force_initialize
            tracker[name] = {"values": torch.zeros(args.num_layers, device=device),
                             "reduce_group": None, "avg_group": None,
                             "reduce_group_has_dp": False}
        entry = tracker[name]
        values = entry["values"].float().clone()
        dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
        if entry.get("reduce_group") is not None:
            dist.all_reduce(values, group=entry["reduce_group"])
            if not entry.get("reduce_group_has_dp", False):
                dp = ps.get_data_parallel_group()
                dist.all_reduce(values, group=dp)
                values /= dist.get_world_size(dp)
        if entry.get("avg_group") is not None:
            dist.all_reduce(values, group=entry["avg_group"])
            values /= dist.get_world_size(entry["avg_group"])
        out[name] = (values / num_microbatches).tolist()
    clear_aux_losses_tracker()
    return out


def num_moe_layers(args: argparse.Namespace) -> int:
    from megatron_2bw.arguments import moe_layer_pattern

    return sum(moe_layer_pattern(args.moe_layer_freq, args.num_layers))


def logged_value(args: argparse.Namespace, per_layer: list[float]) -> float:
    """What Megatron-LM logs for a tracked loss: its per-layer values' sum over the number of
    MoE layers."""
    return sum(per_layer) / num_moe_layers(args)
