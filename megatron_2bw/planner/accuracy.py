"""Predicted against measured: the cost model's prediction for each end-to-end run
(`compare`, `format_accuracy`: the table of `plan.py report`), and the calibration that scales
a layer profile to a whole measured iteration (`calibrate`).

    rows = compare(E2EProfile.load("e2e.json"), CostModel(model, cluster, "fp32", profile=p))
    print(format_accuracy(rows))
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from .cluster import preset
from .cost import CostModel, Layout
from .e2e import E2EProfile, run_end_to_end
from .profile import Profile

__all__ = ["Accuracy", "compare", "format_accuracy", "calibrate"]


def calibrate(profile: Profile, micro_batch: int, microbatches: int = 4, devices: int = 1,
              train_iters: int = 10, cpu: bool = True,
              log: Callable[[str], None] = lambda s: None) -> Profile:
    """Set `profile.compute_scale`: train the whole profiled model on one device (t = d = w = 1,
    `microbatches` of `micro_batch` each), `devices` independent copies at once, one per
    device, and take the slowest copy's measured = scale x (compute + optimizer). With every
    local device busy, as in the runs planned, the scale holds what devices sharing a machine
    cost each other (CPU cores sharing caches and memory bandwidth) and the work the parts
    leave out; no communication enters it (the copies exchange nothing), so an error of the
    link model is not folded into compute. Returns the profile."""
    layout = Layout(1, 1, 1, micro_batch, microbatches, False, "megatron")
    measured = run_end_to_end(profile.model, [layout], profile.precision, train_iters=train_iters,
                              log_interval=1, cpu=cpu, log=log, copies=devices).runs[0]
    if measured.seconds_per_iteration is None:
        log(f"calibration failed ({measured.error}); compute_scale stays 1")
        return profile
    profile.compute_scale = 1.0
    cluster = preset("cpu-local" if profile.device == "cpu" else "dgx-h100", gpus_per_node=1)
    estimate = CostModel(profile.model, cluster, profile.precision, profile=profile).time(layout)
    profile.compute_scale = measured.seconds_per_iteration / estimate.iteration
    profile.calibration = {"layout": layout.label(), "copies": devices,
                           "measured_s": measured.seconds_per_iteration,
                           "predicted_s": estimate.iteration}
    if measured.peak_memory_bytes and profile.device == "cpu":
        # The resident set of a training process holds more than the tensors and the imported
        # modules (process groups, the data pipeline, the allocator's free lists): the
        # overhead is what the run's peak leaves after the modelled tensors.
        tensors = CostModel(profile.model, cluster, profile.precision, profile=profile).memory(
            layout).stages[-1].total - profile.runtime_overhead_bytes
        profile.calibration["imported_bytes"] = profile.runtime_overhead_bytes
        profile.runtime_overhead_bytes = max(measured.peak_memory_bytes - tensors,
                                             profile.runtime_overhead_bytes)
    log(f"calibration {layout.label()} x {devices} at once: measured "
        f"{measured.seconds_per_iteration * 1e3:.1f} ms, parts predict "
        f"{estimate.iteration * 1e3:.1f} ms -> compute scale "
        f"{profile.compute_scale:.3f}; runtime memory "
        f"{profile.runtime_overhead_bytes / 2**20:.0f} MiB")
    return profile


@dataclass(frozen=True)
class Accuracy:
    """One end-to-end run against the cost model's prediction for its layout."""

    layout: Layout
    predicted_s: float
    measured_s: float | None
    predicted_memory_bytes: float
    """The logging rank's: the last pipeline stage (it prints the training log)."""
    measured_memory_bytes: float | None
    error: str | None = None
    load_average: float | None = None
    fastest_s: float | None = None

    @property
    def time_error(self) -> float | None:
        """(predicted - measured) / measured."""
        if not self.measured_s:
            return None
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def fastest_error(self) -> float | None:
        """Against the fastest interval (the least disturbed on a shared machine)."""
        if not self.fastest_s:
            return None
        return (self.predicted_s - self.fastest_s) / self.fastest_s

    @property
    def memory_error(self) -> float | None:
        if not self.measured_memory_bytes:
            return None
        return ((self.predicted_memory_bytes - self.measured_memory_bytes)
                / self.measured_memory_bytes)


def compare(e2e: E2EProfile, cost: CostModel, simulate: bool = True) -> list[Accuracy]:
    """Predict every run of `e2e` with `cost`."""
    rows = []
    for run in e2e.runs:
        layout = run.layout
        time_estimate = cost.time(layout, simulate=simulate)
        memory = cost.memory(layout).stages[-1].total
        rows.append(Accuracy(layout, time_estimate.iteration, run.seconds_per_iteration,
                             memory, run.peak_memory_bytes, run.error, run.load_average,
                             run.fastest_s))
    return rows


def format_accuracy(rows: Sequence[Accuracy]) -> str:
    """The predicted-vs-measured table."""
    def pct(x):
        return "    -" if x is None else f"{x * 100:+5.1f}%"

    def ms(x):
        return "       -" if x is None else f"{x * 1e3:8.1f}"

    def mib(x):
        return "      -" if x is None else f"{x / 2**20:7.0f}"

    lines = [f"{'layout':<28} {'pred ms':>8} {'meas ms':>8} {'error':>6}  {'fastest':>8} "
             f"{'error':>6}   {'pred MiB':>8} {'meas MiB':>8} {'error':>6}  {'load':>4}"]
    for r in rows:
        load = "   -" if r.load_average is None else f"{r.load_average:4.1f}"
        lines.append(f"{r.layout.label():<28} {ms(r.predicted_s)} {ms(r.measured_s)} "
                     f"{pct(r.time_error)}  {ms(r.fastest_s)} {pct(r.fastest_error)}   "
                     f"{mib(r.predicted_memory_bytes)}  {mib(r.measured_memory_bytes)} "
                     f"{pct(r.memory_error)}  {load}" + (f"   ({r.error})" if r.error else ""))
    errors = [abs(r.time_error) for r in rows if r.time_error is not None]
    if errors:
        lines.append(f"time (median interval): mean |error| {statistics.fmean(errors) * 100:.1f}%, "
                     f"max {max(errors) * 100:.1f}%; fastest: the least disturbed interval; "
                     f"load: the machine's 1-minute load average during the run")
    return "\n".join(lines)
