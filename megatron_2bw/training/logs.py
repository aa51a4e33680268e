"""Training-log lines, throughput and model-FLOPs estimates, TensorBoard scalars."""

from __future__ import annotations

import argparse
import datetime
import resource
import sys

import torch

__all__ = ["transformer_flops_per_iteration", "peak_memory_mib", "IterationLog", "Logger"]


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


class IterationLog:
    """What one logged interval measured."""

    def __init__(self, iteration: int, train_iters: int, seconds_per_iteration: float,
                 lr: float, loss: float, grad_norm: float | None, consumed_samples: int,
                 global_batch_size: int, seq_length: int, flops_per_iteration: float,
                 world_size: int, peak_mem_mib: float, skipped: int = 0):
        self.iteration = iteration
        self.train_iters = train_iters
        self.seconds = seconds_per_iteration
        self.lr = lr
        self.loss = loss
        self.grad_norm = grad_norm
        self.consumed_samples = consumed_samples
        self.samples_per_s = global_batch_size / seconds_per_iteration
        self.tokens_per_s = self.samples_per_s * seq_length
        self.tflops_per_device = flops_per_iteration / seconds_per_iteration / world_size / 1e12
        self.peak_mem_mib = peak_mem_mib
        self.global_batch_size = global_batch_size
        self.skipped = skipped

    def line(self) -> str:
        grad = "n/a" if self.grad_norm is None else f"{self.grad_norm:.3f}"
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        return (f" [{stamp}] iteration {self.iteration:6d}/{self.train_iters:6d} |"
                f" consumed samples: {self.consumed_samples:9d} |"
                f" elapsed time per iteration (ms): {self.seconds * 1000:.1f} |"
                f" learning rate: {self.lr:.3E} | global batch size: {self.global_batch_size} |"
                f" lm loss: {self.loss:.6E} | grad norm: {grad} |"
                f" skipped iterations: {self.skipped} |"
                f" samples/s: {self.samples_per_s:.2f} | tokens/s: {self.tokens_per_s:.0f} |"
                f" TFLOP/s per device: {self.tflops_per_device:.4f} |"
                f" peak memory (MiB): {self.peak_mem_mib:.0f}")


class Logger:
    """Prints on one rank (the last, which holds the loss) and mirrors to TensorBoard."""

    def __init__(self, is_logging_rank: bool, tensorboard_dir: str | None):
        self.enabled = is_logging_rank
        self.writer = None
        if self.enabled and tensorboard_dir:
            self.writer = _tensorboard_writer(tensorboard_dir)

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def iteration(self, log: IterationLog) -> None:
        self.print(log.line())
        if self.writer is not None:
            for name, value in (("lm-loss", log.loss), ("learning-rate", log.lr),
                                ("grad-norm", log.grad_norm), ("samples-per-s", log.samples_per_s),
                                ("tokens-per-s", log.tokens_per_s)):
                if value is not None:
                    self.writer.add_scalar(name, value, log.iteration)

    def validation(self, iteration: int, loss: float, split: str = "validation") -> None:
        ppl = float(torch.exp(torch.tensor(min(loss, 20.0))))
        bar = "-" * 80
        self.print(f"{bar}\n {split} loss at iteration {iteration} | lm loss value: {loss:.6E} |"
                   f" lm loss PPL: {ppl:.6E}\n{bar}")
        if self.writer is not None:
            self.writer.add_scalar(f"lm-loss-{split}", loss, iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _tensorboard_writer(directory: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("warning: --tensorboard-dir given but the tensorboard package is not installed; "
              "pip install tensorboard", file=sys.stderr)
        return None
    return SummaryWriter(log_dir=directory)
