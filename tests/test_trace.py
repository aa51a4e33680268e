"""Timelines: Chrome trace events, PNG drawing, merging per-rank record files, and a check,
from the simulated spans alone, that PipeDream-2BW never flushes its pipeline."""

import json

import pytest

from megatron_2bw import trace
from megatron_2bw.schedules import Costs, pipeline_actions, simulate


def _simulated(schedule: str, depth: int = 4, microbatches: int = 4, batches: int = 3,
               p2p: float = 0.0):
    return simulate(pipeline_actions(schedule, depth, microbatches, batches),
                    Costs(forward=1.0, backward=2.0, p2p=p2p))


# --- Chrome trace -------------------------------------------------------------------------------

def test_chrome_trace_has_one_event_per_record(tmp_path):
    records = trace.records_from_simulation(_simulated("2bw"))
    path = tmp_path / "trace.json"
    trace.to_chrome_trace(records, path, time_scale=1000.0)
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(records)
    for event, r in zip(complete, records):
        assert event["pid"] == r.stage and event["tid"] == r.stage  # simulation: no rank
        assert event["ts"] == pytest.approx(r.start * 1000.0)
        assert event["dur"] == pytest.approx((r.end - r.start) * 1000.0)
        assert event["args"] == {"microbatch": r.microbatch, "version": r.version}
        if r.kind == "S":
            assert event["name"] == f"S{r.version}"
        else:
            assert event["name"] == f"{r.kind}{r.microbatch} v{r.version}"
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {i: f"stage {i}" for i in range(4)}


def test_chrome_trace_threads_are_ranks_for_real_runs():
    records = [trace.TraceRecord(1, "F", 0, 0, 0.5, 0.75, rank=3),
               trace.TraceRecord(1, "B", 0, 0, 1.0, 1.5, rank=7)]
    events = [e for e in trace.chrome_trace_events(records) if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in events] == [
        (1, 3, 0.5e6, 0.25e6), (1, 7, 1.0e6, 0.5e6)]
    assert events[0]["args"]["rank"] == 3


def test_records_from_simulation_keep_the_spans():
    result = _simulated("flush", 2, 2, 2)
    records = trace.records_from_simulation(result)
    assert [(r.stage, r.kind, r.microbatch, r.version, r.start, r.end) for r in records] == [
        (s.stage, s.kind.value, s.microbatch, s.version, s.start, s.end) for s in result.spans]


# --- PNG ----------------------------------------------------------------------------------------

def test_png_of_a_simulated_2bw_schedule(tmp_path):
    path = tmp_path / "2bw.png"
    trace.to_png(trace.records_from_simulation(_simulated("2bw")), path, "2BW d=4 m=4")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


# --- per-rank files -----------------------------------------------------------------------------

def _write_rank(path, rank, stage, wall_offset, perf_times):
    records = [trace.TraceRecord(stage, "F", k, 0, t, t + 0.1) for k, t in enumerate(perf_times)]
    trace.save_records(records, path, rank=rank, wall_offset=wall_offset)


def test_merge_aligns_ranks_on_the_wall_clock(tmp_path):
    # Two processes with unrelated perf_counter origins: rank 0's perf 100.0 is wall 1000.0,
    # rank 1's perf 5.0 is wall 1000.2 (it starts 0.2 s later, as a downstream stage does).
    _write_rank(tmp_path / "rank0.jsonl", 0, 0, 900.0, [100.0, 100.3])
    _write_rank(tmp_path / "rank1.jsonl", 1, 1, 995.2, [5.0, 5.3])
    merged, how = trace.merge_records(tmp_path)
    assert how == "wall-clock"
    starts = sorted((r.rank, r.microbatch, round(r.start, 9)) for r in merged)
    assert starts == [(0, 0, 0.0), (0, 1, 0.3), (1, 0, 0.2), (1, 1, 0.5)]
    assert all(r.end - r.start == pytest.approx(0.1) for r in merged)
    header, records = trace.load_records(tmp_path / "rank1.jsonl")
    assert header["rank"] == 1 and header["stage"] == 1 and header["clock"] == "perf_counter"
    assert [r.rank for r in records] == [1, 1]


def test_merge_without_wall_offsets_aligns_each_rank_on_its_first_record(tmp_path):
    for rank, stage, times in ((0, 0, [100.0, 100.3]), (1, 1, [5.0, 5.3])):
        path = tmp_path / f"rank{rank}.jsonl"
        _write_rank(path, rank, stage, 0.0, times)
        lines = path.read_text().splitlines()
        header = json.loads(lines[0])
        del header["wall_offset"]
        path.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    merged, how = trace.merge_records(sorted(tmp_path.glob("*.jsonl")))
    assert how == "earliest record per rank"
    assert sorted((r.rank, round(r.start, 9)) for r in merged) == [
        (0, 0.0), (0, 0.3), (1, 0.0), (1, 0.3)]


def test_saved_records_round_trip_simulated_spans(tmp_path):
    records = trace.records_from_simulation(_simulated("2bw", 2, 2, 2))
    trace.save_records(records, tmp_path / "r.jsonl", rank=0, wall_offset=0.0)
    _, loaded = trace.load_records(tmp_path / "r.jsonl")
    assert [r.label for r in loaded] == [r.label for r in records]
    assert [(r.start, r.end, r.version) for r in loaded] == [(r.start, r.end, r.version)
                                                             for r in records]


