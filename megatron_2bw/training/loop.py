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
import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_2bw.corrections import StaleCorrection
from megatron_2bw.runtime import distributed
from megatron_2bw.schedules import keeps_versions, placement_of
from megatron_2bw.schedules.pipemare import PipeMareOptions
from megatron_2bw.training import build, checkpointing, logs, moe
from megatron_2bw.training.checkpointing import TrainState
from megatron_2bw.training.guard import Divergence, RunGuard, Verdict, nonfinite
from megatron_2bw.training.housekeeping import Housekeeping

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


def _mean_losses_over_data_parallel(loss_dicts: list, loss_stage: int) -> dict | None:
    """Each loss of the microbatches' loss dicts ("lm loss", BERT's "sop loss"), in their order,
    averaged over this rank's microbatches, then over data-parallel replicas (one all-reduce).
    Returns None on ranks that hold no loss (all but the `loss_stage` pipeline stage)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_rank() != loss_stage:
        return None
    keys = list(loss_dicts[0])
    local = torch.stack([torch.stack([d[key].float().reshape(()) for d in loss_dicts]).mean()
                         for key in keys])
    dist.all_reduce(local, group=ps.get_data_parallel_group())
    replicas = ps.get_data_parallel_world_size()
    return {key: float(value) / replicas for key, value in zip(keys, local)}


class Trainer:
    """Owns the model, optimizer, schedule and data for one process."""

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
        with _training_rng_untouched():
            self.data = _per_chunk_data(data_provider, args, self.state, len(self.model))
        self.housekeeping = Housekeeping(args, self.info.rank, self.info.device,
                                         self.logger.print)

    # ---- checkpoints -------------------------------------------------------------------
    def _maybe_load(self) -> TrainState:
        """The checkpoint's TrainState (or a fresh one); notes where the FLOPs count resumes
        (Megatron-LM's num_floating_point_operations_so_far)."""
        self._flops_counted_at = (0, 0)
        if not self.args.load:
            return TrainState()
        fb, model = self.forward_backward, self.model
        hooks = {}
        if hasattr(fb, "prepare_load"):
            hooks = dict(extra=lambda sharded, path: fb.prepare_load(model, sharded, path),
                         on_loaded=lambda loaded: fb.checkpoint_loaded(model, loaded))
        state = checkpointing.load_checkpoint(
            self.args.load, self.model, self.optimizer, self.scheduler, self.args,
            warn=self.logger.print, **hooks)
        if state is None:
            self.logger.print(f" no checkpoint found in {self.args.load}: starting from scratch")
            return TrainState()
        self.logger.print(f" resumed from {self.args.load} at iteration {state.iteration}")
        self._flops_counted_at = (state.iteration, state.num_floating_point_operations_so_far)
        return state

    def _weights(self) -> list[torch.Tensor]:
        """The weights a checkpoint would hold: every alive version of a version-keeping
        schedule, else the parameters."""
        tensors = getattr(self.forward_backward, "weight_tensors", lambda: None)()
        if tensors is not None:
            return tensors
        return [p.data for chunk in self.model for p in chunk.parameters()]

    def _check_weights_before_saving(self) -> None:
        """No checkpoint is written from non-finite weights (any precision, checked or not):
        all ranks agree, then raise Divergence."""
        flag = nonfinite(self._weights()).reshape(1).to(self.info.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self._abandon()
            raise Divergence(f"iteration {self.state.iteration}: the weights are not finite "
                             f"(NaN or inf); training stopped without saving"
                             f"{self._untouched()}")

    def _abandon(self) -> None:
        abandon = getattr(self.forward_backward, "abandon", None)
        if abandon is not None:
            abandon()

    def _untouched(self) -> str:
        return f" (the last checkpoint in {self.args.save} is untouched)" if self.args.save \
            else ""

    def save(self) -> None:
        self._drain()
        self._check_weights_before_saving()
        fb, model = self.forward_backward, self.model
        extra = None
        if hasattr(fb, "checkpoint_extra"):
            extra = lambda sharded: fb.checkpoint_extra(model, sharded)  # noqa: E731
        iteration, flops = self._flops_counted_at
        self.state.num_floating_point_operations_so_far = (
            flops + (self.state.iteration - iteration) * self.flops_per_iteration)
        with build.forward_pre_hook_paused(self.model):  # saves the all-gathered weights
            path = checkpointing.save_checkpoint(
                self.args.save, self.model, self.optimizer, self.scheduler, self.state,
                self.args, extra=extra, keep=self.args.ckpt_keep)
        self.logger.print(f" saved checkpoint at iteration {self.state.iteration} to {path}")

    def _drain(self) -> None:
        drain = getattr(self.forward_backward, "drain", None)
        if drain is not None:
            drain()

    def _prepare_drain(self, calls: int = 1) -> None:
        """Tell a schedule that keeps microbatches in flight (2BW) that the call ``calls``
        calls from now (1: the coming one) is the last before a pause (evaluation,
        checkpoint, stop, end of training)."""
        prepare = getattr(self.forward_backward, "prepare_drain", None)
        if prepare is not None:
            prepare(calls)

    def _drain_notice(self) -> int:
        """Calls ahead the schedule must know of a pause (1; more under pipedream and pipemare
        at m < d, whose look-ahead forwards reach past the next batch)."""
        notice = getattr(self.forward_backward, "drain_notice", None)
        return 1 if notice is None else notice(self.args.num_microbatches)

    def _announce_pauses(self, upcoming: int, notice: int) -> None:
        """Ask for a drain at the first pause within ``notice`` iterations from ``upcoming``."""
        for ahead in range(notice):
            if self._pauses_after(upcoming + ahead):
                self._prepare_drain(ahead + 1)
                return

    # ---- one iteration -----------------------------------------------------------------
    def _schedule_kwargs(self, forward_only: bool, num_microbatches: int) -> dict:
        a = self.args
        return dict(forward_step_func=self.forward_step_func, model=self.model,
                    num_microbatches=num_microbatches, seq_length=a.seq_length,
                    micro_batch_size=a.micro_batch_size, decoder_seq_length=a.seq_length,
                    forward_only=forward_only)

    def train_step(self) -> tuple[float | None, float | None, float | None, bool, dict | None]:
        """One global batch of the current size (megatron-core's calculator at the consumed
        samples): forward/backward over its microbatches, then the optimizer step; the
        scheduler and the consumed samples advance by the batch's samples. Returns (loss, grad
        norm, zeros in the gradients (--log-num-zeros-in-grad), success, every loss by name);
        the losses are None off the loss's stage. Timed as Megatron-LM's train_step times it
        ('forward-backward', 'optimizer')."""
        from megatron.core.num_microbatches_calculator import (
            get_current_global_batch_size, get_num_microbatches, update_num_microbatches)

        update_num_microbatches(self.state.consumed_train_samples, consistency_check=True)
        batch_size = get_current_global_batch_size()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self._timed("forward-backward", self._schedule_times_itself()):
            loss_dicts = self.forward_backward(
                data_iterator=self.data.train,
                **self._schedule_kwargs(False, get_num_microbatches()))
        self.housekeeping.after_forward_backward()
        with self._timed("optimizer"):
            succeeded, grad_norm, num_zeros = self.optimizer.step()
        if not self.args.log_num_zeros_in_grad:
            num_zeros = None  # ChainedOptimizer.step's (build._unchained): mixed precision's is 0
        self.housekeeping.after_optimizer_step()
        if succeeded:
            self.scheduler.step(increment=batch_size)
        self.state.iteration += 1
        self.state.consumed_train_samples += batch_size
        losses = _mean_losses_over_data_parallel(loss_dicts, self.loss_stage)
        loss = None if losses is None else losses[self.loss_key]
        return loss, grad_norm, num_zeros, succeeded, losses

    @contextlib.contextmanager
    def _timed(self, name: str, already_timed: bool = False):
        """megatron-core timer ``name`` (level 1) around the block, unless the block times
        itself under that name."""
        timer = None if already_timed else self.timers(name, log_level=1)
        if timer is not None:
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.stop()

    def _schedule_times_itself(self) -> bool:
        """megatron-core's own schedules start and stop 'forward-backward' themselves."""
        return getattr(self.forward_backward, "__module__", "") == \
            "megatron.core.pipeline_parallel.schedules"

    @torch.no_grad()
    def evaluate(self, make_iterator: Callable[[], object], split: str = "validation") -> float:
        """Mean loss over --eval-iters batches (the same batches at every evaluation); every
        loss of the loss dict is logged."""
        self._drain()
        for chunk in self.model:
            chunk.eval()
        losses = []
        with self.housekeeping.evaluating(), logs.timers_detached(self.config), \
                build.forward_pre_hook_paused(self.model), _training_rng_untouched():
            iterator = make_iterator()
            for _ in range(self.args.eval_iters):
                loss_dicts = self.forward_backward(  # full batches, as Megatron-LM evaluates
                    data_iterator=iterator,
                    **self._schedule_kwargs(True, self.args.num_microbatches))
                losses.append(_mean_losses_over_data_parallel(loss_dicts, self.loss_stage))
        for chunk in self.model:
            chunk.train()
        if losses[0] is None:
            return None
        means = {key: sum(each[key] for each in losses) / len(losses) for key in losses[0]}
        self.logger.validation(self.state.iteration, means, split,
                               self.state.consumed_train_samples)
        return means[self.loss_key]

    # ---- the loop ----------------------------------------------------------------------
    def _log(self, loss, grad_norm, num_zeros, succeeded: bool,
             losses: dict | None = None) -> float | None:
        """Megatron-LM's training_log for the iteration just run: its scalars every
        --tensorboard-log-interval, and every --log-interval the line and the timers. Every rank
        calls it (the parameter norm and the timers are collectives). Returns the interval's
        mean loss when a line was due (None on ranks without the loss). ``losses``: every loss
        of the loss dict by name (written and printed each), ``loss`` the main one."""
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

        a, iteration = self.args, self.state.iteration
        batch_size = get_current_global_batch_size()  # the batch just run (set before it ran)
        self.interval.add(loss, succeeded, self._moe_log(iteration, losses))
        line_due, scalars_due = self._due(a.log_interval), self._due(a.tensorboard_log_interval)
        if not (line_due or scalars_due):
            return None
        params_norm = logs.params_l2_norm(self.model) if a.log_params_norm else None
        lr = get_canonical_lr_for_logging(self.optimizer.param_groups)
        loss_scale = float(self.optimizer.get_loss_scale())
        if scalars_due:
            self.logger.step(logs.StepStats(
                iteration, self.state.consumed_train_samples, lr, batch_size,
                losses or {self.loss_key: loss}, loss_scale, self.info.world_size, grad_norm,
                num_zeros, params_norm))
        if not line_due:
            return None
        interval = self.interval.take()
        seconds = self.timers("interval-time").elapsed() / interval.iterations
        if self.logger.enabled:
            self.logger.iteration(logs.IterationLog(
                iteration=iteration, train_iters=a.train_iters, seconds_per_iteration=seconds,
                lr=lr, loss=interval.mean_loss, grad_norm=grad_norm,
                consumed_samples=self.state.consumed_train_samples,
                global_batch_size=batch_size, seq_length=a.seq_length,
                flops_per_iteration=self.flops_per_iteration * batch_size / a.global_batch_size,
                world_size=self.info.world_size,
                peak_mem_mib=logs.peak_memory_mib(self.info.device), skipped=interval.skipped,
                loss_key=self.loss_key, loss_scale=loss_scale, num_zeros=num_zeros,
                params_norm=params_norm, nan_iterations=interval.nan,
                log_throughput=a.log_throughput, losses=interval.mean_losses()))
        self.logger.timers(self.timers, iteration, self._schedule_scalars())
        return interval.mean_loss

    def _moe_log(self, iteration: int, losses: dict | None) -> dict | None:
        """A MoE model's load-balancing losses, as Megatron-LM's training_log tracks them
        every iteration (``training.moe.moe_metrics``, a collective): written to TensorBoard
        as '<name>' (and 'moe/<name>_layer_<i>' with --moe-per-layer-logging), and returned
        beside ``losses`` for the log line's interval means."""
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        if not moe.is_moe(self.args):
            return losses
        per_layer = moe.moe_metrics(self.args, get_num_microbatches())
        values = {name: moe.logged_value(self.args, layers) for name, layers in per_layer.items()}
        scalars = dict(values)
        if self.args.moe_per_layer_logging:
            scalars.update({f"moe/{name}_layer_{i}": value for name, layers in per_layer.items()
                            for i, value in enumerate(layers)})
        self.logger.scalars(scalars, iteration)
        return None if losses is None else {**losses, **values}

    def _schedule_scalars(self) -> dict:
        """Our schedule's tags next to Megatron-LM's (logs.SCHEDULE_TAGS), read on this rank
        before the timers start over."""
        versions = getattr(self.forward_backward, "versions", None)
        return {"pipeline-bubble-fraction":
                logs.stage_bubble_fraction(self.timers, self.args.timing_log_level),
                "weight-versions": None if versions is None else len(versions.alive)}

    @contextlib.contextmanager
    def _interval_paused(self):
        """Evaluations and checkpoints do not count in the time per iteration (as in
        Megatron-LM, which stops 'interval-time' around them)."""
        self.timers("interval-time").stop()
        try:
            yield
        finally:
            self.timers("interval-time").start()

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

    def _batch_grows_after(self, iteration: int) -> bool:
        """Whether the iteration after ``iteration`` (the next to run) has another number of
        microbatches. 2BW then drains in ``iteration``: its look-ahead forwards would belong to
        a batch of another size (numbered and loss-scaled with this call's m). A drain keeps
        the update rule: batch t reads version max(t-1, 0) whether its forwards ran in this
        call or the next (schedules.twobw)."""
        from megatron.core.num_microbatches_calculator import (
            get_current_global_batch_size, get_num_microbatches, update_num_microbatches)

        assert iteration == self.state.iteration + 1
        consumed = self.state.consumed_train_samples
        update_num_microbatches(consumed, consistency_check=False)
        m, after = get_num_microbatches(), consumed + get_current_global_batch_size()
        update_num_microbatches(after, consistency_check=False)
        grows = get_num_microbatches() != m
        update_num_microbatches(consumed, consistency_check=False)
        return grows

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


@contextlib.contextmanager
def _training_rng_untouched():
    """Around building data iterators and around evaluations: torch's global CPU generator is
    as it was before. A DataLoader iterator draws its base seed from that generator when it is
    made (an evaluation's cyclic one at its first batch), and dropout reads the same generator
    (the CPU runtime's "cuda" generator is that one). Without this, the iterators a resumed run
    builds after restoring the checkpoint's RNG state, and every evaluation, would shift the
    dropout masks of the iterations after them: a resumed run, or one that evaluates, would not
    train as the uninterrupted run without evaluations does."""
    with torch.random.fork_rng(devices=[]):
        yield


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
