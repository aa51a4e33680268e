"""Process groups, timeouts and seeding for one training process, on the device
:mod:`megatron_2bw.runtime.device` chose.

Invariants:
  * :func:`initialize` calls ``device.select_device`` (again) before ``init_process_group``:
    before any communicator or CUDA tensor exists.
  * Every group has a bounded wait: the default group and all megatron-core model-parallel
    groups get ``--distributed-timeout-minutes`` (:func:`timeout` reports it).
  * Every communicator exists before the first training step (:func:`create_communicators`):
    on CUDA ``init_process_group`` gets ``device_id``, and every group is used once at set-up,
    in creation order, the same on every rank (NCCL's lazy creation would otherwise block two
    stages whose first use of a group comes at different points of a schedule).

Why: docs/gpu.md, "The runtime, module by module".
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_2bw.runtime.device import DeviceChoice, select_device, training_device
from megatron_2bw.runtime.ports import free_port

__all__ = ["ProcessInfo", "initialize", "timeout", "is_rank_zero", "set_seed", "seeded_as_rank",
           "destroy", "create_communicators", "warm_up_pairs", "init_kwargs",
           "DEFAULT_TIMEOUT_MINUTES"]

DEFAULT_TIMEOUT_MINUTES = 10.0  # Megatron-LM's --distributed-timeout-minutes default


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the (DP, PP, TP) grid and what it runs on."""

    rank: int
    world_size: int
    device: str  # "cuda" or "cpu"
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int = 0


_timeout: datetime.timedelta | None = None  # set by initialize()


def timeout() -> datetime.timedelta:
    """The bound on every wait (``--distributed-timeout-minutes``) that :func:`initialize` gave
    the process groups; Megatron-LM's default (10 minutes) before it runs."""
    if _timeout is None:
        return datetime.timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)
    return _timeout


