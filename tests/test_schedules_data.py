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

from megatron_2bw.schedules import (SCHEDULES, Action, Kind, P2P, ScheduleError, call_actions,
                                    communication, format_actions, keeps_versions, parse_action,
                                    parse_actions, pipeline_actions, stage_actions, validate)
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


def cases(num_batches: int = 3):
    for name in SCHEDULES:
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
        validate(lists, m, n, version_of=lambda i, k: spec.version_of(d, m, i, k),
                 max_versions=spec.max_versions)
        for actions in lists:
            assert len(actions) == 2 * n * m + n


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
                backwards = [a.microbatch for a in actions if a.kind is Kind.BACKWARD]
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
                elif a.kind is Kind.BACKWARD:
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
    """Peak stashed activations: m for GPipe; min(d-i, m) at stage i for Flush (d-i when m>=d);
    d-i for 2BW and PipeDream; 1 for naive. Weight versions alive: 2 for 2BW (from the second
    batch on) and for PipeDream but on its last stage, 1 otherwise. The simulator measures them; each schedule declares them."""
    for name, d, m, n in cases():
        result = simulate(pipeline_actions(name, d, m, n), COSTS)
        spec = SCHEDULES[name]
        assert result.peak_stash == tuple(spec.stash(d, m, i) for i in range(d))
        expected = {"gpipe": [m] * d, "flush": [min(d - i, m) for i in range(d)],
                    "2bw": [d - i for i in range(d)], "pipedream": [d - i for i in range(d)],
                    "naive": [1] * d}[name]
        assert list(result.peak_stash) == expected
        versions = [spec.max_versions] * d
        if name == "pipedream":  # the last stage has no look-ahead forward: synchronous
            versions[-1] = 1
        assert list(result.max_versions) == versions


def test_pipedream_forwards_read_the_newest_version_and_stash_it():
    """PipeDream's rule, from the action order alone: without drains, every forward reads the
    newest version its stage has made before it, and its backward the same (stashed) one; the
    stages of one microbatch read different versions (no vertical sync); 2 versions at most."""
    for d, m in ((2, 2), (4, 4), (4, 8), (3, 5)):
        lists = pipeline_actions("pipedream", d, m, num_batches=4)
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
        assert simulate(lists, COSTS).max_versions == (2,) * (d - 1) + (1,)


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


GOLDEN_CASES = [(name, 4, 4, 3, ()) for name in SCHEDULES] + [("2bw", 4, 6, 3, (0,))]


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
