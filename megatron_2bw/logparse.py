"""Read back what the training loop prints (``megatron_2bw.training.logs``), and Megatron-LM's
own training logs (``training_log()`` in megatron/training/training.py, core_v0.16.1).

    log = parse_log(text)
    log.iterations[-1].ms_per_iteration, log.validations[-1].loss, log.rank_memory_mib

Lines are split at ``|`` into ``name: value`` fields, so fields may move or be added without
breaking the parser; a line without the fields a record needs is skipped. Megatron-LM's logs
have no header line: their printed arguments (``---- arguments ----``) make the run's header,
with Megatron's own schedule unless a ``pipeline_schedule`` argument says otherwise. Tools
that launch runs add one line per process with its peak memory (:func:`rank_memory_line`).

Invariant: our lines and Megatron-LM's parse into the same records (samples/s and TFLOP/s
derived where Megatron-LM's line lacks them). The format: docs/megatron_lm_compatibility.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

__all__ = ["IterationRecord", "ValidationRecord", "RunHeader", "ParsedLog", "parse_iteration",
           "parse_validation", "parse_header", "header_from_arguments", "parse_log",
           "rank_memory_line"]


@dataclass(frozen=True)
class IterationRecord:
    """One logged interval (means over the iterations since the previous log line)."""

    iteration: int
    train_iters: int
    ms_per_iteration: float
    loss: float
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    tflops_per_device: float | None = None
    peak_memory_mib: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    global_batch_size: int | None = None
    skipped: int | None = None
    loss_scale: float | None = None
    eta_s: float | None = None
    """Our estimate of the time left (remaining iterations x this interval's time)."""


@dataclass(frozen=True)
class ValidationRecord:
    iteration: int
    loss: float
    split: str = "validation"


@dataclass(frozen=True)
class RunHeader:
    """Schedule and layout: the loop's first line, or Megatron-LM's arguments block."""

    schedule: str
    world_size: int
    device: str
    tp: int
    pp: int
    dp: int
    microbatches: int


@dataclass
class ParsedLog:
    iterations: list[IterationRecord] = field(default_factory=list)
    validations: list[ValidationRecord] = field(default_factory=list)
    header: RunHeader | None = None
    rank_memory_mib: dict[int, float] = field(default_factory=dict)
    """rank -> peak memory (MiB), from :func:`rank_memory_line` lines."""
    arguments: dict[str, str] = field(default_factory=dict)
    """Megatron-LM's printed arguments, name -> value as printed (empty when none)."""

    def valid(self, split: str = "validation") -> list[ValidationRecord]:
        return [v for v in self.validations if v.split == split]


_ITERATION = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)")
_VALIDATION = re.compile(r"([\w-]+) loss at iteration (\d+)( on test set)?")
_HEADER = re.compile(r"training (\S+) schedule on (\d+) (\S+) process(?:es)?: "
                     r"TP=(\d+) PP=(\d+) DP=(\d+), (\d+) microbatch")
_RANK_MEMORY = re.compile(r"^\s*rank (\d+) peak memory \(MiB\): ([-+0-9.eE]+)\s*$")
_DURATION = re.compile(r"^\s*(\d+)h(\d+)m(\d+)s")
_ARGUMENTS_BEGIN = re.compile(r"^-+ arguments -+\s*$")
_ARGUMENTS_END = re.compile(r"^-+ end of arguments -+\s*$")
_ARGUMENT = re.compile(r"^\s+(\w+) \.+ (.*?)\s*$")  # "  name ....... value"
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)", re.I)


def _fields(line: str) -> dict[str, str]:
    """'a: 1 | b c: 2' -> {'a': '1', 'b c': '2'} (the first ':' of each part splits it)."""
    out = {}
    for part in line.split("|"):
        name, sep, value = part.partition(":")
        if sep:
            out[name.strip()] = value.strip()
    return out


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    match = _NUMBER.match(text.strip())
    return float(match.group(0)) if match else None


def _integer(text: str | None) -> int | None:
    value = _number(text)
    return None if value is None or math.isnan(value) else int(value)


def _duration(text: str | None) -> float | None:
    """'1h02m03s' -> 3723.0"""
    match = _DURATION.match(text or "")
    if match is None:
        return None
    hours, minutes, seconds = map(int, match.groups())
    return hours * 3600.0 + minutes * 60.0 + seconds


