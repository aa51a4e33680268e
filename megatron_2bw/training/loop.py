"""A Megatron-style pretraining loop: build, (resume,) train, evaluate, checkpoint.

Model-agnostic like Megatron-LM's ``pretrain()``: the entry script passes a model provider, a
dataset provider and a ``forward_step_func``. The pipeline schedule comes from
``megatron.core.pipeline_parallel.get_forward_backward_func()``, which
:func:`megatron_2bw.install` points at the schedule chosen with ``--pipeline-schedule``.
A schedule that keeps microbatches in flight across iterations (2BW) exposes ``drain()``;
the loop drains before evaluating, checkpointing and finishing, and before an iteration whose
number of microbatches differs from the last (--rampup-batch-size: megatron-core's
num_microbatches_calculator gives each iteration's batch from the consumed samples).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_2bw.corrections import StaleCorrection
from megatron_2bw.runtime import distributed
from megatron_2bw.schedules import keeps_versions, placement_of
from megatron_2bw.schedules.pipemare import PipeMareOptions
from megatron_2bw.training import build, logs
from megatron_2bw.training.checkpointing import TrainState
from megatron_2bw.training.evaluation import Evaluate, training_rng_untouched
from megatron_2bw.training.guard import Divergence, RunGuard, Verdict, nonfinite
from megatron_2bw.training.housekeeping import Housekeeping
from megatron_2bw.training.pauses import Pauses
from megatron_2bw.training.resume import Resume
from megatron_2bw.training.save import Save
from megatron_2bw.training.step import TrainStep

__all__ = ["DataIterators", "pretrain", "Trainer"]


@dataclass
class DataIterators:
    """Per-rank iterators (with virtual pipeline stages, lists of one per model chunk);
    ``valid`` is a factory so every evaluation sees the same batches."""

    train: object
    valid: Callable[[], object] | None
    test: Callable[[], object] | None = None


def _cpu_group():
    """A gloo group over all ranks for small control messages (also on NCCL clusters), with the
    same bound on its waits as every other group (--distributed-timeout-minutes); used once
    when made (every rank makes it before the first iteration), so that it is connected before
    the first step as every other group is (gloo connects at creation anyway)."""
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=distributed.timeout())
        distributed.create_communicators(torch.device("cpu"), groups=[_CPU_GROUP])
    return _CPU_GROUP


_CPU_GROUP = None


def _loss_stage(args: argparse.Namespace) -> int:
    """The pipeline stage that computes the loss: the last, but the first under zb-v and
    dualpipev (the V placement: rank 0's second chunk is the model's end)."""
    depth = args.pipeline_model_parallel_size
    placement = placement_of(args.pipeline_schedule, depth, build.virtual_stages(args))
    return placement.holder(depth * placement.chunks - 1)[0]


class Trainer(Resume, Save, Pauses, TrainStep, Evaluate):
    """Owns the model, optimizer, schedule and data for one process. Built here (the
    constructor) and trained here (``train``); each phase of the loop is its own part:
    resume.py, step.py, evaluation.py, save.py and pauses.py (where the pipeline drains)."""

    def __init__(self, args: argparse.Namespace, model_provider: Callable,
                 data_provider: Callable[[argparse.Namespace, TrainState], DataIterators],
                 forward_step_func: Callable, vocab_size: int, loss_key: str = "lm loss"):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.args = args
        self.info = distributed.initialize(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed,
            force_cpu=args.cpu, timeout_minutes=args.distributed_timeout_minutes,
            virtual_stages=getattr(args, "virtual_pipeline_model_parallel_size", None),
            expert_parallel=getattr(args, "expert_model_parallel_size", 1),
            expert_tensor_parallel=getattr(args, "expert_tensor_parallel_size", None))
        self.config = build.transformer_config(args, self.info.device)
        self.model = build.build_model(args, self.config, model_provider)
        self.optimizer = build.build_optimizer(args, self.model)
        self.scheduler = build.build_scheduler(args, self.optimizer)
        build.attach_config_hooks(self.config, self.model, self.optimizer,
                                  align_grad_reduce=args.align_grad_reduce)
        self.forward_backward = get_forward_backward_func()
        attach = getattr(self.forward_backward, "attach_optimizer", None)
        if attach is not None:
            attach(self.optimizer, defer=not args.no_deferred_step,
                   correction=StaleCorrection.from_args(args))
        if args.pipeline_schedule == "pipemare":
            self.forward_backward.configure_pipemare(PipeMareOptions.from_args(args))
        self.forward_step_func = forward_step_func
        self.loss_key = loss_key
        # the last rank of the loss's stage (megatron-core orders ranks tp-cp-ep-dp-pp)
        self.loss_stage = _loss_stage(args)
        logs_here = self.info.rank == (self.loss_stage + 1) * (
            self.info.world_size // args.pipeline_model_parallel_size) - 1
        self.logger = logs.Logger(logs_here, args.tensorboard_dir,
                                  logs.LogFlags.from_args(args), self.info.device)
        self.timers = logs.attach_timers(args, self.config, self.optimizer,
                                           self.info.device)
        self.interval = logs.IntervalStats()
        if args.log_num_zeros_in_grad and keeps_versions(args.pipeline_schedule):
            self.logger.print(" --log-num-zeros-in-grad: not counted where the optimizer "
                              "step is deferred (the step runs inside the next iteration)")
        self.flops_per_iteration = logs.transformer_flops_per_iteration(args, vocab_size)
        self.state = self._maybe_load()
        _start_batch_size_ramp(args, self.info.rank, self.state.consumed_train_samples)
        with training_rng_untouched():
            self.data = _per_chunk_data(data_provider, args, self.state, len(self.model))
        self.housekeeping = Housekeeping(args, self.info.rank, self.info.device,
                                         self.logger.print)

    # ---- the loop ----------------------------------------------------------------------
    def train(self) -> dict:
        """Train to --train-iters; return the last training and validation losses.

        Each iteration's stop and divergence flags are all-reduced asynchronously and read one
        iteration later (``guard.RunGuard``); before a checkpoint or the end all are read. A
        stop request (SIGTERM/SIGINT on any rank) read after iteration t makes t+1 the last,
        drained, iteration: it is saved (with --save) and the run ends with exit code 0. A
        divergence raises :class:`Divergence` before anything else is saved."""
        a, guard = self.args, RunGuard(_cpu_group(), self.args)
        last = {"train_loss": None, "valid_loss": None}
        self.timers("interval-time", log_level=0).start()
        stop_signal: str | None = None
        notice, stop_at = self._drain_notice(), None
        self.logger.print(f" training {a.pipeline_schedule} schedule on {self.info.world_size} "
                          f"{self.info.device} processes: TP={a.tensor_model_parallel_size} "
                          f"PP={a.pipeline_model_parallel_size} DP={a.data_parallel_size}, "
                          f"{a.num_microbatches} microbatches per batch"
                          f"{' after the ramp-up' if a.rampup_batch_size else ''}"
                          f"{_virtual_stages_note(len(self.model))}")
        while self.state.iteration < a.train_iters:
            upcoming = self.state.iteration + 1
            if stop_signal and stop_at is None:  # the first iteration a drain can end
                stop_at = upcoming + notice - 1
                self._prepare_drain(notice)
            if self._pauses_after(upcoming) or self._batch_grows_after(upcoming):
                self._prepare_drain()
            elif notice > 1:
                self._announce_pauses(upcoming, notice)
            loss, grad_norm, num_zeros, succeeded, losses = self.train_step()
            self.housekeeping.after_iteration(self.state.iteration)
            self.housekeeping.check_replicas(self.model, self.state.iteration)
            guard.post(self.state.iteration, loss, grad_norm, succeeded)
            if guard.check_nan:  # on the device, read with the next iteration's flags
                guard.record_step(self.state.iteration, nonfinite(self._weights()))
            interval_loss = self._log(loss, grad_norm, num_zeros, succeeded, losses)
            if self._due(a.log_interval):
                last["train_loss"] = interval_loss
            pausing = (stop_at is not None and self.state.iteration >= stop_at) \
                or self._pauses_after(self.state.iteration)
            stop_signal = self._judge(guard.settle() if pausing else guard.verdicts(keep=1),
                                      guard, stop_signal)
            if a.eval_iters and self.data.valid is not None and self._due(a.eval_interval):
                with self._interval_paused():
                    last["valid_loss"] = self.evaluate(self.data.valid)
            stopping = pausing and (stop_signal is not None or self._due(a.exit_interval))
            if a.save and (self._due(a.save_interval) or stopping):
                with self._interval_paused():
                    self.save()
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
                self._abandon()
                raise Divergence(f"iteration {verdict.iteration}: {verdict.divergence}; "
                                 f"training stopped without saving{self._untouched()}")
            if verdict.stop and stop_signal is None:
                stop_signal = guard.received or "a stop signal on another rank"
        return stop_signal


def _virtual_stages_note(chunks: int) -> str:
    return "" if chunks == 1 else f", {chunks} virtual stages (model chunks) per pipeline rank"


def _per_chunk_data(data_provider: Callable[[argparse.Namespace, TrainState], DataIterators],
                    args: argparse.Namespace, state: TrainState, chunks: int) -> DataIterators:
    """The data iterators the schedule takes: this rank's, or with virtual pipeline stages a
    list of one per model chunk (what megatron-core's interleaved schedule reads, chunk i's
    microbatches from ``data_iterator[i]``), each built by its own ``data_provider`` call
    from the same consumed samples, as Megatron-LM's ``setup_model_and_optimizer`` builds one
    set of iterators per virtual stage. Every chunk then reads microbatch j as its j-th
    batch, whichever chunks of the rank read data (GPT: the first and the last virtual stage;
    BERT: all)."""
    if chunks == 1:
        return data_provider(args, state)
    sets = [data_provider(args, state) for _ in range(chunks)]

    def factories(name: str):
        made = [getattr(data, name) for data in sets]
        if any(factory is None for factory in made):
            return None
        return lambda: [factory() for factory in made]

    return DataIterators(train=[data.train for data in sets], valid=factories("valid"),
                         test=factories("test"))


def _start_batch_size_ramp(args: argparse.Namespace, rank: int, consumed_samples: int) -> None:
    """megatron-core's process-wide num_microbatches_calculator for these flags (constant, or
    --rampup-batch-size), set at the consumed samples (a resumed run continues mid-ramp)."""
    from megatron.core import num_microbatches_calculator as calculator

    calculator.destroy_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(
        rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
        args.data_parallel_size)
    calculator.update_num_microbatches(consumed_samples, consistency_check=True)


def pretrain(args: argparse.Namespace, model_provider: Callable, data_provider: Callable,
             forward_step_func: Callable, vocab_size: int) -> dict:
    """Build everything for this process, train, and tear the process groups down."""
    trainer = Trainer(args, model_provider, data_provider, forward_step_func, vocab_size)
    try:
        return trainer.train()
    finally:
        trainer.housekeeping.close()
        trainer.logger.close()
        distributed.destroy()
