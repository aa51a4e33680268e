"""Interleaved 1F1B as data (megatron_2bw/schedules/interleaved.py): megatron-core's order, the
bubble of SC'21 Section 2.2 on the simulator, and 2BW-interleaved's versions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_2bw.schedules import Costs, simulate
from megatron_2bw.schedules.actions import Kind, validate
from megatron_2bw.schedules.interleaved import interleaved_flush, interleaved_twobw

LAYOUTS = [(2, 2, 2), (2, 4, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 3)]  # (d, m, V)


def _lists(schedule: str, depth: int, m: int, chunks: int, batches: int) -> list[list]:
    def call(stage: int, t: int):
        if schedule == "flush":
            return interleaved_flush(depth, m, stage, t, chunks)
        return interleaved_twobw(depth, m, stage, t, chunks, fill=t == 0, drain=t == batches - 1)

    return [[a for t in range(batches) for a in call(stage, t)] for stage in range(depth)]


def _megatron_order(depth: int, m: int, chunks: int, stage: int):
    """megatron-core 0.16's interleaved order on `stage`: its schedule table (forward
    (microbatch, chunk) per virtual microbatch; the backward runs chunks in reverse) and its
    warm-up count, from its own functions."""
    from megatron.core.pipeline_parallel.schedules import (get_pp_rank_microbatches,
                                                           get_schedule_table)

    table = get_schedule_table(m, chunks, depth)
    group = SimpleNamespace(size=lambda: depth, rank=lambda: stage)
    comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=chunks)
    _, _, warmup, _ = get_pp_rank_microbatches(m, chunks, depth, p2p_communicator=comm)
    forwards = list(table)
    backwards = [(k, chunks - 1 - c) for k, c in table]
    order = [("F", *forwards[s]) for s in range(warmup)]
    for s in range(m * chunks - warmup):
        order += [("F", *forwards[s + warmup]), ("B", *backwards[s])]
    order += [("B", *backwards[s]) for s in range(m * chunks - warmup, m * chunks)]
    return order


@pytest.mark.parametrize("depth,m,chunks", LAYOUTS)
def test_flush_order_is_megatron_cores(depth, m, chunks):
    for stage in range(depth):
        ours = [(a.kind.value, a.microbatch, a.chunk)
                for a in interleaved_flush(depth, m, stage, 0, chunks) if a.kind is not Kind.STEP]
        assert ours == _megatron_order(depth, m, chunks, stage), stage


@pytest.mark.parametrize("depth,m,chunks", LAYOUTS)
def test_flush_bubble_is_one_vth_of_1f1b(depth, m, chunks):
    """Equal chunks, forward f and backward b each (a stage does V*f and V*b per microbatch):
    one batch takes m*V*(f+b) + (d-1)*(f+b), where 1F1B over the same stage work takes
    (m + d - 1)*V*(f+b) (SC'21 Section 2.2: the bubble shrinks by V)."""
    f, b = 1.0, 2.0
    lists = _lists("flush", depth, m, chunks, 1)
    validate(lists, m, 1, version_of=lambda stage, k: 0, max_versions=1)
    result = simulate(lists, Costs(forward=f, backward=b))
    assert result.makespan == pytest.approx((m * chunks + depth - 1) * (f + b))
    bubble_1f1b = (depth - 1) * chunks * (f + b)
    assert result.makespan - m * chunks * (f + b) == pytest.approx(bubble_1f1b / chunks)


@pytest.mark.parametrize("depth,m,chunks", [(2, 2, 2), (2, 4, 3), (4, 8, 2), (4, 8, 3)])
def test_twobw_interleaved_never_flushes_and_keeps_two_versions(depth, m, chunks):
    """Three batches: one fill and one drain in all, batch b reads max(b-1, 0), at most two
    versions per stage."""
    batches, f, b = 3, 1.0, 2.0
    lists = _lists("2bw", depth, m, chunks, batches)
    validate(lists, m, batches, version_of=lambda stage, k: max(k // m - 1, 0), max_versions=2)
    result = simulate(lists, Costs(forward=f, backward=b))
    assert result.makespan == pytest.approx((batches * m * chunks + depth - 1) * (f + b))
    assert max(result.max_versions) == 2


def test_twobw_interleaved_refuses_a_look_ahead_past_the_next_batch():
    """d=4, V=2: the first stage warms up with 2*3 + 4 = 10 forwards > m*V = 8."""
    with pytest.raises(ValueError, match="m\\*V >= 2\\(d-1\\) \\+ \\(V-1\\)d = 10"):
        interleaved_twobw(4, 4, 0, 0, 2, fill=True, drain=True)
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        interleaved_flush(4, 6, 0, 0, 2)


def _programs(schedule: str, depth: int, m: int, chunks: int, batches: int) -> list[list]:
    """NCCL-mode programs: each call's list with its exchanges (comm.fuse), stage 0 and stage
    d-1 being neighbours on the ring of virtual stages."""
    from megatron_2bw.schedules.comm import fuse

    lists = [_lists(schedule, depth, m, chunks, batches)[s] for s in range(depth)]
    programs = [[] for _ in range(depth)]
    for stage in range(depth):
        calls = _split_calls(lists[stage])
        for t, actions in enumerate(calls):
            neighbours = {s: _split_calls(lists[s])[t] for s in ((stage - 1) % depth,
                                                                  (stage + 1) % depth)}
            programs[stage] += fuse(actions, stage, depth, neighbours, chunks=chunks)
    return programs


def _split_calls(actions: list) -> list[list]:
    """A whole-training list cut after each step: one list per call."""
    calls, current = [], []
    for a in actions:
        current.append(a)
        if a.kind is Kind.STEP:
            calls.append(current)
            current = []
    return calls


@pytest.mark.parametrize("depth,m,chunks", LAYOUTS)
def test_interleaved_programs_run_under_nccl_rendezvous(depth, m, chunks):
    """Sends meet their receives in order, one group per step: flush keeps the bubble of the
    buffered simulation, (mV + d - 1)(f + b) per batch; 2BW-interleaved is never slower."""
    batches, f, b = 3, 1.0, 2.0
    flush = simulate(_programs("flush", depth, m, chunks, batches), Costs(forward=f, backward=b))
    assert flush.makespan == pytest.approx(batches * (m * chunks + depth - 1) * (f + b))
    if 2 * (depth - 1) + (chunks - 1) * depth <= m * chunks:
        twobw = simulate(_programs("2bw", depth, m, chunks, batches),
                         Costs(forward=f, backward=b))
        assert twobw.makespan <= flush.makespan
