"""Megatron-LM's training log: the text line, TensorBoard (and W&B) scalars, megatron-core timers.

Follows Megatron-LM core_v0.16.1's ``training_log()`` and ``evaluate_and_print_results()``
with its flag names and defaults: every ``--tensorboard-log-interval`` iterations the logging
rank (the last; it holds the loss) writes the scalars, every ``--log-interval`` it prints the
line (:meth:`IterationLog.line`) and writes the timers, and validation writes
``<loss> validation``. megatron-core's ``Timers`` are attached where Megatron-LM attaches them.

Invariants: the line keeps Megatron-LM's fields, names, order and number formats, ours after
them, so Megatron-LM's log parsers read it; TensorBoard tags are Megatron-LM's, plus our
schedule's (:data:`SCHEDULE_TAGS`); reading the timers is a collective (an all-gather over all
ranks) at each log line when the level is >= 1.

Every tag and the flag that turns it on: docs/megatron_lm_compatibility.md, "Logging".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import resource
import sys

import torch

__all__ = ["transformer_flops_per_iteration", "peak_memory_mib", "memory_scalars",
           "params_l2_norm", "format_duration", "timers_to_log", "attach_timers",
           "timers_detached", "stage_bubble_fraction", "LogFlags", "IntervalStats", "StepStats",
           "IterationLog", "Logger", "SCHEDULE_TAGS"]

# training_log()'s timers_to_log, by --timing-log-level (Megatron-LM core_v0.16.1,
# megatron/training/training.py). Timers that never ran on any rank are left out of the output.
_TIMERS_LEVEL_1 = ("forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
                   "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
                   "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
                   "optimizer-count-zeros", "optimizer-inner-step",
                   "optimizer-copy-main-to-model-params", "optimizer")
_TIMERS_LEVEL_2 = ("batch-generator", "forward-compute", "backward-compute", "forward-recv",
                   "forward-send", "backward-recv", "backward-send", "forward-send-forward-recv",
                   "forward-send-backward-recv", "backward-send-forward-recv",
                   "backward-send-backward-recv", "forward-backward-send-forward-backward-recv")

SCHEDULE_TAGS = {
    "pipeline-bubble-fraction": "share of the logging stage's forward-backward time outside "
                                "forward and backward compute (--timing-log-level 2)",
    "weight-versions": "weight versions alive on the logging stage after the iteration (2bw)",
}
"""Our additions to Megatron-LM's tags, written with --log-timers-to-tensorboard."""


def transformer_flops_per_iteration(args: argparse.Namespace, vocab_size: int) -> float:
    """Model FLOPs of one iteration of a GPT/BERT-style transformer.

    Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM" (SC'21), Eq. 3: F = 24 k B s l h^2 (1 + s/(6h) + V/(16 l h)), with k = 3
    (forward + backward) or k = 4 when every layer's forward is recomputed in the backward.
    """
    B, s, l, h, V = (args.global_batch_size, args.seq_length, args.num_layers,
                     args.hidden_size, vocab_size)
    passes = 4 if args.recompute_granularity == "full" else 3
    return 24 * passes * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def peak_memory_mib(device: str) -> float:
    """Peak allocated accelerator memory, or the process's peak resident set on the CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_scalars(device: str) -> dict[str, float]:
    """--log-memory-to-tensorboard: Megatron-LM's four tags from the CUDA caching allocator; on
    the CPU the two that a process has: its current and its peak resident set."""
    if device == "cuda":
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    import psutil

    current = psutil.Process().memory_info().rss
    return {"mem-allocated-bytes": current,  # the kernel's peak can lag the current value
            "mem-max-allocated-bytes": max(current, peak_memory_mib(device) * 2**20)}


def params_l2_norm(model: list) -> float:
    """--log-params-norm: Megatron-LM's ``calc_params_l2_norm`` (megatron/training/utils.py) for
    dense models: the L2 norm over the model's parameters, each counted once (no tensor-parallel
    duplicates, no second copy of tied embeddings), by megatron-core's ``get_grad_norm_fp32``.

    The squares are summed over the world group and divided by the data-parallel size (every
    replica holds the same weights), not over the model-parallel group as Megatron-LM does:
    under 2bw that group carries the deferred step's asynchronous grad-norm all-reduce, issued
    at a different point on each stage, and a second collective on it would pair with the wrong
    one. A collective: every rank calls it. Under 2bw it reads the weight version the
    parameters point at after the iteration."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    tensors = [p.data.float() for chunk in model for p in chunk.parameters()
               if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    over_world = get_grad_norm_fp32(tensors, grad_stats_parallel_group=dist.group.WORLD)
    return float(over_world) / math.sqrt(ps.get_data_parallel_world_size())


