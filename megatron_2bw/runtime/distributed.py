"""Process groups, device choice and seeding for one training process.

The device is chosen once, by :func:`megatron_2bw.runtime.cpu.select_device`: CUDA with NCCL
whenever CUDA is usable (unless ``--cpu``), else CPU processes over gloo with the CPU runtime.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_2bw.runtime import cpu

__all__ = ["ProcessInfo", "initialize", "set_seed", "destroy"]


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the (DP, PP, TP) grid and what it runs on."""

    rank: int
    world_size: int
    device: str  # "cuda" or "cpu"
    tp_rank: int
    pp_rank: int
    dp_rank: int


def _init_process_group(device: str, timeout_minutes: float) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )


def set_seed(seed: int) -> None:
    """Megatron-LM's seeding: each pipeline stage gets its own seed (different layers), TP ranks
    share the default generator and differ in the tensor-parallel tracker's state."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def initialize(tensor_parallel: int, pipeline_parallel: int, seed: int, force_cpu: bool = False,
               timeout_minutes: float = 10.0) -> ProcessInfo:
    """Pick the device, start the process group and megatron-core's model-parallel groups."""
    from megatron.core import parallel_state as ps

    device = cpu.select_device(force_cpu)
    if device == "cpu":
        cpu.install(force=force_cpu)
    if not dist.is_initialized():
        _init_process_group(device, timeout_minutes)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    set_seed(seed)
    return ProcessInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=device,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def destroy() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
