"""A Megatron-style pretraining loop: build, (resume,) train, evaluate, checkpoint.

Model-agnostic like Megatron-LM's ``pretrain()``: the entry script passes a model provider, a
dataset provider and a ``forward_step_func``. The pipeline schedule comes from
``megatron.core.pipeline_parallel.get_forward_backward_func()``, which
:func:`megatron_2bw.install` points at the schedule chosen with ``--pipeline-schedule``.
A schedule that keeps microbatches in flight across iterations (2BW) exposes ``drain()``;
the loop drains before evaluating, checkpointing and finishing.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_2bw.runtime import distributed
from megatron_2bw.training import build, checkpointing, logs
from megatron_2bw.training.checkpointing import TrainState
from megatron_2bw.training.guard import Divergence, RunGuard, Verdict

__all__ = ["DataIterators", "pretrain", "Trainer"]


@dataclass
class DataIterators:
    """Per-rank iterators; ``valid`` is a factory so every evaluation sees the same batches."""

    train: object
    valid: Callable[[], object] | None
    test: Callable[[], object] | None = None


def _cpu_group():
    """A gloo group over all ranks for small control messages (also on NCCL clusters), with the
    same bound on its waits as every other group (--distributed-timeout-minutes)."""
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=distributed.timeout())
    return _CPU_GROUP


_CPU_GROUP = None


def _mean_loss_over_data_parallel(loss_dicts: list, key: str) -> float | None:
    """Average ``key`` over this rank's microbatches, then over data-parallel replicas.
    Returns None on ranks that hold no loss (all but the last pipeline stage)."""
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage():
        return None
    local = torch.stack([d[key].float().reshape(()) for d in loss_dicts]).mean()
    dist.all_reduce(local, group=ps.get_data_parallel_group())
    return float(local) / ps.get_data_parallel_world_size()


class Trainer:
    """Owns the model, optimizer, schedule and data for one process."""

    def __init__(self, args: argparse.Namespace, model_provider: Callable,
                 data_provider: Callable[[argparse.Namespace, TrainState], DataIterators],
                 forward_step_func: Callable, vocab_size: int, loss_key: str = "lm loss"):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.args = args
        self.info = distributed.initialize(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed,
            force_cpu=args.cpu, timeout_minutes=args.distributed_timeout_minutes)
        self.config = build.transformer_config(args, self.info.device)
        self.model = build.build_model(args, self.config, model_provider)
        self.optimizer = build.build_optimizer(args, self.model)
        self.scheduler = build.build_scheduler(args, self.optimizer)
        build.attach_config_hooks(self.config, self.model, self.optimizer)
        self.forward_backward = get_forward_backward_func()
        attach = getattr(self.forward_backward, "attach_optimizer", None)
        if attach is not None:
            attach(self.optimizer, defer=not args.no_deferred_step)
        self.forward_step_func = forward_step_func
        self.loss_key = loss_key
        self.logger = logs.Logger(self.info.rank == self.info.world_size - 1, args.tensorboard_dir)
        self.flops_per_iteration = logs.transformer_flops_per_iteration(args, vocab_size)
        self.state = self._maybe_load()
        self.data = data_provider(args, self.state)

    # ---- checkpoints -------------------------------------------------------------------
    def _maybe_load(self) -> TrainState:
        if not self.args.load:
            return TrainState()
        fb, model = self.forward_backward, self.model
        hooks = {}
        if hasattr(fb, "prepare_load"):
            hooks = dict(extra=lambda sharded, path: fb.prepare_load(model, sharded, path),
                         on_loaded=lambda loaded: fb.checkpoint_loaded(model, loaded))
        state = checkpointing.load_checkpoint(
            self.args.load, self.model, self.optimizer, self.scheduler,
            load_optim=not self.args.no_load_optim, load_rng=not self.args.no_load_rng,
            warn=self.logger.print, **hooks)
        if state is None:
            self.logger.print(f" no checkpoint found in {self.args.load}: starting from scratch")
            return TrainState()
        self.logger.print(f" resumed from {self.args.load} at iteration {state.iteration}")
        return state

    def save(self) -> None:
        self._drain()
        fb, model = self.forward_backward, self.model
        extra = None
        if hasattr(fb, "checkpoint_extra"):
            extra = lambda sharded: fb.checkpoint_extra(model, sharded)  # noqa: E731
        path = checkpointing.save_checkpoint(
            self.args.save, self.model, self.optimizer, self.scheduler, self.state, extra=extra,
            keep=self.args.ckpt_keep)
        self.logger.print(f" saved checkpoint at iteration {self.state.iteration} to {path}")

    def _drain(self) -> None:
        drain = getattr(self.forward_backward, "drain", None)
        if drain is not None:
            drain()

    def _prepare_drain(self) -> None:
        """Tell a schedule that keeps microbatches in flight (2BW) that the coming call is the
        last before a pause (evaluation, checkpoint, stop, end of training)."""
        prepare = getattr(self.forward_backward, "prepare_drain", None)
        if prepare is not None:
            prepare()

    # ---- one iteration -----------------------------------------------------------------
    def _schedule_kwargs(self, forward_only: bool) -> dict:
        a = self.args
        return dict(forward_step_func=self.forward_step_func, model=self.model,
                    num_microbatches=a.num_microbatches, seq_length=a.seq_length,
                    micro_batch_size=a.micro_batch_size, decoder_seq_length=a.seq_length,
                    forward_only=forward_only)

    def train_step(self) -> tuple[float | None, float | None, bool]:
        """One global batch: forward/backward over all microbatches, then the optimizer step."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_dicts = self.forward_backward(data_iterator=self.data.train,
                                           **self._schedule_kwargs(forward_only=False))
        succeeded, grad_norm, _ = self.optimizer.step()
        if succeeded:
            self.scheduler.step(increment=1)
        self.state.iteration += 1
        self.state.consumed_train_samples += self.args.global_batch_size
        return _mean_loss_over_data_parallel(loss_dicts, self.loss_key), grad_norm, succeeded

    @torch.no_grad()
    def evaluate(self, make_iterator: Callable[[], object], split: str = "validation") -> float:
        """Mean loss over --eval-iters batches (the same batches at every evaluation)."""
        self._drain()
        for chunk in self.model:
            chunk.eval()
        iterator, losses = make_iterator(), []
        for _ in range(self.args.eval_iters):
            loss_dicts = self.forward_backward(data_iterator=iterator,
                                               **self._schedule_kwargs(forward_only=True))
            losses.append(_mean_loss_over_data_parallel(loss_dicts, self.loss_key))
        for chunk in self.model:
            chunk.train()
        loss = None if losses[0] is None else sum(losses) / len(losses)
        if loss is not None:
            self.logger.validation(self.state.iteration, loss, split)
        return loss

    # ---- the loop ----------------------------------------------------------------------
    def _log(self, loss, grad_norm, seconds: float, skipped: int) -> None:
        if not self.logger.enabled:
            return
        self.logger.iteration(logs.IterationLog(
            iteration=self.state.iteration, train_iters=self.args.train_iters,
            seconds_per_iteration=seconds, lr=self.optimizer.param_groups[0]["lr"],
            loss=loss, grad_norm=grad_norm,
            consumed_samples=self.state.consumed_train_samples,
            global_batch_size=self.args.global_batch_size, seq_length=self.args.seq_length,
            flops_per_iteration=self.flops_per_iteration, world_size=self.info.world_size,
            peak_mem_mib=logs.peak_memory_mib(self.info.device), skipped=skipped))

    def _due(self, interval: int | None, iteration: int | None = None) -> bool:
        iteration = self.state.iteration if iteration is None else iteration
        return interval is not None and iteration % interval == 0

    def _pauses_after(self, iteration: int) -> bool:
        """Whether training pauses after ``iteration`` (evaluation, checkpoint, exit, end)."""
        a = self.args
        evaluates = a.eval_iters > 0 and self.data.valid is not None and self._due(
            a.eval_interval, iteration)
        saves = a.save is not None and self._due(a.save_interval, iteration)
        return (iteration >= a.train_iters or evaluates or saves
                or self._due(a.exit_interval, iteration))

    def train(self) -> dict:
        """Train to --train-iters; return the last training and validation losses.

        Each iteration's stop and divergence flags are all-reduced asynchronously and read one
        iteration later (``guard.RunGuard``); before a checkpoint or the end all are read. A
        stop request (SIGTERM/SIGINT on any rank) read after iteration t makes t+1 the last,
        drained, iteration: it is saved (with --save) and the run ends with exit code 0. A
        divergence raises :class:`Divergence` before anything else is saved."""
        a, guard = self.args, RunGuard(_cpu_group(), self.args)
        last = {"train_loss": None, "valid_loss": None}
        losses, skipped, started = [], 0, time.perf_counter()
        stop_signal: str | None = None
        self.logger.print(f" training {a.pipeline_schedule} schedule on {self.info.world_size} "
                          f"{self.info.device} processes: TP={a.tensor_model_parallel_size} "
                          f"PP={a.pipeline_model_parallel_size} DP={a.data_parallel_size}, "
                          f"{a.num_microbatches} microbatches per batch")
        while self.state.iteration < a.train_iters:
            upcoming = self.state.iteration + 1
            if stop_signal or self._pauses_after(upcoming):
                self._prepare_drain()
            loss, grad_norm, succeeded = self.train_step()
            guard.post(self.state.iteration, loss, grad_norm, succeeded)
            losses.append(loss)
            skipped += not succeeded
            if self._due(a.log_interval):
                seconds = (time.perf_counter() - started) / len(losses)
                last["train_loss"] = None if loss is None else sum(losses) / len(losses)
                self._log(last["train_loss"], grad_norm, seconds, skipped)
                losses, skipped, started = [], 0, time.perf_counter()
            pausing = stop_signal is not None or self._pauses_after(self.state.iteration)
            stop_signal = self._judge(guard.settle() if pausing else guard.verdicts(keep=1),
                                      guard, stop_signal)
            if a.eval_iters and self.data.valid is not None and self._due(a.eval_interval):
                last["valid_loss"] = self.evaluate(self.data.valid)
                started = time.perf_counter()
            stopping = pausing and (stop_signal is not None or self._due(a.exit_interval))
            if a.save and (self._due(a.save_interval) or stopping):
                self.save()
                started = time.perf_counter()
            if stopping:
                why = f" ({stop_signal})" if stop_signal else ""
                self.logger.print(f" stopping at iteration {self.state.iteration}{why}")
                return last
        self._drain()
        if a.eval_iters and self.data.valid is not None and not self._due(a.eval_interval):
            last["valid_loss"] = self.evaluate(self.data.valid)
        if a.save and not self._due(a.save_interval):
            self.save()
        return last

    def _judge(self, verdicts: list[Verdict], guard: RunGuard, stop_signal: str | None):
        """Raise on a diverged iteration; return the stop request (the signal's name) once
        any rank has received one."""
        for verdict in verdicts:
            if verdict.divergence:
                abandon = getattr(self.forward_backward, "abandon", None)
                if abandon is not None:
                    abandon()
                where = f" (the last checkpoint in {self.args.save} is untouched)" \
                    if self.args.save else ""
                raise Divergence(f"iteration {verdict.iteration}: {verdict.divergence}; "
                                 f"training stopped without saving{where}")
            if verdict.stop and stop_signal is None:
                stop_signal = guard.received or "a stop signal on another rank"
        return stop_signal


def pretrain(args: argparse.Namespace, model_provider: Callable, data_provider: Callable,
             forward_step_func: Callable, vocab_size: int) -> dict:
    """Build everything for this process, train, and tear the process groups down."""
    trainer = Trainer(args, model_provider, data_provider, forward_step_func, vocab_size)
    try:
        return trainer.train()
    finally:
        trainer.logger.close()
        distributed.destroy()
