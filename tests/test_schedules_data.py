"""Schedules as data: generators, validator, communication pass and simulator, no processes.

Golden files under tests/golden/schedules/ hold whole-training action lists (and their simulated
timelines) for d=4, m=4 and 3 calls; regenerate on purpose with
    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_schedules_data.py
and review the diff against the paper's figures.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_2bw.schedules import (SCHEDULES, V_SCHEDULES, Action, Exchange, Kind, P2P,
                                    ScheduleError, actions_of, call_actions, communication,
                                    format_actions, fuse,
                                    keeps_versions, parse_action, parse_actions,
                                    pipeline_actions, pipeline_programs, stage_actions, validate)
from megatron_2bw.schedules.actions import SENDS_GRAD
from megatron_2bw.schedules.simulate import Costs, simulate, format_timeline

F, B = 1.0, 2.0
COSTS = Costs(forward=F, backward=B)
GOLDEN = Path(__file__).parent / "golden" / "schedules"


def grid(min_m_is_d: bool = False):
    """(d, m) for d in 1..8 and m in {1, 2, 3, d-1, d, d+1, 2d, 2d+1, 3d-1} (m >= d for 2BW):
    covers m = d, m = 2d and m not a multiple of d."""
    for d in range(1, 9):
        for m in sorted({1, 2, 3, d - 1, d, d + 1, 2 * d, 2 * d + 1, 3 * d - 1}):
            if m >= (d if min_m_is_d else 1):
                yield d, m


LOOP_SCHEDULES = [name for name in SCHEDULES if name not in V_SCHEDULES]
"""The schedules of one chunk per stage (the V schedules: tests/test_vshape.py)."""


def cases(num_batches: int = 3):
    for name in LOOP_SCHEDULES:
        for d, m in grid(min_m_is_d=keeps_versions(name)):
            yield name, d, m, num_batches


# --- the data itself -------------------------------------------------------------------------


def test_string_form_round_trips():
    assert str(Action(Kind.FORWARD, 3, 0, 1)) == "F3v1"
    assert parse_action("B3v1", microbatches=2) == Action(Kind.BACKWARD, 3, 1, 1)
    assert parse_action("S2", microbatches=4) == Action(Kind.STEP, None, 1, 2)
    for name, d, m, n in cases():
        for actions in pipeline_actions(name, d, m, n):
            assert [parse_action(str(a), m) for a in actions] == actions
            assert parse_actions(format_actions(actions), m) == actions
    with pytest.raises(ValueError, match="not an action"):
        parse_action("X3", 4)


def test_every_schedule_validates_on_the_grid():
    for name, d, m, n in cases():
        lists = pipeline_actions(name, d, m, n)  # validates
        spec = SCHEDULES[name]
        backward = spec.backward_version_of
        validate(lists, m, n, version_of=lambda i, k: spec.version_of(d, m, i, k),
                 backward_version_of=None if backward is None else
                 lambda i, k: backward(d, m, i, k), max_versions=spec.max_versions)
        passes = 3 if name == "zb-h1" else 2  # F, I, W per microbatch, or F, B
        for actions in lists:
            assert len(actions) == passes * n * m + n


def test_2bw_refuses_fewer_microbatches_than_stages():
    with pytest.raises(ValueError, match=r"m=3 < d=4"):
        call_actions("2bw", depth=4, microbatches=3, stage=0, call=0, fill=True, drain=True)


def test_2bw_versions_follow_the_paper():
    """Section 3.1: 1-indexed microbatch k reads version max(floor((k-1)/m) - 1, 0)."""
    for d, m in grid(min_m_is_d=True):
        for actions in pipeline_actions("2bw", d, m, num_batches=4):
            for a in actions:
                if a.kind is not Kind.STEP:
                    k = a.microbatch + 1
                    assert a.version == max((k - 1) // m - 1, 0), (d, m, a)


def test_per_call_lists():
    """Call t runs the backwards of exactly batch t and ends with the step that makes version
    t+1. GPipe/Flush/naive run only batch t; 2BW's forwards run `d-i-1` microbatches ahead into
    batch t+1, with the warm-up in the first call and nothing beyond the last batch."""
    for name, d, m, n in cases(num_batches=4):
        for stage in range(d):
            calls = [call_actions(name, d, m, stage, t, fill=t == 0, drain=t == n - 1)
                     for t in range(n)]
            assert sum(calls, []) == stage_actions(name, d, m, stage, n)
            for t, actions in enumerate(calls):
                assert actions[-1] == Action(Kind.STEP, None, t, t + 1)
                assert all(a.kind is not Kind.STEP for a in actions[:-1])
                backwards = [a.microbatch for a in actions if a.kind in SENDS_GRAD]
                assert backwards == list(range(t * m, t * m + m))
                forwards = [a.microbatch for a in actions if a.kind is Kind.FORWARD]
                lag = d - stage - 1 if keeps_versions(name) else 0
                first = 0 if t == 0 else t * m + lag
                last = min(t * m + m + lag, n * m)
                assert forwards == list(range(first, last)), (name, d, m, stage, t)


def test_2bw_drain_in_the_middle():
    """A drain (evaluation, checkpoint) empties the pipeline after its call; the next call
    fills again. The version rule does not change."""
    lists = pipeline_actions("2bw", depth=4, microbatches=5, num_batches=4, drains=[1])
    result = simulate(lists, COSTS)
    assert result.max_versions == (2, 2, 2, 2)
    # Call 1 holds no forward of batch 2: everything of batch 2 and 3 follows S2.
    for actions in lists:
        s2 = actions.index(Action(Kind.STEP, None, 1, 2))
        assert all(a.batch <= 1 for a in actions[:s2])


def test_communication_pass():
    for name, d, m, n in cases(num_batches=2):
        lists = pipeline_actions(name, d, m, n)
        comms = [communication(actions, stage, d) for stage, actions in enumerate(lists)]
        for stage, (actions, stage_comms) in enumerate(zip(lists, comms)):
            for a, c in zip(actions, stage_comms):
                if a.kind is Kind.FORWARD:
                    assert c.recv == (P2P(stage - 1, "activation", a.microbatch)
                                      if stage > 0 else None)
                    assert c.send == (P2P(stage + 1, "activation", a.microbatch)
                                      if stage < d - 1 else None)
                elif a.kind in SENDS_GRAD:
                    assert c.recv == (P2P(stage + 1, "grad", a.microbatch)
                                      if stage < d - 1 else None)
                    assert c.send == (P2P(stage - 1, "grad", a.microbatch)
                                      if stage > 0 else None)
                else:
                    assert c.recv is None and c.send is None
        # Every send has its receive, in the same order on each channel (p2p has no tags).
        for src in range(d):
            for dst in range(d):
                sent = [(c.send.tensor, c.send.microbatch) for c in comms[src]
                        if c.send and c.send.peer == dst]
                received = [(c.recv.tensor, c.recv.microbatch) for c in comms[dst]
                            if c.recv and c.recv.peer == src]
                assert [s for s in sent if s[0] == "activation"] == \
                    [r for r in received if r[0] == "activation"]
                assert [s for s in sent if s[0] == "grad"] == \
                    [r for r in received if r[0] == "grad"]


def test_messages_crossing_a_call_boundary():
    """What the executor must not block on: under 2BW, in each call but the last, stage i sends
    stage i+1 one activation (microbatch (t+1)m + d-i-2) that stage i+1 receives only in the next
    call. Gradients never cross a call (every stage runs the backwards of batch t in call t), and
    the other schedules keep every message inside its call."""
    n = 3
    for name, d, m, _ in cases():
        for t in range(n):
            calls = [call_actions(name, d, m, i, t, fill=t == 0, drain=t == n - 1)
                     for i in range(d)]
            comms = [communication(actions, i, d) for i, actions in enumerate(calls)]
            for i in range(d - 1):
                for peer, other in ((i + 1, i), (i, i + 1)):
                    sent = {(c.send.tensor, c.send.microbatch) for c in comms[other]
                            if c.send and c.send.peer == peer}
                    received = {(c.recv.tensor, c.recv.microbatch) for c in comms[peer]
                                if c.recv and c.recv.peer == other}
                    forward_link = keeps_versions(name) and peer == i + 1
                    lag = d - peer - 1
                    assert sent - received == ({("activation", (t + 1) * m + lag)}
                                               if forward_link and t < n - 1 else set())
                    assert received - sent == ({("activation", t * m + lag)}
                                               if forward_link and t > 0 else set())


# --- simulation ------------------------------------------------------------------------------


def test_gpipe_and_flush_bubble():
    """Equal stages, costs F and B, no step cost, derived by hand: each stage does m forwards
    and m backwards, busy m(F+B). The last microbatch's forward reaches the last stage after
    (m-1)F + (d-1)F of waiting on stage 0's forwards, then the last stage's backwards run and
    the gradient of the last microbatch walks back through d-1 stages: the makespan of a batch is
    (m+d-1)(F+B) (GPipe paper; for 1F1B the same, PipeDream-2BW Section 3.3). So
        bubble = 1 - d m (F+B) / (d (m+d-1)(F+B)) = (d-1)/(m+d-1),
    and batches follow one another back to back, so it holds for the whole run."""
    for name in ("gpipe", "flush"):
        for d, m in grid():
            for sync in ("local", "pipeline"):
                result = simulate(pipeline_actions(name, d, m, 2), COSTS, step_sync=sync)
                assert result.makespan == 2 * (m + d - 1) * (F + B), (name, d, m, sync)
                assert result.bubble == pytest.approx((d - 1) / (m + d - 1))
                assert result.busy == (2 * m * (F + B),) * d


def test_2bw_has_no_bubble_in_steady_state_with_local_steps():
    """With local steps every stage finishes a batch every m(F+B) exactly, after the start; the
    whole run is one 1F1B over n*m microbatches: makespan (n*m + d - 1)(F+B)."""
    n = 5
    for d, m in grid(min_m_is_d=True):
        result = simulate(pipeline_actions("2bw", d, m, n), COSTS, step_sync="local")
        assert result.makespan == (n * m + d - 1) * (F + B)
        for stage in range(d):
            ends = result.batch_ends(stage)
            assert [b - a for a, b in zip(ends, ends[1:])] == [m * (F + B)] * (n - 1)
            assert result.stage_bubble[stage] == pytest.approx(1 - n * m / (n * m + d - 1))


def test_2bw_pipeline_wide_step_costs_the_gradient_walk_back():
    """When the step is a collective over all stages, it waits for stage 0's last backward of
    the batch, which trails the last stage's by the (d-1) backwards the gradient walks back
    through; no stage can fill that gap (its next actions need that collective or the next
    batch's gradients), so each batch takes m(F+B) + (d-1)B in steady state."""
    n = 6
    for f, b in ((1.0, 2.0), (1.0, 3.0), (2.0, 1.0)):
        for d, m in grid(min_m_is_d=True):
            result = simulate(pipeline_actions("2bw", d, m, n), Costs(f, b),
                              step_sync="pipeline")
            ends = result.batch_ends(0)
            assert {e - s for s, e in zip(ends, ends[1:])} == {m * (f + b) + (d - 1) * b}


def test_memory_declared_by_each_schedule():
    """Peak stashed activations: m for GPipe; min(d-i, m) at stage i for Flush (d-i when m>=d)
    and ZB-H1 (1F1B's order of F and I); d-i for 2BW, PipeDream and PipeMare; 1 for naive.
    Pending weight gradients: ZB-H1's stage i delays W by i microbatches, so right after I(j)
    the W's of j-i..j wait: min(i+1, m); none elsewhere. Weight versions alive: 2 for 2BW
    (from the second batch on) and for PipeDream but on its last stage; 1 for PipeMare (a
    stashed microbatch's backward reads the newest version, none keeps an older one alive)
    and the synchronous schedules. The simulator measures them; each schedule declares them."""
    for name, d, m, n in cases():
        result = simulate(pipeline_actions(name, d, m, n), COSTS)
        spec = SCHEDULES[name]
        assert result.peak_stash == tuple(spec.stash(d, m, i) for i in range(d))
        assert result.peak_weight_grads == tuple(spec.weight_grads(d, m, i) for i in range(d))
        expected = {"gpipe": [m] * d, "flush": [min(d - i, m) for i in range(d)],
                    "zb-h1": [min(d - i, m) for i in range(d)],
                    "2bw": [d - i for i in range(d)], "pipedream": [d - i for i in range(d)],
                    "pipemare": [d - i for i in range(d)], "naive": [1] * d}[name]
        assert list(result.peak_stash) == expected
        pending = [min(i + 1, m) for i in range(d)] if name == "zb-h1" else [0] * d
        assert list(result.peak_weight_grads) == pending
        versions = {"2bw": [2] * d, "pipedream": [2] * (d - 1) + [1]}.get(name, [1] * d)
        assert list(result.max_versions) == versions, name
        assert spec.max_versions == max(versions) or d == 1, name  # d=1: nothing in flight


def test_pipedream_forwards_read_the_newest_version_and_stash_it():
    """PipeDream's rule, from the action order alone: without drains, every forward reads the
    newest version its stage has made before it, and its backward the same (stashed) one; the
    stages of one microbatch read different versions (no vertical sync); 2 versions at most
    with m >= d, 1 + ceil((d-i-1)/m) below (d - i at m = 1, an update per microbatch)."""
    for d, m in ((2, 2), (4, 4), (4, 8), (3, 5), (2, 1), (3, 1), (4, 1), (4, 2), (5, 3)):
        lists = pipeline_actions("pipedream", d, m, num_batches=2 * d + 2)
        for stage, actions in enumerate(lists):
            newest, read = 0, {}
            for a in actions:
                if a.kind is Kind.STEP:
                    newest = a.version
                elif a.kind is Kind.FORWARD:
                    assert a.version == newest, (d, m, stage, str(a))
                    read[a.microbatch] = a.version
                else:
                    assert a.version == read[a.microbatch], (d, m, stage, str(a))
        first_stage = {a.microbatch: a.version for a in lists[0] if a.kind is Kind.FORWARD}
        last_stage = {a.microbatch: a.version for a in lists[-1] if a.kind is Kind.FORWARD}
        assert first_stage[m] == 0 and last_stage[m] == 1  # batch 1's first microbatch
        held = tuple(1 + -(-(d - i - 1) // m) for i in range(d))
        assert simulate(lists, COSTS).max_versions == held, (d, m)
        if m == 1:
            assert held == tuple(d - i for i in range(d))


def test_pipedream_and_pipemare_below_d_drain_with_notice():
    """At m < d the first stage's look-ahead forwards reach ceil((d-1)/m) batches ahead: a
    drain known that many calls before (``stage_actions`` passes the next drain) empties the
    pipeline after its call, the refill's forwards read what an undrained run reads (the
    version rule is checked by the validator), every version bound holds, and the programs
    with their fused exchanges run deadlock-free in the simulator's NCCL mode. A drain asked
    for later than that is refused by the runner (executor.prepare_drain)."""
    from megatron_2bw.schedules.pipedream import drain_notice

    assert [drain_notice(4, m) for m in (1, 2, 3, 4, 8)] == [3, 2, 1, 1, 1]
    for name in ("pipedream", "pipemare"):
        for d, m in ((3, 1), (4, 1), (4, 2), (5, 2)):
            n = 3 * d
            programs = pipeline_programs(name, d, m, n, drains=(1, d + 1))  # validated
            result = simulate(programs, COSTS)
            stashed = tuple(d - i for i in range(d))
            assert result.peak_stash == stashed, (name, d, m)
            held = (tuple(1 + -(-(d - i - 1) // m) for i in range(d)) if name == "pipedream"
                    else (1,) * d)
            assert result.max_versions == held, (name, d, m)
            for actions in (actions_of(p) for p in programs):  # nothing crosses a drain
                for t in (1, d + 1):
                    step = actions.index(Action(Kind.STEP, None, t, t + 1))
                    assert all(a.batch <= t for a in actions[:step]), (name, d, m, t)


def test_naive_makespan():
    """One microbatch at a time through d stages: m d (F+B) per batch."""
    for d, m in grid():
        result = simulate(pipeline_actions("naive", d, m, 2), COSTS)
        assert result.makespan == 2 * m * d * (F + B)


def test_per_stage_costs_p2p_and_step():
    """GPipe with p2p latency p and step cost s: the fill and the gradient walk back each cross
    d-1 links, so a batch takes (m+d-1)(F+B) + 2(d-1)p + s."""
    d, m, p, s = 4, 6, 0.25, 0.5
    result = simulate(pipeline_actions("gpipe", d, m, 1), Costs(F, B, p2p=p, step=s))
    assert result.makespan == (m + d - 1) * (F + B) + 2 * (d - 1) * p + s
    assert result.step == (s,) * d
    slow_last = Costs(forward=(1, 1, 1, 2), backward=(2, 2, 2, 4))
    result = simulate(pipeline_actions("flush", d, m, 1), slow_last)
    # The slowest stage sets the pace: its busy time m(2+4), plus the fill before it
    # (3 forwards of microbatch 0) and the walk back after it (3 backwards of the last one).
    assert result.makespan == m * 6 + 3 * 1 + 3 * 2
    assert result.stage_bubble[3] == pytest.approx(1 - m * 6 / result.makespan)


def test_timeline_records():
    result = simulate(pipeline_actions("2bw", 2, 2, 2), COSTS)
    assert len(result.spans) == 2 * (2 * 2 * 2 + 2)
    first = result.spans[0]
    assert (first.stage, first.kind, first.microbatch, first.version, first.start, first.end) \
        == (0, Kind.FORWARD, 0, 0, 0.0, F)
    for s in result.spans:
        assert s.end - s.start == {Kind.FORWARD: F, Kind.BACKWARD: B, Kind.STEP: 0}[s.kind]


# --- split backward (I, W) and model chunks ----------------------------------------------------


def test_split_backward_and_chunk_string_forms():
    """I and W print like B; a chunk is written only when it is not 0, so every existing
    string form stays as it was."""
    assert str(Action(Kind.INPUT_GRAD, 3, 0, 1)) == "I3v1"
    assert str(Action(Kind.WEIGHT_GRAD, 3, 0, 1)) == "W3v1"
    assert str(Action(Kind.FORWARD, 3, 0, 1, chunk=0)) == "F3v1"
    assert str(Action(Kind.BACKWARD, 5, 1, 1, chunk=2)) == "B5c2v1"
    for text, action in (("W3v1", Action(Kind.WEIGHT_GRAD, 3, 1, 1)),
                         ("F5c1v2", Action(Kind.FORWARD, 5, 2, 2, chunk=1)),
                         ("I0c3v0", Action(Kind.INPUT_GRAD, 0, 0, 0, chunk=3))):
        assert parse_action(text, microbatches=2) == action and str(action) == text
    with pytest.raises(ValueError, match="a chunk is >= 0, and 0 for a step"):
        Action(Kind.STEP, None, 0, 1, chunk=1)
    with pytest.raises(ValueError, match="a chunk is >= 0"):
        Action(Kind.FORWARD, 0, 0, 0, chunk=-1)
    with pytest.raises(ValueError, match="not an action"):
        parse_action("S2c1", 4)


def test_split_backward_validation():
    """Per microbatch: F, then B, or I and later W; the step waits for the W's."""
    def one_stage(text: str) -> None:
        validate([parse_actions(text, 2)], 2, 1)

    one_stage("F0v0 F1v0 I0v0 I1v0 W1v0 W0v0 S1")
    one_stage("F0v0 I0v0 F1v0 B1v0 W0v0 S1")
    for text, why in (("F0v0 F1v0 W0v0 I0v0 I1v0 W1v0 S1", "weight gradient without an input"),
                      ("F0v0 F1v0 I0v0 B0v0 B1v0 S1", "second backward of this microbatch"),
                      ("F0v0 F1v0 I0v0 I1v0 W1v0 S1 W0v0", r"step before the backwards of "
                                                           r"microbatches \[0\]"),
                      ("F0v0 F1v0 I0v0 I1v0 W0v0", r"microbatches \[1\] miss")):
        with pytest.raises(ScheduleError, match=why):
            one_stage(text)


def interleaved_gpipe(depth: int, chunks: int, microbatches: int) -> list[list[Action]]:
    """GPipe over the virtual stages: on every stage the forwards of chunk 0, 1, ... for each
    microbatch, then the backwards of the chunks in reverse, then the step."""
    mbs = range(microbatches)
    return [[Action(Kind.FORWARD, k, 0, 0, c) for c in range(chunks) for k in mbs]
            + [Action(Kind.BACKWARD, k, 0, 0, c) for c in reversed(range(chunks)) for k in mbs]
            + [Action(Kind.STEP, None, 0, 1)] for _ in range(depth)]


def test_chunk_communication_follows_the_interleaved_placement():
    """Chunk c of stage i is virtual stage c*d + i (Megatron): stage 0's chunk c receives its
    activation from the last stage's chunk c-1 and sends it that chunk's input gradient; the
    first and last virtual stage have no peer on one side."""
    d, v = 3, 2
    f = {c: Action(Kind.FORWARD, 4, 0, 0, c) for c in range(v)}
    b = {c: Action(Kind.INPUT_GRAD, 4, 0, 0, c) for c in range(v)}
    first = communication([f[0], f[1], b[1], b[0]], 0, d, chunks=v)
    assert first[0].recv is None and first[0].send == P2P(1, "activation", 4, 0)
    assert first[1].recv == P2P(2, "activation", 4, 0)  # from chunk 0 of the last stage
    assert first[1].send == P2P(1, "activation", 4, 1)
    assert first[2].recv == P2P(1, "grad", 4, 1) and first[2].send == P2P(2, "grad", 4, 1)
    assert first[3].recv == P2P(1, "grad", 4, 0) and first[3].send is None
    last = communication([f[0], f[1], b[1], b[0]], d - 1, d, chunks=v)
    assert last[0].send == P2P(0, "activation", 4, 0)  # on to chunk 1 of stage 0
    assert last[1].send is None and last[2].recv is None  # the model's last virtual stage
    assert last[3].recv == P2P(0, "grad", 4, 1)
    with pytest.raises(ValueError, match="chunk outside 0..1"):
        communication([Action(Kind.FORWARD, 0, 0, 0, chunk=2)], 0, d, chunks=v)


def test_chunks_in_the_simulator_and_nccl_mode():
    """GPipe over V*d virtual stages with m >= d: the forward of chunk c on stage 0 needs the
    last stage's chunk c-1, which is done exactly when stage 0 finished the m forwards of chunk
    c-1 (m >= d), so no stage idles between its first and last pass: by hand, the GPipe
    makespan with V*m chunk-microbatches, (V m + d - 1)(F + B); with one microbatch the passes
    run one at a time, V d (F + B). In NCCL mode, with the wrap-around transfers, the same for
    m <= d; with m > d the last stage's first wrap-around send waits for stage 0 to receive it,
    which stage 0 does only after its m chunk-0 forwards, whose sends the last stage receives
    only after that send: a rendezvous deadlock the simulator reports (Megatron's interleaved
    1F1B receives the wrap-around activations between the forwards instead)."""
    for d in (2, 3, 4):
        for v in (2, 3):
            for m in (1, d, 2 * d):
                lists = interleaved_gpipe(d, v, m)
                validate(lists, m, 1)
                expected = v * d * (F + B) if m == 1 else (v * m + d - 1) * (F + B)
                assert simulate(lists, COSTS).makespan == expected, (d, v, m)
                programs = [fuse(actions, i, d, {p: lists[p] for p in {(i - 1) % d, (i + 1) % d}
                                                 if p != i}, chunks=v)
                            for i, actions in enumerate(lists)]
                assert any(isinstance(step, Exchange) and step.transfers[0].chunk
                           for program in programs for step in program)
                if m <= d:
                    assert simulate(programs, COSTS).makespan == expected, (d, v, m)
                else:
                    with pytest.raises(ScheduleError, match=f"deadlock(.|\n)*stage {d - 1} at "
                                                            r"\{sa0:0"):
                        simulate(programs, COSTS)
    lists = interleaved_gpipe(2, 2, 1)
    spans = {(s.stage, s.kind, s.chunk): s for s in simulate(lists, COSTS).spans}
    assert spans[0, Kind.FORWARD, 1].start == spans[1, Kind.FORWARD, 0].end == 2 * F
    assert spans[1, Kind.BACKWARD, 0].start == spans[0, Kind.BACKWARD, 1].end


# --- ZB-H1 ------------------------------------------------------------------------------------


def zbh1_costs(forward: float, input_grad: float, weight_grad: float) -> Costs:
    return Costs(forward=forward, backward=input_grad + weight_grad, weight_grad=weight_grad)


def test_zbh1_bubble_is_the_papers():
    """Qi et al., ICLR 2024, Section 2.1: with T_F, T_B (input gradient) and T_W per
    microbatch, ZB-H1's bubble is (d-1)(T_F + T_B - T_W) against 1F1B's (d-1)(T_F + T_B + T_W)
    (flush runs B = I + W fused). Each stage works m(T_F + T_B + T_W) per batch and every batch
    fills and drains, so the makespan of n batches is n(m(T_F+T_B+T_W) + bubble). Equal costs,
    and unequal ones with T_W <= min(T_F, T_B), where the W's fit the gaps they fill; m >= d."""
    n = 2
    for f, b, w in ((1, 1, 1), (1, 1.5, 0.5), (2, 1, 1), (1, 3, 1), (1.5, 2, 1)):
        costs = zbh1_costs(f, b, w)
        for d in (2, 3, 4, 6):
            for m in (d, 2 * d, 3 * d + 1):
                work = m * (f + b + w)
                zb = simulate(pipeline_actions("zb-h1", d, m, n), costs)
                assert zb.makespan == pytest.approx(n * (work + (d - 1) * (f + b - w)))
                assert zb.bubble == pytest.approx((d - 1) * (f + b - w)
                                                  / (work + (d - 1) * (f + b - w)))
                flush = simulate(pipeline_actions("flush", d, m, n), costs)
                assert flush.makespan == pytest.approx(n * (work + (d - 1) * (f + b + w)))


def test_zbh1_keeps_1f1b_memory():
    """Per stage, the microbatches between F and I peak at flush's (1F1B's) count, the same
    weight version throughout; those waiting for their W peak at min(i+1, m)."""
    for d in (2, 3, 4, 8):
        for m in (1, d - 1, d, 2 * d):
            if m < 1:
                continue
            zb = simulate(pipeline_actions("zb-h1", d, m, 2), COSTS)
            flush = simulate(pipeline_actions("flush", d, m, 2), COSTS)
            assert zb.peak_stash == flush.peak_stash, (d, m)
            assert zb.peak_weight_grads == tuple(min(i + 1, m) for i in range(d))
            assert zb.max_versions == (1,) * d


def test_zbh1_deadlock_free_under_nccl_rules():
    """The programs the executor runs, d in {2, 4}, m in {d, 2d}, with a drain: no deadlock
    under NCCL's rendezvous, and the buffered makespan (the W's around the exchanges never hold
    a neighbour up), for equal costs and for T_W < T_F, T_B."""
    for d in (2, 4):
        for m in (d, 2 * d):
            programs = pipeline_programs("zb-h1", d, m, 3, drains=[0])
            buffered = pipeline_actions("zb-h1", d, m, 3, drains=[0])
            for costs in (zbh1_costs(1, 1, 1), zbh1_costs(1, 1.5, 0.5)):
                for sync in ("local", "pipeline"):
                    assert simulate(programs, costs, step_sync=sync).makespan == pytest.approx(
                        simulate(buffered, costs, step_sync=sync).makespan), (d, m, sync)


# --- broken schedules ------------------------------------------------------------------------


def swapped(actions: list[Action], x: str, y: str, m: int) -> list[Action]:
    a, b = parse_action(x, m), parse_action(y, m)
    return [b if act == a else a if act == b else act for act in actions]


def test_swapped_backwards_on_the_last_stage_raise():
    """The last stage of 1F1B runs F0 B0 F1 B1: swapping the B's puts B1 before F1."""
    lists = pipeline_actions("flush", 2, 2, 1)
    lists[1] = swapped(lists[1], "B0v0", "B1v0", 2)
    with pytest.raises(ScheduleError, match="dependency violation(.|\n)*<-- ERROR HERE"):
        simulate(lists, COSTS)
    with pytest.raises(ScheduleError, match="backward without a forward(.|\n)*ERROR HERE"):
        validate(lists, 2, 1)


def test_cross_stage_deadlock_raises():
    """Each list is fine alone, but stage 0 waits in B0 for stage 1's B0, which comes after
    stage 1's F1, which waits for stage 0's F1, which comes after B0."""
    lists = pipeline_actions("gpipe", 2, 2, 1)
    lists[0] = swapped(lists[0], "F1v0", "B0v0", 2)
    assert format_actions(lists[0]) == "F0v0 B0v0 F1v0 B1v0 S1"
    validate([lists[0]], 2, 1)
    validate([lists[1]], 2, 1)
    with pytest.raises(ScheduleError, match=r"deadlock(.|\n)*stage 0 at B0v0, stage 1 at F1v0"
                                            r"(.|\n)*ERROR HERE(.|\n)*ERROR HERE"):
        simulate(lists, COSTS)


def test_pipeline_step_missing_on_one_stage_deadlocks():
    lists = pipeline_actions("2bw", 2, 2, 2)
    lists[1] = [a for a in lists[1] if a.version != 2 or a.kind is not Kind.STEP]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(lists, COSTS, step_sync="pipeline")


def test_channel_order_is_checked():
    """A middle stage running its backwards out of order receives the wrong gradient."""
    lists = pipeline_actions("gpipe", 3, 2, 1)
    lists[1] = swapped(lists[1], "B0v0", "B1v0", 2)
    with pytest.raises(ScheduleError, match=r"receives microbatch 0 from stage 1, which sends "
                                            r"microbatch 1(.|\n)*ERROR HERE"):
        validate(lists, 2, 1)


def test_wrong_versions_and_steps_are_caught():
    lists = pipeline_actions("flush", 2, 2, 2)
    with pytest.raises(ScheduleError, match="microbatch 2 reads version 0 on this stage"):
        validate(lists, 2, 2, version_of=lambda i, k: max(k // 2 - 1, 0))
    early_step = [a for a in lists[0] if a.kind is not Kind.STEP]
    early_step.insert(3, Action(Kind.STEP, None, 0, 1))
    early_step.append(Action(Kind.STEP, None, 1, 2))
    with pytest.raises(ScheduleError, match=r"step before the backwards of microbatches \[1\]"):
        validate([early_step, lists[1]], 2, 2)
    with pytest.raises(ScheduleError, match=r"2 weight versions alive \[0, 1\], at most 1"):
        validate(pipeline_actions("2bw", 2, 2, 3), 2, 3, max_versions=1)


# --- golden action lists ---------------------------------------------------------------------


def golden_text(name: str, d: int, m: int, n: int, drains: tuple[int, ...] = ()) -> str:
    lists = pipeline_actions(name, d, m, n, drains=drains)
    lines = [f"# {name}, d={d}, m={m}, {n} calls" + (f", drain after calls {list(drains)}"
                                                      if drains else ""),
             "# one line per stage; ' | ' after each step (the end of a call)"]
    lines += [f"stage {i}: {format_actions(actions)}" for i, actions in enumerate(lists)]
    for sync in ("local", "pipeline"):
        result = simulate(lists, COSTS, step_sync=sync)
        lines.append(f"# simulated, F={F:g} B={B:g}, step_sync={sync}: makespan "
                     f"{result.makespan:g}, bubble {result.bubble:.4f}")
        lines += ["# " + line for line in format_timeline(result).splitlines()]
    return "\n".join(lines) + "\n"


GOLDEN_CASES = [(name, 4, 4, 3, ()) for name in LOOP_SCHEDULES] + [("2bw", 4, 6, 3, (0,))]


@pytest.mark.parametrize("name,d,m,n,drains", GOLDEN_CASES)
def test_golden(name, d, m, n, drains):
    path = GOLDEN / (f"{name}_d{d}_m{m}_n{n}" + "".join(f"_drain{t}" for t in drains) + ".txt")
    text = golden_text(name, d, m, n, drains)
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.read_text() == text, f"{path} changed; regenerate with UPDATE_GOLDEN=1"
    stages = [line.split(": ", 1)[1] for line in path.read_text().splitlines()
              if line.startswith("stage ")]
    assert [parse_actions(line, m) for line in stages] == pipeline_actions(name, d, m, n,
                                                                            drains=drains)


@pytest.mark.parametrize("schedule", ["zb-h1", "pipemare"])
def test_schedules_refuse_activation_recomputation(schedule):
    """zb-h1: Megatron's reentrant recomputation runs a nested backward that would make
    parameter gradients in I and again in W; pipemare: it would redo the forward with the
    backward's newer weights. The flags refuse the combination in one line."""
    from megatron_2bw.arguments import FlagError, parse_args

    flags = ["--cpu", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--mock-data", "--lr", "1e-3", "--train-iters", "2",
             "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule]
    assert parse_args(flags, world_size=2).num_microbatches == 4
    for granularity in (["full", "--recompute-method", "uniform"], ["selective"]):
        with pytest.raises(FlagError, match=f"not with --pipeline-schedule {schedule}"):
            parse_args(flags + ["--recompute-granularity", *granularity], world_size=2)


def test_pipemare_backwards_read_the_newest_version_and_forwards_pipedreams():
    """PipeMare is pipedream's action order with the stash of weights dropped: each forward
    reads the version pipedream's does (newest made before it on its stage), each backward
    the newest made before it; they differ exactly for the look-ahead microbatches
    (j < d - i - 1) of every batch after the first."""
    d, m, n = 4, 4, 3
    pipedream, pipemare = pipeline_actions("pipedream", d, m, n), pipeline_actions("pipemare", d, m, n)
    for stage in range(d):
        newest, forward_of, differ = 0, {}, set()
        assert [(a.kind, a.microbatch) for a in pipedream[stage]] == \
            [(a.kind, a.microbatch) for a in pipemare[stage]]
        for theirs, a in zip(pipedream[stage], pipemare[stage]):
            if a.kind is Kind.STEP:
                newest = a.version
            elif a.kind is Kind.FORWARD:
                assert a.version == theirs.version == newest
                forward_of[a.microbatch] = a.version
            else:
                assert a.version == newest and theirs.version == forward_of[a.microbatch]
                if a.version != forward_of[a.microbatch]:
                    differ.add((a.microbatch // m, a.microbatch % m))
        assert differ == {(t, j) for t in range(1, n) for j in range(d - stage - 1)}, stage


def _pipemare_lists(d: int, m: int, n: int, sync_iters: int, drains=()) -> list[list[Action]]:
    """PipeMare's whole-training lists with `sync_iters` synchronous calls first, built call by
    call as the executor builds them (`pipemare.call_schedule`; a synchronous call drains)."""
    from megatron_2bw.schedules import call_actions
    from megatron_2bw.schedules.pipemare import call_schedule

    lists: list[list[Action]] = [[] for _ in range(d)]
    empty = True
    for t in range(n):
        schedule = call_schedule(t, sync_iters)
        drain = t in drains or t == n - 1 or schedule == "flush"
        for stage in range(d):
            lists[stage] += call_actions(schedule, d, m, stage, t, fill=empty, drain=drain)
        empty = drain
    return lists


@pytest.mark.parametrize("d, m, sync_iters, drains", [(2, 2, 0, ()), (4, 4, 2, ()),
                                                     (4, 8, 1, (2,)), (3, 5, 0, (1,))])
def test_pipemare_versions_per_action(d, m, sync_iters, drains):
    """On stage i, microbatch j of batch t: its F reads W(t-1) if t >= max(N, 1) and
    j < d-i-1 (a look-ahead forward of the asynchronous phase), else W(t); its B reads W(t).
    So (tau_fwd, tau_bkwd) = (1, 0) for those look-ahead microbatches and (0, 0) otherwise,
    whatever the drains; a synchronous call is flush's order. The lists validate (one weight
    version at a time) and the simulator finds one version alive on every stage."""
    from megatron_2bw.schedules.pipemare import delays

    n = sync_iters + 3
    lists = _pipemare_lists(d, m, n, sync_iters, drains)
    for stage, actions in enumerate(lists):
        for a in actions:
            if a.kind is Kind.STEP:
                continue
            t, j = divmod(a.microbatch, m)
            look_ahead = t >= max(sync_iters, 1) and j < d - stage - 1
            expected = t - 1 if a.kind is Kind.FORWARD and look_ahead else t
            assert a.version == expected, (stage, a)
        for k, taus in delays(actions).items():
            t, j = divmod(k, m)
            assert taus == ((1, 0) if t >= max(sync_iters, 1) and j < d - stage - 1 else (0, 0))
        for t in range(sync_iters):  # flush's order: all forwards of the batch, then ...
            assert [(a.kind, a.microbatch) for a in actions if a.batch == t] == \
                [(a.kind, a.microbatch) for a in _flush_call(d, m, stage, t)]
    validate(lists, m, n, version_of=lambda i, k: k // m if k // m < sync_iters else
             SCHEDULES["pipedream"].version_of(d, m, i, k),
             backward_version_of=lambda i, k: k // m, max_versions=1)
    assert list(simulate(lists, COSTS).max_versions) == [1] * d


def _flush_call(d: int, m: int, stage: int, t: int) -> list[Action]:
    from megatron_2bw.schedules import call_actions

    return call_actions("flush", d, m, stage, t, fill=True, drain=True)


def test_pipemare_delays_span_and_buffers():
    """With m >= d every delay is 0 or 1: the stage constants are s_i = max(tau_fwd - tau_bkwd)
    = 1 and tau_i = max(tau_fwd) = 1 on every stage with look-ahead forwards (i < d-1), s = 0
    (no correction) and tau floored at 1 on the last. PipeMare holds one weight-sized buffer,
    three (weights, delta, corrected copy) on the stages T2 corrects."""
    from megatron_2bw.schedules.pipemare import correction_span, forward_delay, weight_buffers

    for d, m in [(1, 1), (2, 2), (2, 5), (4, 4), (4, 8), (8, 8)]:
        spans = [1] * (d - 1) + [0]
        assert [correction_span(d, m, i) for i in range(d)] == spans
        assert [forward_delay(d, m, i) for i in range(d)] == [1] * d
        assert [weight_buffers(d, m, i, correction=False) for i in range(d)] == [1] * d
        assert [weight_buffers(d, m, i, correction=True) for i in range(d)] == \
            [1 + 2 * s for s in spans]
    # m < d: a look-ahead forward of stage i reads the version ceil((d-i-1)/m) steps old
    # (d - i - 1 at m = 1), so T1's tau_i exceeds 1 on every stage but the last two
    for d, m in [(4, 1), (4, 2), (5, 2), (8, 3)]:
        spans = [-(-(d - i - 1) // m) for i in range(d)]
        assert [correction_span(d, m, i) for i in range(d)] == spans, (d, m)
        assert [forward_delay(d, m, i) for i in range(d)] == [max(s, 1) for s in spans]


def test_pipemare_lr_rescheduling_factor():
    """T1: lr_k / tau ** (1 - min(k/K, 1)). tau = 2, K = 4: 1/2 at k=0, 2 ** -0.5 at k=2, 1 from
    k=4 on; tau = 1 (every stage when m >= d): 1 at every step; K = 0: off."""
    from megatron_2bw.schedules.pipemare import lr_factor

    assert [lr_factor(k, 4, 2) for k in (0, 2, 4, 9)] == pytest.approx([0.5, 0.5 ** 0.5, 1, 1])
    assert lr_factor(1, 4, 3) == pytest.approx(3 ** -0.75)
    assert {lr_factor(k, 5, 1) for k in range(8)} == {1.0}
    assert lr_factor(0, 0, 4) == 1.0


def test_pipemare_flags_are_validated_in_one_line():
    """The --pipemare-* flags need --pipeline-schedule pipemare; D lies in (0, 1); the counts
    are >= 0."""
    from megatron_2bw.arguments import FlagError, parse_args
    from megatron_2bw.schedules.pipemare import PipeMareOptions

    flags = ["--cpu", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--mock-data", "--lr", "1e-3", "--train-iters", "2",
             "--pipeline-model-parallel-size", "2"]
    mare = flags + ["--pipeline-schedule", "pipemare"]
    args = parse_args(mare + ["--pipemare-discrepancy-decay", "0.3", "--pipemare-sync-iters",
                              "2", "--pipemare-lr-warmup-steps", "7"], world_size=2)
    assert PipeMareOptions.from_args(args) == PipeMareOptions(0.3, 7, 2)
    assert PipeMareOptions.from_args(parse_args(mare, world_size=2)) == PipeMareOptions()
    for schedule in ("pipedream", "pipemare"):
        below = ["--pipeline-schedule", schedule, "--global-batch-size", "2"]
        assert parse_args(flags + below, world_size=2).num_microbatches == 1
    assert parse_args(mare + ["--global-batch-size", "2", "--pipemare-lr-warmup-steps", "3",
                              "--untie-embeddings-and-output-weights"], world_size=2)
    refused = {("--pipeline-schedule", "pipedream", "--pipemare-sync-iters", "1"):
               "--pipemare-sync-iters: only with --pipeline-schedule pipemare",
               ("--pipemare-lr-warmup-steps", "3"): "--pipemare-lr-warmup-steps: only with",
               ("--pipeline-schedule", "pipemare", "--pipemare-discrepancy-decay", "1"):
               "--pipemare-discrepancy-decay: expected a finite number in \\(0, 1\\)",
               ("--pipeline-schedule", "pipemare", "--pipemare-discrepancy-decay", "0"):
               "--pipemare-discrepancy-decay: expected",
               ("--pipeline-schedule", "pipemare", "--pipemare-sync-iters", "-1"):
               "--pipemare-sync-iters: expected an integer >= 0",
               # m = 1 < d = 2: pipedream and pipemare run, 2BW does not, nor T2, nor T1 with
               # tied embeddings (its stages step with different rates)
               ("--pipeline-schedule", "2bw", "--global-batch-size", "2"):
               "--global-batch-size: 2bw needs m >= d microbatches per batch \\(pipeline depth "
               "2\\): m = 2 / \\(2 x 1\\) = 1",
               ("--pipeline-schedule", "pipemare", "--global-batch-size", "2",
                "--pipemare-discrepancy-decay", "0.5"):
               "--pipemare-discrepancy-decay: PipeMare's discrepancy correction \\(T2\\) runs "
               "with m >= d",
               ("--pipeline-schedule", "pipemare", "--global-batch-size", "2",
                "--pipemare-lr-warmup-steps", "3"):
               "--pipemare-lr-warmup-steps: at m = 1 < pipeline depth 2 T1 gives stages"}
    for extra, message in refused.items():
        with pytest.raises(FlagError, match=message) as error:
            parse_args(flags + list(extra), world_size=2)
        assert "\n" not in str(error.value)


def _deferred_apply_points(schedule: str, d: int, m: int, calls: int, chunks: int = 1):
    """[stage] -> {version: (exchanges with each peer before its apply)}: where the executor
    makes each deferred version (the first step ``reads_from`` says needs it, else the next
    step action), counted in exchanges with each neighbour since the start of training."""
    from megatron_2bw.schedules import call_program, placement_of
    from megatron_2bw.schedules.comm import reads_from

    spec, placement = SCHEDULES[schedule], placement_of(schedule, d, chunks)
    points = []
    for stage in range(d):
        seen, pending, at = {peer: 0 for peer in placement.peers(stage)}, None, {}
        for call in range(calls):
            program = call_program(schedule, d, m, stage, call, fill=call == 0,
                                   drain=call == calls - 1, chunks=chunks)
            needs = reads_from(program, lambda k: spec.version_of(d, m, stage, k))
            for step, need in zip(program, needs):
                if pending is not None and (need == pending or _is_step(step)):
                    at[pending], pending = dict(seen), None
                if _is_step(step):
                    pending = step.version
                elif isinstance(step, Exchange):
                    for peer in {t.peer for t in step.transfers}:
                        seen[peer] += 1
        points.append(at)
    return points


def _is_step(step) -> bool:
    return isinstance(step, Action) and step.kind is Kind.STEP


@pytest.mark.parametrize("d,m", [(2, 2), (2, 4), (3, 3), (3, 5), (4, 4), (4, 8), (6, 7)])
def test_2bws_deferred_step_stalls_every_stage_at_one_consistent_cut(d, m):
    """Where each stage makes a deferred weight version, it has run as many exchanges with
    each neighbour as that neighbour has with it where the neighbour makes it: a consistent
    cut (fused groups meet in issue order), so a step of S seconds delays the pipeline by S
    once, as the simulator's step does. Applied at its first reader instead, a stage that
    receives that reader's input has already met its upstream neighbour's exchange after the
    neighbour's stall, and the stages wait out each other's steps in turn. (With virtual
    stages the rule does not give one cut yet: there a stage's steps still stall its
    neighbours.)"""
    points = _deferred_apply_points("2bw", d, m, calls=5)
    for stage in range(d - 1):
        for version in range(1, 4):
            mine, theirs = points[stage][version], points[stage + 1][version]
            assert mine[stage + 1] == theirs[stage], (stage, version, mine, theirs)