# --- 2BW never flushes: derived from the spans alone --------------------------------------------

def _pipeline_emptied(spans, microbatches: int) -> list[int]:
    """Batches b after which the pipeline is empty: on stage 0 (where every microbatch enters
    and leaves), batch b's last backward ends before batch b+1's first forward starts."""
    batches = {s.microbatch // microbatches for s in spans if s.microbatch is not None}
    emptied = []
    for b in sorted(batches)[:-1]:
        last_backward = max(s.end for s in spans if s.stage == 0 and s.kind == "B"
                            and s.microbatch // microbatches == b)
        next_forward = min(s.start for s in spans if s.stage == 0 and s.kind == "F"
                           and s.microbatch // microbatches == b + 1)
        if last_backward <= next_forward:
            emptied.append(b)
    return emptied


def _steady_state_idle(spans, depth: int) -> tuple[tuple[float, float], list[float]]:
    """The window from the last stage to start backwards to the first stage to finish its
    forwards (fill and drain excluded), and each stage's idle time inside it."""
    work = [s for s in spans if s.kind != "S"]
    begin = max(min(s.start for s in work if s.stage == i and s.kind == "B") for i in range(depth))
    end = min(max(s.end for s in work if s.stage == i and s.kind == "F") for i in range(depth))
    idle = []
    for i in range(depth):
        busy = sum(max(0.0, min(s.end, end) - max(s.start, begin)) for s in work if s.stage == i)
        idle.append(end - begin - busy)
    return (begin, end), idle


def _common_idle_gaps(spans, before: float) -> list[tuple[float, float]]:
    """Intervals before `before` in which no stage runs anything."""
    intervals = sorted((s.start, s.end) for s in spans if s.end > s.start)
    gaps, covered = [], intervals[0][1]
    for start, end in intervals[1:]:
        if start > covered + 1e-9 and start <= before:
            gaps.append((covered, start))
        covered = max(covered, end)
    return gaps


@pytest.mark.parametrize("depth,microbatches", [(4, 4), (2, 2), (4, 6), (3, 5)])
def test_simulated_2bw_timeline_shows_no_flush(depth, microbatches):
    batches = 4
    records = trace.records_from_simulation(_simulated("2bw", depth, microbatches, batches))
    assert _pipeline_emptied(records, microbatches) == []
    (begin, end), idle = _steady_state_idle(records, depth)
    steps = sorted({r.end for r in records if r.kind == "S" and r.stage == depth - 1})
    assert begin < steps[0] and steps[batches - 2] < end  # the window holds batch boundaries
    assert idle == pytest.approx([0.0] * depth)
    # With a p2p latency, no moment between batches where every stage idles at once.
    with_latency = trace.records_from_simulation(
        _simulated("2bw", depth, microbatches, batches, p2p=0.25))
    last_step = min(r.start for r in with_latency if r.kind == "S"
                    and r.microbatch is None and r.version == batches)
    assert _common_idle_gaps(with_latency, last_step) == []


@pytest.mark.parametrize("schedule", ["flush", "gpipe"])
def test_flushing_schedules_are_detected(schedule):
    """The same checks find the flush where there is one."""
    depth, microbatches, batches = 4, 4, 4
    records = trace.records_from_simulation(_simulated(schedule, depth, microbatches, batches))
    assert _pipeline_emptied(records, microbatches) == list(range(batches - 1))
    _, idle = _steady_state_idle(records, depth)
    assert all(t > 0 for t in idle)


def test_flush_has_a_common_idle_gap_at_each_batch_boundary():
    records = trace.records_from_simulation(_simulated("flush", 4, 4, 4, p2p=0.25))
    last_step = min(r.start for r in records if r.kind == "S" and r.version == 4)
    assert len(_common_idle_gaps(records, last_step)) == 3


def test_stage_summary_counts_idle_time():
    records = trace.records_from_simulation(_simulated("gpipe", 2, 2, 1))
    summary = trace.stage_summary(records)
    assert set(summary) == {0, 1}
    assert summary[0]["busy"]["F"] == 2.0 and summary[0]["busy"]["B"] == 4.0
    assert summary[0]["idle"] == pytest.approx(summary[0]["span"] - 6.0)


def test_data_parallel_replicas_draw_the_lowest_rank(tmp_path):
    records = [trace.TraceRecord(0, "F", 0, 0, 0.0, 1.0, rank=2),
               trace.TraceRecord(0, "F", 0, 0, 0.0, 3.0, rank=0),
               trace.TraceRecord(1, "F", 0, 0, 1.0, 2.0, rank=1),
               trace.TraceRecord(1, "F", 0, 0, 1.0, 5.0, rank=3)]
    summary = trace.stage_summary(records)
    assert summary[0]["busy"]["F"] == 3.0 and summary[1]["busy"]["F"] == 1.0
    trace.to_png(records, tmp_path / "dp.png")
    assert (tmp_path / "dp.png").read_bytes()[:4] == b"\x89PNG"
