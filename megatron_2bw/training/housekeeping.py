"""What Megatron-LM's training loop does around each iteration besides training (its
megatron/training/training.py at core_v0.16.1): --manual-gc, --empty-unused-memory-level and
--profile. The loop calls :meth:`Housekeeping.after_forward_backward`,
:meth:`after_optimizer_step` and :meth:`after_iteration` in that order every iteration,
wraps evaluations in :meth:`evaluating` and calls :meth:`close` once at the end."""

from __future__ import annotations

import argparse
import contextlib
import gc
from typing import Callable

import torch

__all__ = ["Housekeeping"]


class Housekeeping:
    """Invariant: with --manual-gc the automatic collector stays disabled from construction to
    :meth:`close`; a torch profiler, when one runs, is stepped once per iteration."""

    def __init__(self, args: argparse.Namespace, rank: int, device: str,
                 say: Callable[[str], None]):
        self.args, self.on_cuda = args, device == "cuda"
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
