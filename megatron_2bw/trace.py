"""Timelines of pipeline schedules: records -> Chrome trace JSON and PNG (paper's Figures 1-3).

A record is one action as it ran on one stage: the executor's
:class:`~megatron_2bw.schedules.executor.TimelineRecord` (a real run) or the simulator's
:class:`~megatron_2bw.schedules.Span` (``records_from_simulation``); both become
:class:`TraceRecord`, which also carries the rank that wrote it.

    records = records_from_simulation(simulate(pipeline_actions("2bw", 4, 4, 3)))
    to_chrome_trace(records, "2bw.json")     # chrome://tracing or ui.perfetto.dev
    to_png(records, "2bw.png", "PipeDream-2BW, d=4, m=4")

Invariant: a rank's file (:func:`save_records`) opens with a header holding ``wall_offset``,
so :func:`merge_records` puts every rank on the wall clock, the earliest record at 0 (a file
without it is aligned on its own, and merge_records says so). docs/schedules.md has the format.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

__all__ = ["TraceRecord", "as_record", "records_from_simulation", "to_chrome_trace",
           "chrome_trace_events", "save_records", "load_records", "merge_records", "to_png",
           "stage_summary"]

_KINDS = ("F", "B", "I", "W", "S")


@dataclass(frozen=True)
class TraceRecord:
    """One action as it ran on a stage."""

    stage: int
    kind: str
    """'F' forward, 'B' backward, 'I'/'W' its input-/weight-gradient parts when split, 'S'
    optimizer step (makes weight version ``version``)."""
    microbatch: int | None
    """Global microbatch index (batch * m + j); None for a step."""
    version: int | None
    """Weight version read (F, B) or made (S)."""
    start: float
    end: float
    rank: int | None = None
    """Global rank that ran it (None for a simulation)."""

    @property
    def label(self) -> str:
        """'F3', 'B3' or 'S2' (the step that makes version 2)."""
        return f"S{self.version}" if self.kind == "S" else f"{self.kind}{self.microbatch}"


def as_record(obj, rank: int | None = None) -> TraceRecord:
    """A TraceRecord from anything with stage/kind/microbatch/version/start/end (an executor
    TimelineRecord, a simulator Span, a dict)."""
    get = obj.get if isinstance(obj, dict) else (lambda name, default=None: getattr(obj, name,
                                                                                    default))
    kind = get("kind")
    kind = getattr(kind, "value", kind)  # schedules.Kind is a str enum
    if kind not in _KINDS:
        raise ValueError(f"record kind must be one of {_KINDS}, got {kind!r}")
    rank = get("rank", None) if rank is None else rank
    return TraceRecord(int(get("stage")), kind, get("microbatch"), get("version"),
                       float(get("start")), float(get("end")), rank)


def records_from_simulation(result) -> list[TraceRecord]:
    """The spans of a :class:`~megatron_2bw.schedules.SimResult`, in simulator time units."""
    return [as_record(span) for span in result.spans]


# --- Chrome trace -------------------------------------------------------------------------------

def chrome_trace_events(records: Iterable, time_scale: float = 1e6) -> list[dict]:
    """Trace Event Format events: per stage a process ("stage i", pid = i) and per rank a thread
    of it (tid = rank, or the stage for a simulation), one complete ("X") event per record
    named like 'F3 v1'. ``time_scale`` converts record time to microseconds (1e6 for seconds)."""
    records = [as_record(r) for r in records]
    events = []
    for stage in sorted({r.stage for r in records}):
        events.append({"ph": "M", "name": "process_name", "pid": stage, "tid": 0,
                       "args": {"name": f"stage {stage}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": stage, "tid": 0,
                       "args": {"sort_index": stage}})
    for r in records:
        name = f"S{r.version}" if r.kind == "S" else f"{r.label} v{r.version}"
        events.append({
            "ph": "X", "name": name, "cat": _CATEGORIES[r.kind],
            "pid": r.stage, "tid": _tid(r),
            "ts": r.start * time_scale, "dur": (r.end - r.start) * time_scale,
            "args": {"microbatch": r.microbatch, "version": r.version,
                     **({"rank": r.rank} if r.rank is not None else {})},
        })
    return events


def _tid(record: TraceRecord) -> int:
    return record.stage if record.rank is None else record.rank


def to_chrome_trace(records: Iterable, path: str | os.PathLike, time_scale: float = 1e6) -> None:
    """Write ``{"traceEvents": [...]}`` to ``path`` (see :func:`chrome_trace_events`)."""
    trace = {"traceEvents": chrome_trace_events(records, time_scale), "displayTimeUnit": "ms"}
    Path(path).write_text(json.dumps(trace))


# --- per-rank record files ----------------------------------------------------------------------

def save_records(records: Iterable, path: str | os.PathLike, *, rank: int,
                 wall_offset: float | None = None, extra: dict | None = None) -> None:
    """Write one rank's records (``start``/``end`` in this process's ``time.perf_counter()``)
    as JSON lines after a header holding ``wall_offset = time.time() - time.perf_counter()``
    (sampled now unless given) and ``extra`` (e.g. the schedule and microbatches per batch)."""
    records = [as_record(r, rank) for r in records]
    if wall_offset is None:
        wall_offset = time.time() - time.perf_counter()
    stages = sorted({r.stage for r in records})
    header = {"rank": rank, "stage": stages[0] if len(stages) == 1 else stages,
              "clock": "perf_counter", "wall_offset": wall_offset, **(extra or {})}
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")


def load_records(path: str | os.PathLike) -> tuple[dict, list[TraceRecord]]:
    """(header, records) of one file written by :func:`save_records`, times as written."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or "clock" not in lines[0]:
        raise ValueError(f"{path}: not a timeline record file (no header line with 'clock')")
    header = lines[0]
    return header, [as_record(line, header.get("rank")) for line in lines[1:]]