def is_rank_zero() -> bool:
    """Rank 0 of the job: torch.distributed's rank once a group exists, else torchrun's RANK."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def init_kwargs(choice: DeviceChoice, bound: datetime.timedelta) -> dict:
    """``init_process_group``'s arguments besides the rank and world size: on CUDA the device
    (``device_id``: eager NCCL initialisation; every ``new_group`` inherits the bound device and
    creates its communicator when it is created, not at its first use)."""
    kwargs = dict(backend=choice.backend, timeout=bound)
    if choice.kind == "cuda":
        kwargs["device_id"] = torch.device("cuda", choice.index)
    return kwargs


def _init_process_group(choice: DeviceChoice, bound: datetime.timedelta) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a plain single process: any free port will do
        if int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise RuntimeError("WORLD_SIZE > 1 without MASTER_PORT: launch with torchrun")
        os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        **init_kwargs(choice, bound),
    )


def _member_groups() -> list:
    """The process groups this rank belongs to, in the order they were created (torch's
    registry; every rank creates every group in the same order, so any two ranks' lists order
    their common groups alike). The default group comes first."""
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def _warm_up(group, device: torch.device) -> None:
    """One all-reduce of one element on ``group``: creates its communicator now."""
    one = torch.ones(1, device=device)
    dist.all_reduce(one, group=group)


def warm_up_pairs(stage: int, depth: int, ring: bool) -> list[tuple[int, int]]:
    """The pipeline neighbours (stage pairs) that exchange, in the order every stage visits
    its own: (s, s+1) for each stage, and (0, depth-1) where the stages form a ring (virtual
    stages). Sorted pairs: a total order, so the exchanges cannot wait on each other in a
    cycle. Only the pairs that contain ``stage``."""
    pairs = {(s, s + 1) for s in range(depth - 1)}
    if ring and depth > 2:
        pairs.add((0, depth - 1))
    return sorted(pair for pair in pairs if stage in pair)


def _warm_up_neighbours(device: torch.device) -> None:
    """One batched exchange (a send and a receive) with each pipeline neighbour on the
    pipeline group, as the schedules' exchanges are batched."""
    from megatron.core import parallel_state as ps

    depth = ps.get_pipeline_model_parallel_world_size()
    if depth == 1:
        return
    stage, group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    ring = (ps.get_virtual_pipeline_model_parallel_world_size() or 1) > 1
    for pair in warm_up_pairs(stage, depth, ring):
        peer = ranks[pair[0] if pair[1] == stage else pair[1]]
        mine, theirs = torch.ones(1, device=device), torch.empty(1, device=device)
        ops = [dist.P2POp(dist.isend, mine, peer, group),
               dist.P2POp(dist.irecv, theirs, peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def create_communicators(device: torch.device, groups: list | None = None) -> None:
    """Create every communicator of this rank before the first step: one all-reduce on each
    group it belongs to, in creation order (the same relative order on every rank), then one
    batched exchange with each pipeline neighbour. Each wait is bounded by the group's
    timeout. On CUDA the gloo groups are skipped (gloo connects when a group is created) and
    the NCCL groups exist already (``device_id``); the warm-up then costs a few microseconds
    per group. ``groups``: only these (a group made later, by every member at the same point),
    all-reduced on their own backend's device, and no exchange."""
    for group in _member_groups() if groups is None else groups:
        backend = dist.get_backend(group)
        if groups is None and device.type == "cuda" and backend == "gloo":
            continue
        _warm_up(group, device if backend != "gloo" else torch.device("cpu"))
    if groups is None:
        _warm_up_neighbours(device)


def set_seed(seed: int) -> None:
    """Megatron-LM's seeding: each pipeline stage gets its own seed (different layers), TP ranks
    share the default generator and differ in the tensor-parallel tracker's state."""
    from megatron.core import parallel_state as ps

    _seed_as_rank(seed, ps.get_pipeline_model_parallel_rank())


def _seed_as_rank(seed: int, pp_rank: int) -> None:
    """What :func:`set_seed` does on pipeline rank ``pp_rank`` (this process's TP rank)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * pp_rank
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


@contextlib.contextmanager
def seeded_as_rank(seed: int, pp_rank: int):
    """Within the block, the random state :func:`set_seed` gives pipeline rank ``pp_rank``
    (at this process's TP rank): torch's default generator, the device's generator on CUDA and
    megatron-core's RNG tracker (its model-parallel state draws GPU-initialized weights).
    Afterwards this process's own state, all three, as it was before the block."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    cuda = training_device() if training_device().type == "cuda" else None
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(cuda) if cuda is not None else None
    tracked = {name: state.clone() if torch.is_tensor(state) else state.clone_state()
               for name, state in tracker.get_states().items()}  # tensors, or Generators
    seeds = set(tracker.seeds_)  # megatron-core's check that no seed is added twice
    try:
        _seed_as_rank(seed, pp_rank)
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda_state, cuda)
        tracker.set_states(tracked)
        tracker.seeds_ = seeds


def _bound_every_group(bound: datetime.timedelta) -> None:
    """Give the default group and every group megatron-core recorded the bound. Needed:
    megatron-core 0.16.1 creates EXPERT_DATA_PARALLEL_GROUP_GLOO without its
    ``distributed_timeout_minutes`` (torch's 30-minute default). megatron-core's own helper;
    it runs a barrier over all ranks first."""
    from megatron.core import parallel_state as ps

    ps.update_pg_timeout(bound)


def initialize(tensor_parallel: int, pipeline_parallel: int, seed: int, force_cpu: bool = False,
               timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
               virtual_stages: int | None = None, expert_parallel: int = 1,
               expert_tensor_parallel: int | None = None) -> ProcessInfo:
    """Pick the device (set_device first on CUDA), start the default process group and
    megatron-core's model-parallel groups, all with ``timeout_minutes``; seed.
    ``virtual_stages`` (V model chunks per pipeline rank, None for one) is recorded in
    parallel_state, where megatron-core's ``get_forward_backward_func()`` reads it to choose
    its interleaved schedule. ``expert_parallel`` and ``expert_tensor_parallel`` (None: the
    tensor-parallel size) make megatron-core's expert groups (expert parallel, expert tensor
    parallel, expert data parallel and their products), created with the rest, in its order
    (tp-cp-ep-dp-pp: an expert-parallel group is ranks of one pipeline stage)."""
    from megatron.core import parallel_state as ps

    global _timeout
    choice = select_device(force_cpu)
    bound = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        _init_process_group(choice, bound)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_stages,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
        distributed_timeout_minutes=timeout_minutes,
    )
    _bound_every_group(bound)
    _timeout = bound
    create_communicators(training_device())
    set_seed(seed)
    return ProcessInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=choice.kind,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def destroy() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
