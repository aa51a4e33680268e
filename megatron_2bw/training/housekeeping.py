"""What Megatron-LM's training loop does around each iteration besides training (its
megatron/training/training.py at core_v0.16.1): --manual-gc, --empty-unused-memory-level,
--profile and --check-weight-hash-across-dp-replicas-interval. The loop calls
:meth:`Housekeeping.after_forward_backward`, :meth:`after_optimizer_step` and
:meth:`after_iteration` in that order every iteration, wraps evaluations in :meth:`evaluating`
and calls :meth:`close` once at the end."""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
from typing import Callable

import torch

from megatron_2bw.training.guard import Divergence

__all__ = ["Housekeeping", "ReplicasDiffer", "replica_mismatches"]


class ReplicasDiffer(Divergence):
    """Data-parallel replicas hold different weights; every rank raises it with one line."""


class Housekeeping:
    """Invariant: with --manual-gc the automatic collector stays disabled from construction to
    :meth:`close`; a torch profiler, when one runs, is stepped once per iteration."""

    def __init__(self, args: argparse.Namespace, rank: int, device: str,
                 say: Callable[[str], None]):
        self.args, self.on_cuda, self.device, self.say = args, device == "cuda", device, say
        if args.empty_unused_memory_level > 0 and not self.on_cuda:
            say(" note: --empty-unused-memory-level has no effect on CPU (frees the CUDA "
                "caching allocator's unused blocks); ignored")
        if args.manual_gc:  # "Disable the default garbage collector and collect manually."
            gc.disable()
            gc.collect()
        self.profiler = None
        profiled = args.profile and rank in args.profile_ranks
        if profiled and args.use_pytorch_profiler:
            self.profiler = _torch_profiler(args)
            self.profiler.start()
        elif profiled and not self.on_cuda:
            say(" note: --profile without --use-pytorch-profiler has no effect on CPU (starts "
                "the CUDA profiler for nsys); ignored")
        self._cuda_profiling = profiled and not args.use_pytorch_profiler and self.on_cuda

    def _empty_cache(self, level: int) -> None:
        if self.on_cuda and self.args.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    def after_forward_backward(self) -> None:
        self._empty_cache(1)

    def after_optimizer_step(self) -> None:
        self._empty_cache(2)

    def after_iteration(self, iteration: int) -> None:
        """Profiler step (or the CUDA profiler's start/stop for nsys) and the periodic
        collection, as Megatron-LM's loop does after iteration ``iteration``."""
        a = self.args
        if self.profiler is not None:
            self.profiler.step()
            if iteration == a.profile_step_end:
                self.close_profiler()
        elif self._cuda_profiling and iteration == a.profile_step_start:
            torch.cuda.cudart().cudaProfilerStart()
        elif self._cuda_profiling and iteration == a.profile_step_end:
            torch.cuda.cudart().cudaProfilerStop()
        if a.manual_gc and a.manual_gc_interval != 0 and iteration % a.manual_gc_interval == 0:
            gc.collect()

    def check_replicas(self, model: list, iteration: int) -> None:
        """--check-weight-hash-across-dp-replicas-interval: every rank compares its weights'
        hashes with its data-parallel replicas' (Megatron-LM's check, its
        ``check_param_hashes_across_dp_replicas`` with cross_check, on the training device
        instead of ``.cuda()``), after the pending parameter all-gather of
        --overlap-param-gather; raises :class:`ReplicasDiffer` on every rank when any replica
        group differs. Under 2bw the hashed tensors are the version the parameters point at,
        the same on every replica (they run the same actions)."""
        from megatron_2bw.training import build

        interval = self.args.check_weight_hash_across_dp_replicas_interval
        if interval is None or iteration % interval != 0:
            return
        with build.forward_pre_hook_paused(model):
            differing = replica_mismatches(model, self.device)
        if differing:
            raise ReplicasDiffer(f"weights differ across data-parallel replicas after iteration "
                                 f"{iteration} ({differing})")
        self.say(f" weight hashes match across data-parallel replicas after iteration "
                 f"{iteration}")

    @contextlib.contextmanager
    def evaluating(self):
        """A full collection before an evaluation and a young-generation one after it
        (--manual-gc without --no-manual-gc-eval); the cache emptied after it (level >= 1)."""
        collect = self.args.manual_gc and self.args.manual_gc_eval
        if collect:
            gc.collect()
        yield
        self._empty_cache(1)
        if collect:
            gc.collect(generation=0)

    def close_profiler(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def close(self) -> None:
        self.close_profiler()
        if self.args.manual_gc:
            gc.enable()


def _torch_profiler(args: argparse.Namespace):
    """Megatron-LM's torch profiler: iterations [--profile-step-start, --profile-step-end)
    active, the trace written into --tensorboard-dir."""
    start = args.profile_step_start
    return torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                         active=args.profile_step_end - start, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(args.tensorboard_dir),
        record_shapes=True, with_stack=True)


def _sha1(tensor: torch.Tensor) -> torch.Tensor:
    """The 20 bytes of the SHA-1 of ``tensor`` as float32 on the CPU (Megatron-LM's hash)."""
    digest = hashlib.sha1(tensor.detach().to("cpu").float().numpy(force=True)).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def replica_mismatches(model: list, device: str) -> str:
    """'' when every data-parallel replica holds this rank's weights bit for bit; otherwise a
    short description (the first differing parameter names and the ranks). The same answer on
    every rank of the world: the hashes are all-gathered over each data-parallel group, then a
    flag is all-reduced over the world, so no rank goes on while another stops."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    named = [(name, p) for chunk in model for name, p in chunk.named_parameters()]
    local = torch.stack([_sha1(p.data) for _, p in named]).to(device)
    group = ps.get_data_parallel_group()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    differing = sorted({name for other in gathered
                        for (name, _), same in zip(named, (other == local).all(dim=1)) if not same})
    flag = torch.tensor([float(bool(differing))], device=device)
    dist.all_reduce(flag)
    if not differing:
        return "" if flag.item() == 0 else "on another data-parallel group"
    shown = ", ".join(differing[:3]) + (f" and {len(differing) - 3} more" if len(differing) > 3 else "")
    return f"{shown} on data-parallel ranks {dist.get_process_group_ranks(group)}"