def _first(fields: dict[str, str], *names: str) -> str | None:
    """The value of the first of ``names`` the line has (our name, then Megatron-LM's)."""
    return next((fields[n] for n in names if n in fields), None)


def parse_iteration(line: str) -> IterationRecord | None:
    """The record of a training log line (ours or Megatron-LM's), or None for any other line."""
    head = _ITERATION.search(line.split("|", 1)[0])
    if head is None:
        return None
    f = _fields(line)
    ms, loss = _number(f.get("elapsed time per iteration (ms)")), _number(f.get("lm loss"))
    if ms is None or loss is None:
        return None
    batch = _integer(f.get("global batch size"))
    samples_per_s = _number(f.get("samples/s"))
    if samples_per_s is None and batch is not None and ms > 0:
        samples_per_s = batch / (ms / 1000.0)
    return IterationRecord(
        iteration=int(head.group(1)), train_iters=int(head.group(2)), ms_per_iteration=ms,
        loss=loss, samples_per_s=samples_per_s, tokens_per_s=_number(f.get("tokens/s")),
        tflops_per_device=_number(_first(f, "TFLOP/s per device",
                                         "throughput per GPU (TFLOP/s/GPU)")),
        peak_memory_mib=_number(f.get("peak memory (MiB)")),
        learning_rate=_number(f.get("learning rate")), grad_norm=_number(f.get("grad norm")),
        global_batch_size=batch,
        skipped=_integer(_first(f, "skipped iterations", "number of skipped iterations")),
        loss_scale=_number(f.get("loss scale")), eta_s=_duration(f.get("ETA")))


def parse_validation(line: str) -> ValidationRecord | None:
    """' validation loss at iteration 50 | lm loss value: 4.8E+00 | ...' -> its record."""
    head = _VALIDATION.search(line.split("|", 1)[0])
    loss = _number(_fields(line).get("lm loss value"))
    if head is None or loss is None:
        return None
    split = "test" if head.group(3) else head.group(1)  # Megatron-LM: "... on test set"
    return ValidationRecord(iteration=int(head.group(2)), loss=loss, split=split)


def parse_header(line: str) -> RunHeader | None:
    match = _HEADER.search(line)
    if match is None:
        return None
    schedule, world, device, tp, pp, dp, m = match.groups()
    return RunHeader(schedule, int(world), device, int(tp), int(pp), int(dp), int(m))


def header_from_arguments(arguments: dict[str, str]) -> RunHeader | None:
    """The run's header from Megatron-LM's arguments block (None without the layout in it):
    microbatches per batch = global batch / (micro batch x data-parallel size), the final
    global batch under --rampup-batch-size."""
    names = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
             "data_parallel_size", "global_batch_size", "micro_batch_size")
    values = [_integer(arguments.get(name)) for name in names]
    if None in values:
        return None
    world, tp, pp, dp, global_batch, micro_batch = values
    device = "cpu" if arguments.get("cpu") == "True" else "cuda"  # Megatron-LM: GPUs only
    return RunHeader(arguments.get("pipeline_schedule", "megatron"), world, device, tp, pp, dp,
                     global_batch // (micro_batch * dp))


def rank_memory_line(rank: int, mib: float) -> str:
    """The line a launcher prints for one process's peak memory (read by :func:`parse_log`)."""
    return f" rank {rank} peak memory (MiB): {mib:.0f}"


def parse_log(text: str) -> ParsedLog:
    """Every record in a log (torchrun's interleaved output of all ranks is fine); without our
    header line, the header comes from Megatron-LM's arguments block where it has one."""
    log = ParsedLog()
    in_arguments = False
    for line in text.splitlines():
        if in_arguments:
            argument = _ARGUMENT.match(line)
            if argument:
                log.arguments[argument.group(1)] = argument.group(2)
                continue
            in_arguments = not _ARGUMENTS_END.match(line)
        if _ARGUMENTS_BEGIN.match(line):
            in_arguments = True
            continue
        if "|" in line:
            record = parse_iteration(line)
            if record is not None:
                log.iterations.append(record)
                continue
            validation = parse_validation(line)
            if validation is not None:
                log.validations.append(validation)
                continue
        memory = _RANK_MEMORY.match(line)
        if memory:
            log.rank_memory_mib[int(memory.group(1))] = float(memory.group(2))
        elif log.header is None:
            log.header = parse_header(line)
    if log.header is None:
        log.header = header_from_arguments(log.arguments)
    return log
