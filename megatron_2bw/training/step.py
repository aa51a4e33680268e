"""The training loop's step phase: one global batch, its optimizer step and its log line.

:class:`TrainStep` runs the schedule over the batch's microbatches, steps the optimizer and the
scheduler, and logs the iteration as Megatron-LM's training_log does (scalars, the line,
the timers, a MoE model's load-balancing losses).
Invariant: every rank calls the same collectives per iteration in the same order (the
loss's data-parallel all-reduce on the loss's stage, the log's norms and timers on all).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_2bw.training import logs, moe

__all__ = ["TrainStep", "mean_losses_over_data_parallel"]


def mean_losses_over_data_parallel(loss_dicts: list, loss_stage: int) -> dict | None:
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


class TrainStep:
    """The trainer's iteration. Needs ``args``, ``state``, ``model``, ``optimizer``,
    ``scheduler``, ``forward_backward``, ``forward_step_func``, ``data``, ``housekeeping``,
    ``timers``, ``logger``, ``interval``, ``info``, ``loss_key``, ``loss_stage`` and
    ``flops_per_iteration``, and ``_due`` (:class:`~megatron_2bw.training.pauses.Pauses`)."""

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
        losses = mean_losses_over_data_parallel(loss_dicts, self.loss_stage)
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