def merge_records(paths: Iterable[str | os.PathLike] | str | os.PathLike
                  ) -> tuple[list[TraceRecord], str]:
    """Records of several ranks on one time axis, in seconds from the earliest record, and how
    they were aligned: 'wall-clock' (every header has ``wall_offset``) or 'earliest record per
    rank'. ``paths`` may be a directory: its ``*.jsonl`` files."""
    if isinstance(paths, (str, os.PathLike)) and Path(paths).is_dir():
        paths = sorted(Path(paths).glob("*.jsonl"))
    loaded = [load_records(p) for p in paths]
    loaded = [(h, rs) for h, rs in loaded if rs]
    if not loaded:
        raise ValueError("no timeline records to merge")
    if all(h.get("wall_offset") is not None for h, _ in loaded):
        how = "wall-clock"
        shifted = [(h["wall_offset"], rs) for h, rs in loaded]
    else:
        how = "earliest record per rank"
        shifted = [(-min(r.start for r in rs), rs) for _, rs in loaded]
    origin = min(offset + r.start for offset, rs in shifted for r in rs)
    merged = [TraceRecord(r.stage, r.kind, r.microbatch, r.version, offset + r.start - origin,
                          offset + r.end - origin, r.rank)
              for offset, rs in shifted for r in rs]
    merged.sort(key=lambda r: (r.start, r.stage))
    return merged, how


# --- summary ------------------------------------------------------------------------------------

def stage_summary(records: Iterable) -> dict[int, dict]:
    """Per stage (first rank of each stage): busy time per kind, idle time between its first
    start and last end, and its longest idle gap."""
    per_stage = _one_rank_per_stage([as_record(r) for r in records])
    summary = {}
    for stage, rs in sorted(per_stage.items()):
        rs = sorted(rs, key=lambda r: r.start)
        busy = {k: sum(r.end - r.start for r in rs if r.kind == k) for k in _KINDS}
        gaps = [max(b.start - a.end, 0.0) for a, b in zip(rs, rs[1:])]
        summary[stage] = {"busy": busy, "span": rs[-1].end - rs[0].start,
                          "idle": sum(gaps), "longest_gap": max(gaps, default=0.0),
                          "actions": len(rs)}
    return summary


def _one_rank_per_stage(records: Sequence[TraceRecord]) -> dict[int, list[TraceRecord]]:
    """The records of the lowest rank of each stage (data-parallel replicas would overlap)."""
    ranks: dict[int, set] = {}
    for r in records:
        ranks.setdefault(r.stage, set()).add(r.rank)
    chosen = {stage: min(rs, key=lambda rank: -1 if rank is None else rank)
              for stage, rs in ranks.items()}
    out: dict[int, list[TraceRecord]] = {}
    for r in records:
        if r.rank == chosen[r.stage]:
            out.setdefault(r.stage, []).append(r)
    return out


# --- PNG ----------------------------------------------------------------------------------------

_COLOURS = {"F": "#4c8bd6", "B": "#5fb35f",  # forward blue, backward green (paper, Figure 1)
            "I": "#8fd18f", "W": "#e0a040"}  # split backward: input gradient, weight gradient
_CATEGORIES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient",
               "S": "step"}
_HATCHES = ("", "///", "...", "xxx", "\\\\\\", "ooo")