def format_duration(seconds: float) -> str:
    """4321.5 -> '1h12m02s' (no ':' and no '|', so '|'-separated log parsers keep working)."""
    total = max(0, int(round(seconds)))
    hours, rest = divmod(total, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s"


# ---- timers --------------------------------------------------------------------------------------

def timers_to_log(level: int) -> list[str]:
    """The timers training_log reports at --timing-log-level ``level``."""
    return list(_TIMERS_LEVEL_1 if level >= 1 else ()) + list(_TIMERS_LEVEL_2 if level >= 2 else ())


def attach_timers(args: argparse.Namespace, model_config, optimizer, device: str = "cpu"):
    """megatron-core ``Timers(--timing-log-level, --timing-log-option)``, set where Megatron-LM
    sets them: ``config.timers`` of the model (megatron-core's schedules, forward/backward
    steps, ``finalize_model_grads``) and of the optimizer (its ``optimizer-*`` timers); and the
    optimizer's ``log_num_zeros_in_grad``. Under megatron-core's own schedule they are its
    ``Timers`` (a device synchronize at each start and stop, a barrier at level 1, as in
    Megatron-LM). Under ours they neither synchronize nor barrier (:mod:`.timers`: CUDA events
    on ``device`` "cuda"): inside a stage's step a barrier is the pipeline-wide wait that 2BW's
    deferred step removes (and it would sit between a stage's sends and receives), and a
    device synchronize waits for the deferred step's all-reduces in flight."""
    from megatron_2bw.training.timers import syncs_device, timers_for

    timers = timers_for(args.pipeline_schedule, args.timing_log_level, args.timing_log_option,
                        torch.device(device))
    barrier = syncs_device(args.pipeline_schedule)
    model_config.timers, model_config.barrier_with_L1_time = timers, barrier
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.config.timers, inner.config.barrier_with_L1_time = timers, barrier
        inner.config.log_num_zeros_in_grad = args.log_num_zeros_in_grad
    return timers


@contextlib.contextmanager
def timers_detached(config):
    """No megatron-core timer runs inside (evaluation: its forwards are not training time)."""
    timers, config.timers = config.timers, None
    try:
        yield
    finally:
        config.timers = timers


def stage_bubble_fraction(timers, level: int) -> float | None:
    """1 - (forward-compute + backward-compute) / forward-backward, of this rank, since the last
    log line (at --timing-log-level 2 only; None before any forward-backward time)."""
    if level < 2:
        return None
    fb, fwd, bwd = (timers(name).elapsed(reset=False)
                    for name in ("forward-backward", "forward-compute", "backward-compute"))
    return 1.0 - (fwd + bwd) / fb if fb > 0 else None


# ---- what is logged ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LogFlags:
    """The flags the logger reads, with Megatron-LM's defaults (``LoggerConfig``)."""

    log_interval: int = 100
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False
    log_throughput: bool = False
    timing_log_level: int = 0
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    save: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LogFlags":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name)})


@dataclasses.dataclass
class IntervalStats:
    """Training_log's ``total_loss_dict``: the iterations since the last log line. ``losses``
    holds the main loss ("lm loss") of each iteration, ``by_key`` every loss of the loss dict
    ("lm loss", "sop loss", ...) in its order."""

    losses: list = dataclasses.field(default_factory=list)
    skipped: int = 0
    nan: int = 0
    by_key: dict = dataclasses.field(default_factory=dict)

    def add(self, loss: float | None, succeeded: bool, losses: dict | None = None) -> None:
        self.losses.append(loss)
        for key, value in (losses or {}).items():
            self.by_key.setdefault(key, []).append(value)
        self.skipped += not succeeded
        self.nan += (not succeeded) and loss is not None and not math.isfinite(loss)

    def take(self) -> "IntervalStats":
        """This interval's numbers; the accumulator starts over."""
        done = IntervalStats(self.losses, self.skipped, self.nan, self.by_key)
        self.losses, self.skipped, self.nan, self.by_key = [], 0, 0, {}
        return done

    def mean_losses(self) -> dict[str, float]:
        """Each loss of the loss dict averaged over the interval's iterations."""
        return {key: sum(values) / len(values) for key, values in self.by_key.items()}

    @property
    def iterations(self) -> int:
        return len(self.losses)

    @property
    def mean_loss(self) -> float | None:
        """Mean over the interval's iterations (None on ranks without the loss)."""
        if not self.losses or self.losses[-1] is None:
            return None
        return sum(self.losses) / len(self.losses)


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One iteration's numbers, as training_log writes them to TensorBoard."""

    iteration: int
    consumed_samples: int
    learning_rate: float | None
    batch_size: int
    losses: dict  # loss key -> this iteration's value (None on ranks without it)
    loss_scale: float
    world_size: int
    grad_norm: float | None = None
    num_zeros: float | None = None
    params_norm: float | None = None


class IterationLog:
    """What one logged interval measured, and its line."""

    def __init__(self, iteration: int, train_iters: int, seconds_per_iteration: float,
                 lr: float, loss: float, grad_norm: float | None, consumed_samples: int,
                 global_batch_size: int, seq_length: int, flops_per_iteration: float,
                 world_size: int, peak_mem_mib: float, skipped: int = 0, *,
                 loss_key: str = "lm loss", loss_scale: float = 1.0,
                 num_zeros: float | None = None, params_norm: float | None = None,
                 nan_iterations: int = 0, log_throughput: bool = False,
                 losses: dict | None = None):
        self.iteration = iteration
        self.train_iters = train_iters
        self.seconds = seconds_per_iteration
        self.lr = lr
        self.loss_key, self.loss = loss_key, loss
        self.losses = losses or {loss_key: loss}  # every loss, printed in this order
        self.grad_norm = grad_norm
        self.consumed_samples = consumed_samples
        self.samples_per_s = global_batch_size / seconds_per_iteration
        self.tokens_per_s = self.samples_per_s * seq_length
        self.tflops_per_device = flops_per_iteration / seconds_per_iteration / world_size / 1e12
        self.peak_mem_mib = peak_mem_mib
        self.global_batch_size = global_batch_size
        self.skipped = skipped
        self.loss_scale, self.num_zeros, self.params_norm = loss_scale, num_zeros, params_norm
        self.nan_iterations = nan_iterations
        self.log_throughput = log_throughput
        self.eta_seconds = (train_iters - iteration) * seconds_per_iteration

    def line(self) -> str:
        """training_log's line, field for field (names, order, formats; throughput per GPU is
        our Eq. 3 estimate, as in the TFLOP/s per device field), then ours: samples/s, tokens/s,
        TFLOP/s per device, peak memory (MiB) and the ETA (remaining iterations x this interval's
        time per iteration; evaluations and checkpoints not counted)."""
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        out = (f" [{stamp}] iteration {self.iteration:8d}/{self.train_iters:8d} |"
               f" consumed samples: {self.consumed_samples:12d} |"
               f" elapsed time per iteration (ms): {self.seconds * 1000.0:.1f} |")
        if self.log_throughput:
            out += f" throughput per GPU (TFLOP/s/GPU): {self.tflops_per_device:.1f} |"
        out += f" learning rate: {self.lr:.6E} | global batch size: {self.global_batch_size:5d} |"
        out += "".join(f" {key}: {value:.6E} |" for key, value in self.losses.items())
        out += f" loss scale: {self.loss_scale:.1f} |"
        if self.grad_norm is not None:
            out += f" grad norm: {self.grad_norm:.3f} |"
        if self.num_zeros is not None:
            out += f" num zeros: {self.num_zeros} |"
        if self.params_norm is not None:
            out += f" params norm: {self.params_norm:.3f} |"
        out += (f" number of skipped iterations: {self.skipped:3d} |"
                f" number of nan iterations: {self.nan_iterations:3d} |")
        return out + (f" samples/s: {self.samples_per_s:.2f} | tokens/s: {self.tokens_per_s:.0f} |"
                      f" TFLOP/s per device: {self.tflops_per_device:.4f} |"
                      f" peak memory (MiB): {self.peak_mem_mib:.0f} |"
                      f" ETA: {format_duration(self.eta_seconds)} |")


class Logger:
    """Prints on one rank (the last, which holds the loss) and writes its scalars to TensorBoard
    and, when asked and installed, W&B."""

    def __init__(self, is_logging_rank: bool, tensorboard_dir: str | None = None,
                 flags: LogFlags | None = None, device: str = "cpu"):
        self.enabled = is_logging_rank
        self.flags = dataclasses.replace(flags or LogFlags(), tensorboard_dir=tensorboard_dir)
        self.device = device
        self.writer = self.wandb = None
        if self.enabled and tensorboard_dir:
            self.writer = _tensorboard_writer(tensorboard_dir, self.flags.tensorboard_queue_size)
        if self.enabled and self.flags.wandb_project:
            self.wandb = _wandb_run(self.flags)

    def print(self, text: str) -> None:
        """One write per message, newline included: on an unbuffered stream shared with other
        ranks (torchrun's console, a test's pipe), print()'s separate write of the newline lets
        another process's output land inside the line."""
        if self.enabled:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def scalars(self, values: dict, iteration: int, consumed_samples: int | None = None) -> None:
        """Each value at ``iteration``; with ``consumed_samples`` also as '<tag> vs samples'
        (TensorBoard only, as Megatron-LM). None values are left out."""
        values = {tag: float(v) for tag, v in values.items() if v is not None}
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, iteration)
                if consumed_samples is not None:
                    self.writer.add_scalar(f"{tag} vs samples", value, consumed_samples)
        if self.wandb is not None and values:
            self.wandb.log(values, iteration)

    def step(self, s: StepStats) -> None:
        """training_log's per-iteration scalars (every --tensorboard-log-interval)."""
        f = self.flags
        values = {"learning-rate": s.learning_rate, "batch-size": s.batch_size, **s.losses}
        if f.log_loss_scale_to_tensorboard:
            values["loss-scale"] = s.loss_scale
        if f.log_world_size_to_tensorboard:
            values["world-size"] = s.world_size
        values.update({"grad-norm": s.grad_norm, "num-zeros": s.num_zeros,
                       "params-norm": s.params_norm})
        self.scalars(values, s.iteration, s.consumed_samples)
        if f.log_memory_to_tensorboard and self.enabled:
            self.scalars(memory_scalars(self.device), s.iteration)

    def iteration(self, log: IterationLog) -> None:
        """The log line, and with --log-timers-to-tensorboard the interval's time and
        throughput."""
        self.print(log.line())
        if self.flags.log_timers_to_tensorboard:
            self.scalars({"iteration-time": log.seconds,
                          "throughput": log.tflops_per_device if self.flags.log_throughput
                          else None}, log.iteration)

    def timers(self, timers, iteration: int, extra: dict | None = None) -> None:
        """training_log's timers (a collective over all ranks at --timing-log-level >= 1): with
        --log-timers-to-tensorboard the max over ranks as '<name>-time' and ``extra`` (our
        schedule's tags), then the text block on the logging rank; the timers start over."""
        names, f = timers_to_log(self.flags.timing_log_level), self.flags
        if f.log_timers_to_tensorboard:
            timers.write(names, self.writer, iteration, normalizer=f.log_interval, reset=False)
            if f.wandb_project:  # a collective too: every rank calls it
                timers.write(names, self.wandb, iteration, normalizer=f.log_interval, reset=False)
            self.scalars(extra or {}, iteration)
        text = timers.get_all_timers_string(names, normalizer=f.log_interval, reset=True)
        if text:
            self.print(text)

    def validation(self, iteration: int, losses: dict[str, float] | float,
                   split: str = "validation", consumed_samples: int | None = None,
                   loss_key: str = "lm loss") -> None:
        """evaluate_and_print_results' block (its format) and scalars, for each loss of
        ``losses`` (a float is ``{loss_key: losses}``)."""
        if not isinstance(losses, dict):
            losses = {loss_key: losses}
        line, values = f" {split} loss at iteration {iteration} | ", {}
        for key, loss in losses.items():
            ppl = math.exp(min(20.0, loss))
            line += f"{key} value: {loss:.6E} | {key} PPL: {ppl:.6E} | "
            values[f"{key} {split}"] = loss
            if self.flags.log_validation_ppl_to_tensorboard:
                values[f"{key} {split} ppl"] = ppl
        bar = "-" * (len(line) + 1)
        self.print(f"{bar}\n{line}\n{bar}")
        self.scalars(values, iteration, consumed_samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _tensorboard_writer(directory: str, queue_size: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("warning: --tensorboard-dir given but the tensorboard package is not installed "
              "(pip install tensorboard); no TensorBoard logs are written", file=sys.stderr)
        return None
    print(f" > setting tensorboard: {directory}", flush=True)
    return SummaryWriter(log_dir=directory, max_queue=queue_size)


def _wandb_run(flags: LogFlags):
    """Megatron-LM's W&B writer (global_vars._set_wandb_writer): the ``wandb`` module after
    ``wandb.init``, or None with one line when the package is not installed."""
    try:
        import wandb
    except ImportError:
        print(f"warning: --wandb-project {flags.wandb_project} given but the wandb package is "
              "not installed (pip install wandb); not logging to W&B", flush=True)
        return None
    save_dir = flags.wandb_save_dir or os.path.join(flags.save or ".", "wandb")
    os.makedirs(save_dir, exist_ok=True)
    wandb.init(dir=save_dir, name=flags.wandb_exp_name, project=flags.wandb_project,
               config=dataclasses.asdict(flags))
    return wandb
