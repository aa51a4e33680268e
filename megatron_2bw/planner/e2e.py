"""End-to-end profile: whole configurations trained for a few iterations with torchrun on
`pretrain_gpt_2bw.py` (`pretrain_bert_2bw.py` for BERT) with `--mock-data`, the time per
iteration and peak memory read from the training log (`megatron_2bw.logparse`).

    e2e = run_end_to_end(model, [Layout(1, 2, 1, 4, 4, False, "2bw")], "fp32", log=print)
    e2e.save("e2e.json")   # an `E2EProfile`: what `plan.py --measured` reads
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from megatron_2bw.flag_types import FlagError
from megatron_2bw.logparse import parse_log
from megatron_2bw.runtime.ports import free_port

from .cluster import cpu_name
from .cost import Layout
from .flags import entry_script, launch_flags, parse_for_validation
from .model import ModelSpec
from .profile import PRECISIONS, JsonFile, check_count, check_nonneg, require

__all__ = ["E2ERun", "E2EProfile", "run_end_to_end", "check_layouts", "relative_command",
           "absolute_command", "REPO"]

REPO = Path(__file__).resolve().parents[2]
"""The checkout whose entry scripts the runs launch."""


# ---- end-to-end profile -------------------------------------------------------------------

PATH_FLAGS = frozenset({"--data-path", "--tokenizer-model", "--data-cache-path", "--vocab-file",
                        "--merge-file", "--save", "--load"})
"""Training flags whose values are files or folders."""


def _path_positions(command: Sequence[str]) -> list[int]:
    """Indices of the file paths in a recorded command: the entry script (`*.py`) and the
    values after each flag of `PATH_FLAGS` (up to the next flag)."""
    positions, in_path_flag = [], False
    for i, word in enumerate(command):
        if word.startswith("--"):
            in_path_flag = word in PATH_FLAGS
        elif in_path_flag or word.endswith(".py"):
            positions.append(i)
    return positions


def relative_command(command: Sequence[str], folder: str | os.PathLike) -> tuple[str, ...]:
    """`command` with each absolute path made relative to `folder` (for a file saved there)."""
    out = list(command)
    for i in _path_positions(out):
        if os.path.isabs(out[i]):
            out[i] = os.path.relpath(out[i], folder)
    return tuple(out)


def absolute_command(command: Sequence[str], folder: str | os.PathLike) -> tuple[str, ...]:
    """The inverse of `relative_command`: each relative path joined to `folder`."""
    out = list(command)
    for i in _path_positions(out):
        if not os.path.isabs(out[i]):
            out[i] = os.path.normpath(os.path.join(folder, out[i]))
    return tuple(out)


LAYOUT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Layout)}
"""The layout's fields (dataclasses.MISSING where required), which a run's JSON object holds
flat beside the measurements: every required one, the others where not at their default."""


@dataclass(frozen=True)
class E2ERun:
    """One layout trained for a few iterations."""

    layout: Layout
    precision: str
    seconds_per_iteration: float | None
    """Median of the logged intervals after the first (which holds the warm-up)."""
    peak_memory_bytes: float | None
    """Largest "peak memory (MiB)" logged: the last rank's (it prints the log)."""
    intervals: tuple[float, ...] = ()
    """Each logged interval's time per iteration, the first included."""
    command: tuple[str, ...] = ()
    """The launcher's arguments (after the launcher itself), paths absolute in memory."""
    error: str | None = None
    fastest_s: float | None = None
    """Fastest logged interval after the first: on a shared machine the least disturbed one."""
    load_average: float | None = None
    """Higher 1-minute load average of the machine at the run's start and end (CPU runs share
    the cores with whatever else runs)."""

    def to_json(self, folder: str | os.PathLike | None = None) -> dict:
        """One flat object: the layout's fields (those at their defaults left out), then the
        measurements; with `folder`, the command's paths relative to it."""
        layout = {name: value for name, default in LAYOUT_DEFAULTS.items()
                  if (value := getattr(self.layout, name)) != default}
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "layout"}
        data["intervals"] = list(self.intervals)
        data["command"] = list(relative_command(self.command, folder) if folder is not None
                               else self.command)
        return {**layout, **data}

    @classmethod
    def from_json(cls, data, where: str, folder: str | os.PathLike | None) -> "E2ERun":
        require(isinstance(data, dict), where, f"expected an object, got {data!r}")
        layout = {name: data[name] for name in LAYOUT_DEFAULTS if name in data}
        for name in ("t", "d", "w", "b", "m", "v"):
            if name in layout or LAYOUT_DEFAULTS[name] is dataclasses.MISSING:
                check_count(layout.get(name), f"{where}.{name}")
        command = tuple(data.get("command", ()))
        measured = {k: v for k, v in data.items() if k not in LAYOUT_DEFAULTS}
        run = cls(**{**measured, "layout": Layout(**layout),
                     "intervals": tuple(data.get("intervals", ())),
                     "command": absolute_command(command, folder) if folder else command})
        require(run.precision in PRECISIONS, f"{where}.precision",
                f"expected one of {', '.join(PRECISIONS)}, got {run.precision!r}")
        check_nonneg(run.seconds_per_iteration, f"{where}.seconds_per_iteration", True)
        check_nonneg(run.peak_memory_bytes, f"{where}.peak_memory_bytes", True)
        check_nonneg(run.fastest_s, f"{where}.fastest_s", True)
        return run


