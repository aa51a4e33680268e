"""megatron-core's LayerWiseDistributedOptimizer (--optimizer dist_muon) where 0.16.1 does not
run here: its uneven all-gather (gloo gathers equal parts only) and its checkpoint of fp32
members (it reads every member's state under "optimizer", where only the mixed-precision
optimizer keeps it). Each data-parallel rank steps whole parameters and all-gathers them
after the step; both fixes keep that, and the values each parameter gets.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["adapt", "gather_padded", "sharded_state_dict"]


def adapt(optimizer) -> None:
    """Give ``optimizer`` (a LayerWiseDistributedOptimizer) the two fixes."""
    optimizer.sharded_state_dict = functools.partial(sharded_state_dict, optimizer)
    group = optimizer.pg_collection.dp_cp if optimizer.pg_collection is not None else None
    if group is not None and torch.distributed.get_backend(group) == "gloo":
        optimizer.allgather_params = functools.partial(gather_padded, optimizer)


@torch.no_grad()
def gather_padded(optimizer) -> None:
    """``allgather_params`` with each rank's parameters padded to the largest rank's: one
    all-gather of equal parts per group (megatron-core's parts differ in size, which NCCL
    gathers and gloo refuses)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for owned, group in ((optimizer.dp_cp_params_list, optimizer.pg_collection.dp_cp),
                         (optimizer.expt_dp_params_list, optimizer.pg_collection.expt_dp)):
        if not owned:
            continue
        rank = torch.distributed.get_rank(group)
        sizes = [sum(p.numel() for p in params) for params in owned]
        first = next(p for params in owned for p in params)
        part = torch.zeros(max(sizes), dtype=first.dtype, device=first.device)
        if owned[rank]:
            part[:sizes[rank]] = _flatten_dense_tensors(owned[rank])
        parts = [torch.empty_like(part) for _ in owned]
        torch.distributed.all_gather(parts, part, group=group)
        for index, (flat, params) in enumerate(zip(parts, owned)):
            if index == rank or not params:
                continue
            for new, p in zip(_unflatten_dense_tensors(flat[:sizes[index]], params), params):
                p.data.copy_(new)


def sharded_state_dict(optimizer, model_sharded_state_dict, is_loading: bool = False,
                       **kwargs):
    """LayerWiseDistributedOptimizer.sharded_state_dict with each member's optimizer state
    found where the member keeps it (under "optimizer" with bf16, the dict itself in fp32).
    As megatron-core's: every tensor is saved by the rank that steps it (replica 0 on every
    data-parallel rank, each holding only its own), and each parameter group's settings come
    from a rank whose group is not empty (one all_gather_object per group over the world)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
    from megatron.core.optimizer import ChainedOptimizer

    sharded = ChainedOptimizer.sharded_state_dict(optimizer, model_sharded_state_dict,
                                                  is_loading, **kwargs)
    for base in nested_values(sharded):
        if hasattr(base, "replica_id"):
            base.replica_id = 0 if isinstance(base.replica_id, int) else \
                (*base.replica_id[:2], 0)
    per_member = {1: sharded} if len(optimizer.chained_optimizers) == 1 else sharded
    for member in per_member.values():
        if "fp32_from_fp16_params" in member:
            member["fp32_from_fp16_params"] = {
                i: group if group else LocalNonpersistentObject(group)
                for i, group in enumerate(member["fp32_from_fp16_params"])}
        state = member.get("optimizer", member)
        if not state["state"]:
            state["state"] = LocalNonpersistentObject(state["state"])
        for i, group in enumerate(state["param_groups"]):
            local_params = group.pop("params")
            group["params"] = bool(local_params.unwrap())
            every_rank = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every_rank, group)
            settings = next((g for g in every_rank if g["params"]), group)
            settings["params"] = local_params
            state["param_groups"][i] = settings
    return sharded