def to_png(records: Iterable, path: str | os.PathLike, title: str | None = None, *,
           time_scale: float = 1.0, time_label: str = "time", dpi: int = 150) -> None:
    """Draw the timeline like the paper's Figures 1-3: time on x, one row per stage (stage 0 on
    top); forward and backward boxes in two colours with the microbatch number inside; the
    weight version a box reads as its hatching and shade (legend); a red tick where a stage makes
    a new weight version (its step). ``time_scale`` multiplies record times (1e3: seconds to ms).
    With data-parallel replicas, the lowest rank of each stage is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_stage = _one_rank_per_stage([as_record(r) for r in records])
    if not per_stage:
        raise ValueError("no records to draw")
    depth = max(per_stage) + 1
    start = min(r.start for rs in per_stage.values() for r in rs)
    end = max(r.end for rs in per_stage.values() for r in rs)
    span = max((end - start) * time_scale, 1e-12)
    durations = sorted((r.end - r.start) * time_scale for rs in per_stage.values() for r in rs
                       if r.kind != "S" and r.end > r.start)
    typical = min(durations[len(durations) // 2] if durations else span, span)  # median box
    width_in = min(max(8.0, span / typical * 30 / (0.85 * dpi)), 30.0)  # ~30 px a box
    fig, ax = plt.subplots(figsize=(width_in, 0.55 * depth + 1.6))
    px_per_unit = (width_in * 0.85 * dpi) / span
    versions = sorted({r.version for rs in per_stage.values() for r in rs
                       if r.kind != "S" and r.version is not None})

    def shade(kind: str, version: int | None) -> tuple:
        """The kind's colour (grey for the legend), lighter for every other version."""
        rgb = matplotlib.colors.to_rgb(_COLOURS.get(kind, "#8c8c8c"))
        light = 0.45 if version is not None and versions and versions.index(version) % 2 else 0.0
        return tuple(c + (1 - c) * light for c in rgb)

    for stage, rs in per_stage.items():
        y = depth - 1 - stage  # stage 0 on top
        for r in rs:
            _draw_record(ax, r, y, (r.start - start) * time_scale,
                         (r.end - r.start) * time_scale, shade, versions, px_per_unit, dpi)
    ax.set_xlim(0, span)
    ax.set_ylim(-0.6, depth - 0.4)
    ax.set_yticks(range(depth), [f"stage {depth - 1 - y}" for y in range(depth)])
    ax.set_xlabel(time_label)
    ax.grid(axis="x", color="#dddddd", lw=0.5, zorder=0)
    ax.set_axisbelow(True)
    if title:
        ax.set_title(title)
    _legend(ax, {r.kind for rs in per_stage.values() for r in rs}, versions, shade, depth)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)


def _draw_record(ax, r, y: float, x0: float, w: float, shade: Callable, versions: list,
                 px_per_unit: float, dpi: int) -> None:
    """One record on row ``y`` from ``x0``, ``w`` wide: a step as a red tick at its end, any
    other action as a box shaded and hatched by its version, its microbatch inside when the
    number fits."""
    from matplotlib.patches import Rectangle

    if r.kind == "S":
        ax.plot([x0 + w, x0 + w], [y - 0.48, y + 0.48], color="#d62728", lw=2.2,
                solid_capstyle="butt", zorder=4)
        return
    hatch = _HATCHES[versions.index(r.version) % len(_HATCHES)] if r.version in versions \
        else ""
    ax.add_patch(Rectangle((x0, y - 0.4), w, 0.8, facecolor=shade(r.kind, r.version),
                           edgecolor="black", linewidth=0.6, hatch=hatch, zorder=2))
    text = str(r.microbatch)
    box_px = w * px_per_unit
    size = min(9.0, box_px / ((0.6 * len(text) + 0.5) * dpi / 72))  # points
    if size >= 4.0:
        ax.text(x0 + w / 2, y, text, ha="center", va="center", fontsize=size, zorder=3,
                bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none",
                          alpha=0.8))


def _legend(ax, drawn: set, versions: list, shade: Callable, depth: int) -> None:
    """The legend below the axes: the kinds drawn, each weight version, the step's tick."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=_COLOURS[kind], edgecolor="black", label=_CATEGORIES[kind])
               for kind in ("F", "B", "I", "W") if kind in drawn]
    handles += [Patch(facecolor=shade("version", v), edgecolor="black", hatch=_HATCHES[i % len(_HATCHES)],
                      label=f"weight version {v}") for i, v in enumerate(versions)]
    handles.append(Line2D([], [], color="#d62728", lw=2.2, label="step: new weight version"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.06 - 0.45 / depth),
              ncol=min(len(handles), 6), fontsize=8, frameon=False)