@dataclass
class E2EProfile(JsonFile):
    """Layouts of one model trained on one kind of device: what `plan.py --measured` and
    `plan.py report` read."""

    model: ModelSpec
    device_name: str
    runs: list[E2ERun] = field(default_factory=list)
    created: str = ""

    FORMAT = "megatron-2bw end-to-end profile v1"

    def to_json(self, folder: str | os.PathLike | None = None) -> dict:
        """With `folder`, each run's paths relative to it."""
        return {"model": self.model.to_json(), "device_name": self.device_name,
                "runs": [run.to_json(folder) for run in self.runs], "created": self.created,
                "format": self.FORMAT}

    @classmethod
    def from_json(cls, data: dict, folder: str | os.PathLike | None = None) -> "E2EProfile":
        """The runs in `data`, their relative paths joined to `folder` (the file's)."""
        return cls(**cls.read_fields(
            data, "runs", lambda run, where: E2ERun.from_json(run, where, folder)))


def _mock_data_supported() -> bool:
    try:
        from megatron_2bw.data import gpt

        return hasattr(gpt, "build_mock_gpt_datasets")
    except ImportError:
        return False


def _data_flags(model: ModelSpec, scratch: Path) -> tuple[list[str], ModelSpec]:
    """--mock-data where the data module has it; else a tiny corpus built once."""
    if _mock_data_supported():
        return ["--mock-data", "--vocab-size", str(model.vocab_size)], model
    from megatron_2bw.data.default import prepare_default_data

    data = prepare_default_data(scratch / "data", vocab_size=512, max_chars=200_000)
    flags = ["--data-path", data.data_prefix, "--tokenizer-model", data.tokenizer_model,
             "--data-cache-path", str(scratch / "index-cache")]
    return flags, dataclasses.replace(model, vocab_size=512)


def _command_flags(layout: Layout, model: ModelSpec, precision: str, data_flags: Sequence[str],
                   train_iters: int, log_interval: int, cpu: bool) -> list[str]:
    """The entry script's flags for one run."""
    return [*launch_flags(layout, model, precision, cpu=cpu), *data_flags,
            "--train-iters", str(train_iters), "--log-interval", str(log_interval),
            "--eval-iters", "0", "--lr-warmup-iters", "0", "--distributed-timeout-minutes", "5"]


def check_layouts(model: ModelSpec, layouts: Sequence[Layout], precision: str, cpu: bool = True,
                  train_iters: int = 12) -> None:
    """Each layout's command through the entry script's own validator, before any runs:
    ValueError `layout <label>: <flag>: <what is wrong>` for the first one it refuses."""
    for layout in layouts:
        flags = _command_flags(layout, model, precision, ["--mock-data", "--vocab-size",
                                                          str(model.vocab_size)],
                               train_iters, 1, cpu)
        try:
            parse_for_validation(flags, model, world_size=layout.world)
        except FlagError as err:
            raise ValueError(f"layout {layout.label()}: {err}") from None


