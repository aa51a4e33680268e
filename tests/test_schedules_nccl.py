"""Communication as schedule data, checked in the simulator's NCCL mode (no processes).

NCCL mode: a send completes only once the peer posted the matching receive, the n-th send on a
channel meets the n-th receive, and a fused group (`Exchange`) progresses as one. The programs
the executor runs (`call_program`, `pipeline_programs`) must finish under it for every schedule
and shape; the pattern they replace (every transfer its own call, a send right after its action)
must not, which shows the check can fail.
"""

from __future__ import annotations

import pytest

from megatron_2bw.schedules import (SCHEDULES, V_SCHEDULES, Action, Costs, Exchange, Kind, ScheduleError,
                                    Transfer, actions_of, forward_program, pipeline_actions,
                                    pipeline_programs, simulate, transfers_of, unbatched)

LOOP_SCHEDULES = sorted(set(SCHEDULES) - set(V_SCHEDULES))  # the V's: tests/test_vshape.py
GRID = [(name, d, m) for name in LOOP_SCHEDULES for d in range(2, 9)
        for m in (d, 2 * d, 4 * d)]
COSTS = Costs(forward=1.0, backward=2.0)


@pytest.mark.parametrize("name", LOOP_SCHEDULES)
def test_every_schedule_finishes_under_nccl_rules(name):
    """d in 2..8, m in {d, 2d, 4d}, four batches with a drain (evaluation) after the second,
    steps local or pipeline-wide (clipping, tied embeddings, fp16): no deadlock, and the same
    makespan as the buffered model, whose dependencies come from the action ends directly
    (the fused groups cost no time of their own at p2p = 0)."""
    for _, d, m in [g for g in GRID if g[0] == name]:
        for sync in ("local", "pipeline"):
            programs = pipeline_programs(name, d, m, 4, drains=[1])
            buffered = pipeline_actions(name, d, m, 4, drains=[1])
            assert [actions_of(p) for p in programs] == buffered
            result = simulate(programs, COSTS, step_sync=sync)
            assert result.makespan == pytest.approx(
                simulate(buffered, COSTS, step_sync=sync).makespan), (name, d, m, sync)


def test_evaluation_programs_finish_under_nccl_rules():
    for d in range(2, 9):
        for m in (1, d, 3 * d):
            programs = [forward_program(d, m, stage) for stage in range(d)]
            result = simulate(programs, COSTS)
            assert result.makespan == pytest.approx(m + d - 1)  # F = 1: a wave of m forwards


def test_every_transfer_completes_in_its_call():
    """Each call's sends meet their receives in the same call: a send left for the next call
    would hold its stage across the optimizer step. 2BW's look-ahead activation is received
    early, in the exchange before the step, so the step never sits inside a wait."""
    for name, d, m in GRID:
        programs = pipeline_programs(name, d, m, 3)
        for stage, program in enumerate(programs):
            calls = _calls(program)
            assert sum(map(len, calls)) == len(program) and len(calls) == 3
            for t, steps in enumerate(calls):
                for peer in (stage - 1, stage + 1):
                    if not 0 <= peer < d:
                        continue
                    peer_calls = _calls(programs[peer])
                    sent = [(x.tensor, x.microbatch) for x in transfers_of(steps)
                            if x.op == "send" and x.peer == peer]
                    got = [(x.tensor, x.microbatch) for x in transfers_of(peer_calls[t])
                           if x.op == "recv" and x.peer == stage]
                    assert sent == got, (name, d, m, stage, peer, t)


def _calls(program):
    calls, current = [], []
    for step in program:
        current.append(step)
        if isinstance(step, Action) and step.kind is Kind.STEP:
            calls.append(current)
            current = []
    return calls


def test_fused_groups_of_a_two_stage_2bw():
    """The program written out by hand from the 1F1B order (Megatron's
    send_forward_recv_backward / send_backward_recv_forward), with stage 1 receiving the
    look-ahead activation F2 early, before its step."""
    programs = pipeline_programs("2bw", 2, 2, 2)
    assert " ".join(map(str, programs[0])) == (
        "F0v0 {sa0:1} F1v0 {sa1:1 rg0:1} B0v0 F2v0 {sa2:1 rg1:1} B1v0 S1 "
        "F3v0 {sa3:1 rg2:1} B2v0 {rg3:1} B3v0 S2")
    assert " ".join(map(str, programs[1])) == (
        "{ra0:0} F0v0 B0v0 {sg0:0 ra1:0} F1v0 B1v0 {sg1:0 ra2:0} S1 "
        "F2v0 B2v0 {sg2:0 ra3:0} F3v0 B3v0 {sg3:0} S2")


@pytest.mark.parametrize("name", ["flush", "2bw"])
@pytest.mark.parametrize("d", [2, 3, 4, 6])
def test_the_unbatched_pattern_deadlocks(name, d):
    """Every transfer its own call, a receive right before its action and a send right after
    it: both neighbours send before they receive, and under NCCL both wait forever. gloo buffers
    sends, which is why this ran on CPU."""
    m = d
    lists = pipeline_actions(name, d, m, 2)
    programs = [unbatched(actions, stage, d) for stage, actions in enumerate(lists)]
    with pytest.raises(ScheduleError, match=r"deadlock(.|\n)*ERROR HERE"):
        simulate(programs, COSTS)


def test_a_send_left_to_the_next_call_deadlocks_with_a_pipeline_wide_step():
    """Move stage 1's early receive of the look-ahead activation to its next call: stage 0's
    send then waits across the step. With a pipeline-wide step (clipping, tied embeddings,
    fp16) that is a deadlock; with stage-local steps it finishes, later (stage 0 waits out
    stage 1's step)."""
    programs = pipeline_programs("2bw", 2, 2, 2)
    early = Transfer("recv", 0, "activation", 2)
    moved = []
    for step in programs[1]:
        if isinstance(step, Exchange) and early in step.transfers:
            rest = tuple(t for t in step.transfers if t != early)
            moved.append(Exchange(rest))
        elif step == Action(Kind.FORWARD, 2, 1, 0):
            moved += [Exchange((early,)), step]
        else:
            moved.append(step)
    late = [programs[0], moved]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(late, COSTS, step_sync="pipeline")
    with_steps = Costs(forward=1.0, backward=2.0, step=1.0)
    assert simulate(late, with_steps).makespan > simulate(programs, with_steps).makespan


def test_a_receive_out_of_order_is_caught():
    """Swapping two receives on a channel makes them meet the wrong microbatches."""
    programs = pipeline_programs("flush", 2, 2, 1)
    steps = programs[1]
    first = next(i for i, s in enumerate(steps) if isinstance(s, Exchange))
    second = next(i for i, s in enumerate(steps) if isinstance(s, Exchange) and i > first
                  and any(t.op == "recv" for t in s.transfers))
    a = [t for t in steps[first].transfers if t.op == "recv"][0]
    b = [t for t in steps[second].transfers if t.op == "recv"][0]
    swap = {a: b, b: a}
    programs[1] = [Exchange(tuple(swap.get(t, t) for t in s.transfers))
                   if isinstance(s, Exchange) else s for s in steps]
    with pytest.raises(ScheduleError, match="expects the activation of microbatch 1"):
        simulate(programs, COSTS)


def test_an_input_never_received_is_a_dependency_violation():
    """Stage 1 runs F0 before the exchange that receives its input."""
    programs = pipeline_programs("gpipe", 2, 2, 1)
    assert str(programs[1][0]) == "{ra0:0}" and str(programs[1][1]) == "F0v0"
    programs[1][0], programs[1][1] = programs[1][1], programs[1][0]
    with pytest.raises(ScheduleError, match="dependency violation(.|\n)*is not received"):
        simulate(programs, COSTS)


def test_show_prints_the_programs_and_the_simulated_run(capsys):
    """``python -m megatron_2bw.schedules``: stage 1 of a 2-stage Flush receives microbatch 0's
    activation before its first forward and ends with its step; the run finishes in the
    closed-form makespan of 1F1B with unit costs F 1, B 2: (m + d - 1) x 3 = 9."""
    from megatron_2bw.schedules.__main__ import main

    assert main(["flush", "--stages", "2", "--microbatches", "2", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    stage1 = next(line for line in out.splitlines() if line.startswith("stage 1: "))
    assert stage1.split()[2:4] == ["{ra0:0}", "F0v0"] and stage1.endswith("S1")
    assert "NCCL mode: finishes, makespan 9," in out