def run_end_to_end(model: ModelSpec, layouts: Sequence[Layout], precision: str = "fp32",
                   train_iters: int = 12, log_interval: int = 3, cpu: bool = True,
                   repeat: int = 1, idle_below: float | None = None,
                   timeout: float = 600.0, log: Callable[[str], None] = lambda s: None,
                   scratch: str | os.PathLike | None = None, copies: int = 1) -> E2EProfile:
    """Train each layout for `train_iters` iterations with torchrun on this
    machine (t d w processes) and read its log. With `repeat` > 1 each layout runs that many
    times and the fastest run is kept: other processes on the machine only ever slow a run
    down. With `idle_below`, each run first waits (up to 10 minutes) for the 1-minute load
    average to drop below it. With `copies` > 1 each run is that many independent launches
    at once, the slowest kept (`_run_one`)."""
    scratch = Path(scratch or tempfile.mkdtemp(prefix="plan-e2e-"))
    data_flags, model = _data_flags(model, scratch)
    profile = E2EProfile(model=model, device_name=cpu_name() if cpu else _cuda_name(),
                         created=datetime.datetime.now().isoformat(timespec="seconds"))
    for layout in layouts:
        runs = []
        for _ in range(max(repeat, 1)):
            if idle_below is not None:
                wait_for_idle(idle_below, log)
            runs.append(_run_one(layout, model, precision, data_flags, train_iters,
                                 log_interval, cpu, timeout, log, copies))
        timed = [r for r in runs if r.seconds_per_iteration is not None]
        profile.runs.append(min(timed, key=lambda r: r.seconds_per_iteration) if timed
                            else runs[-1])
    return profile


def _run_one(layout: Layout, model: ModelSpec, precision: str, data_flags: list[str],
             train_iters: int, log_interval: int, cpu: bool, timeout: float,
             log: Callable[[str], None], copies: int = 1) -> E2ERun:
    """One launch of `layout`; with `copies` > 1, that many independent launches at once (each
    its own torchrun and port) and the slowest copy's run: what the layout costs while every
    core is busy, without communication between the copies."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    commands = [[torchrun, "--nproc-per-node", str(layout.world),
                 "--master-port", str(free_port()), str(REPO / entry_script(model)),
                 *_command_flags(layout, model, precision, data_flags, train_iters,
                                 log_interval, cpu)] for _ in range(copies)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    at_once = f" ({copies} copies at once)" if copies > 1 else ""
    log(f"running {layout.label()}{at_once}: {' '.join(commands[0][1:])}")
    load_before = load_average()
    logs = [tempfile.TemporaryFile("w+") for _ in commands]  # no pipe to fill and block on
    launched = [subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
                for command, out in zip(commands, logs)]
    deadline = time.monotonic() + timeout
    runs = [_finished(process, out, command, layout, precision, train_iters, log_interval,
                      max(deadline - time.monotonic(), 1.0), timeout)
            for process, out, command in zip(launched, logs, commands)]
    run = max(runs, key=lambda r: (r.seconds_per_iteration is None,
                                   r.seconds_per_iteration or 0.0))
    run = dataclasses.replace(run, load_average=max(load_before, load_average()))
    log(f"  -> {run.seconds_per_iteration * 1e3:.1f} ms/iteration (load average "
        f"{run.load_average:.1f})" if run.seconds_per_iteration else f"  -> failed: {run.error}")
    return run


def _finished(process: subprocess.Popen, out, command: list[str], layout: Layout,
              precision: str, train_iters: int, log_interval: int, wait_s: float,
              timeout: float) -> E2ERun:
    """The run of a launched `process`, read from its log file `out` once it exits (killed
    after `wait_s`)."""
    error = None
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        error = f"timed out after {timeout:.0f} s"
    with out:
        out.seek(0)
        text = out.read()
    if error is None and process.returncode:
        error = f"exit {process.returncode}: " + _last_error(text)
    records = parse_log(text).iterations
    times = [r.ms_per_iteration / 1000 for r in records]
    mems = [r.peak_memory_mib for r in records if r.peak_memory_mib is not None]
    if not times and error is None:
        error = f"no iteration logged ({train_iters} iterations, --log-interval {log_interval})"
    steady = times[1:] or times  # the first interval holds the warm-up
    return E2ERun(layout=layout, precision=precision,
                  seconds_per_iteration=statistics.median(steady) if steady else None,
                  peak_memory_bytes=max(mems) * 2**20 if mems else None,
                  intervals=tuple(times), command=tuple(command[1:]), error=error,
                  fastest_s=min(steady) if steady else None)


def load_average() -> float:
    """The 1-minute load average (0 where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def wait_for_idle(below: float, log: Callable[[str], None], limit_s: float = 600.0) -> None:
    """Wait (up to `limit_s`) for the 1-minute load average to drop below `below`."""
    deadline = time.monotonic() + limit_s
    if load_average() >= below:
        log(f"  waiting for the load average ({load_average():.1f}) to drop below {below}")
    while load_average() >= below and time.monotonic() < deadline:
        time.sleep(5)


def _last_error(text: str) -> str:
    lines = [line for line in text.splitlines() if "error" in line.lower()]
    return lines[-1].strip()[:300] if lines else text.strip().splitlines()[-1][:300] if text else ""


def _cuda_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
