"""ZB-V and DualPipeV as data: two chunks per stage in a V (schedules/vshape.py).

Orders: equal, per rank, to torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` for the same d and m (their ``_calculate_single_rank_operations`` run on a
stand-in, no process group needed). Bubbles: the buffered simulator's idle time against the
closed forms of ZB-V (Qi et al., ICLR 2024, Section 6) and DualPipeV (DeepSeek-V3 technical
report, Table 2), for m >= 2d - 1. Guards: the V schedules run the published orders with the
published bubbles. The derivations of both formulas: docs/schedules.md, "ZB-V and DualPipeV";
the set-up: docs/testing.md, "What each test module checks", test_vshape.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from megatron_2bw.schedules import (SCHEDULES, Action, Costs, Exchange, Kind, Placement,
                                    ScheduleError, actions_of, call_actions, pipeline_actions,
                                    pipeline_programs, placement_of, simulate, validate)

TORCH_CLASSES = {"zb-v": torch_schedules.ScheduleZBVZeroBubble,
                 "dualpipev": torch_schedules.ScheduleDualPipeV}
LETTER = {torch_schedules.F: "F", torch_schedules.I: "I", torch_schedules.W: "W",
          torch_schedules.B: "B"}


def torch_order(name: str, d: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, torch's passes as (kind, virtual stage, microbatch), bubbles (None) left out."""
    stand_in = SimpleNamespace(pp_group_size=d, num_stages=2 * d, _num_stages=2 * d,
                               _n_microbatches=m)
    ranks = []
    for rank in range(d):
        passes = []
        for action in TORCH_CLASSES[name]._calculate_single_rank_operations(stand_in, rank):
            if action is None:
                continue
            for a in action.sub_actions or (action,):
                passes.append((LETTER[a.computation_type], a.stage_index, a.microbatch_index))
        ranks.append(passes)
    return ranks


def our_order(name: str, d: int, m: int, batch: int = 0) -> list[list[tuple[str, int, int]]]:
    v = Placement.v(d)
    return [[(a.kind.value, v.virtual(i, a.chunk), a.microbatch - batch * m)
             for a in call_actions(name, d, m, i, batch, fill=True, drain=True)
             if a.kind is not Kind.STEP] for i in range(d)]


def grid(name: str, depths=range(1, 7)):
    for d in depths:
        for m in range(2 * d if name == "dualpipev" else 1, 3 * d + 3):
            yield d, m


def full(name: str, d: int) -> list[int]:
    """m from a full V on (2d - 1 for ZB-V, DualPipeV's least 2d), 2d + 1 and 3d."""
    return sorted({2 * d if name == "dualpipev" else 2 * d - 1, 2 * d + 1, 3 * d})


@pytest.mark.parametrize("name", sorted(TORCH_CLASSES))
def test_orders_equal_torch_pipelinings(name):
    for d, m in grid(name):
        assert our_order(name, d, m) == torch_order(name, d, m), (name, d, m)
        assert our_order(name, d, m, batch=2) == torch_order(name, d, m)  # every call alike


def test_the_v_placement():
    """Stage i holds virtual stages i and 2d-1-i: the turn is local to stage d-1, and stage 0
    holds the input (chunk 0) and the loss (chunk 1)."""
    v = Placement.v(4)
    assert [(v.virtual(i, 0), v.virtual(i, 1)) for i in range(4)] == [(0, 7), (1, 6), (2, 5),
                                                                        (3, 4)]
    assert [v.holder(k) for k in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1),
                                               (1, 1), (0, 1)]
    assert v.neighbour(3, 0, 1) == (3, 1) and v.neighbour(3, 1, -1) == (3, 0)
    assert v.is_first(0, 0) and v.is_last(0, 1) and not v.is_last(3, 1)
    assert v.neighbour(0, 1, 1) is None and v.neighbour(0, 0, -1) is None
    assert [v.peers(i) for i in range(4)] == [[1], [0, 2], [1, 3], [2]]


def bubble_of(name: str, d: int, m: int, f: float, i: float, w: float) -> tuple[float, float]:
    """(simulated bubble, the paper's formula) for one batch."""
    result = simulate(pipeline_actions(name, d, m, 1), Costs(forward=f, backward=i + w,
                                                             weight_grad=w),
                      placement=placement_of(name, d))
    idle = (d - 1) * f if name == "zb-v" else (d - 1) * ((f + i + w) + i - 3 * w)
    return result.bubble, idle / (idle + 2 * m * (f + i + w))


@pytest.mark.parametrize("name,costs", [("zb-v", (1, 1, 1)), ("zb-v", (1, 1, 0.5)),
                                        ("dualpipev", (1, 1, 1)), ("dualpipev", (2, 1, 1)),
                                        ("dualpipev", (1.5, 1, 1))])
def test_bubble_is_the_papers(name, costs):
    for d in range(2, 6):
        for m in full(name, d):
            simulated, formula = bubble_of(name, d, m, *costs)
            assert simulated == pytest.approx(formula), (d, m)


def test_zbv_bubble_is_a_sixth_of_1f1b():
    """At equal costs ZB-V idles (d-1) T_F per stage; flush (1F1B) on the same stage work
    (F = 2, B = 4 per microbatch) idles (d-1)(F + B) = 6 (d-1)."""
    for d in (2, 4):
        m = 2 * d
        zbv = simulate(pipeline_actions("zb-v", d, m, 1), Costs(1, 2),
                       placement=placement_of("zb-v", d))
        flush = simulate(pipeline_actions("flush", d, m, 1), Costs(2, 4))
        assert flush.makespan - 6 * m == 6 * (zbv.makespan - 6 * m) == 6 * (d - 1)


@pytest.mark.parametrize("name", sorted(TORCH_CLASSES))
def test_programs_finish_under_nccl_rules(name):
    """Rendezvous sends, fused groups (comm.fuse), two batches: no deadlock, within 15% of the
    buffered time (sends that never wait); each stage exchanges with its neighbours only, and
    the V's turn on stage d-1 is no transfer."""
    for d in range(2, 6):
        for m in full(name, d)[::2]:
            programs = pipeline_programs(name, d, m, 2)
            assert [actions_of(p) for p in programs] == pipeline_actions(name, d, m, 2)
            for i, program in enumerate(programs):
                peers = {t.peer for s in program if isinstance(s, Exchange) for t in s.transfers}
                assert peers <= {i - 1, i + 1} and peers, (d, m, i)
            result = simulate(programs, Costs(1, 2), placement=placement_of(name, d))
            buffered = simulate(pipeline_actions(name, d, m, 2), Costs(1, 2),
                                placement=placement_of(name, d))
            assert buffered.makespan <= result.makespan <= 1.15 * buffered.makespan, (d, m)


@pytest.mark.parametrize("name", sorted(TORCH_CLASSES))
def test_groups_mirror_one_to_one(name):
    """For each pair of neighbours, the n-th group one side exchanges with the other holds
    exactly the mirror of the other side's n-th (NCCL's fused groups, and the tests' strict
    mode, make a group wait for all its sends' receives: a group met by two would hang)."""
    def groups(program, peer, mirror=False):
        flip = {"send": "recv", "recv": "send"}
        return [sorted(((flip[t.op] if mirror else t.op), *t.key) for t in step.transfers)
                for step in program if isinstance(step, Exchange)
                and any(t.peer == peer for t in step.transfers)]

    for d in range(2, 6):
        for m in full(name, d):
            programs = pipeline_programs(name, d, m, 1)
            for i in range(d - 1):
                assert groups(programs[i], i + 1) == groups(programs[i + 1], i, mirror=True), \
                    (d, m, i)


def test_memory_declared_by_each_schedule():
    """Peak chunk passes stashed (between F and B/I) and pending (between I and W), measured
    by the simulator, as each schedule declares: ZB-V min(2d, m+1+i, 2m), at most 2d chunk
    halves = 1F1B's d stage activations; DualPipeV 2d + 1 and i + 1."""
    for name in TORCH_CLASSES:
        spec = SCHEDULES[name]
        for d, m in grid(name, range(1, 5)):
            result = simulate(pipeline_actions(name, d, m, 1), Costs(1, 2),
                              placement=placement_of(name, d))
            assert result.peak_stash == tuple(spec.stash(d, m, i) for i in range(d))
            assert result.peak_weight_grads == tuple(spec.weight_grads(d, m, i)
                                                     for i in range(d))
            if name == "zb-v":
                assert max(result.peak_stash) <= 2 * d
            else:
                assert result.peak_stash == (2 * d + 1,) * d


def test_a_turn_taken_before_it_is_made_is_refused():
    """Stage d-1's chunk 1 reads chunk 0's output of the same microbatch on the same stage:
    the validator and the simulator both refuse it out of order."""
    d, m = 2, 3
    lists = pipeline_actions("zb-v", d, m, 1)
    last = lists[d - 1]
    first_turn = next(j for j, a in enumerate(last) if a.kind is Kind.FORWARD and a.chunk == 1)
    own_forward = next(j for j, a in enumerate(last)
                       if a.kind is Kind.FORWARD and a.chunk == 0
                       and a.microbatch == last[first_turn].microbatch)
    last[first_turn], last[own_forward] = last[own_forward], last[first_turn]
    with pytest.raises(ScheduleError, match="has not made it yet"):
        validate(lists, m, 1, placement=Placement.v(d))
    with pytest.raises(ScheduleError, match="made by chunk 0 of this stage after it"):
        simulate(lists, placement=Placement.v(d))


def test_dualpipev_needs_two_d_microbatches():
    with pytest.raises(ValueError, match="at least 2d microbatches"):
        pipeline_actions("dualpipev", 4, 7, 1)
    with pytest.raises(ValueError, match="2 model chunks per stage"):
        call_actions("zb-v", 2, 4, 0, 0, fill=True, drain=True, chunks=3)
    assert call_actions("zb-v", 2, 4, 0, 0, fill=True, drain=True, chunks=2) == \
        call_actions("zb-v", 2, 4, 0, 0, fill=True, drain=True)
    assert Action(Kind.FORWARD, 0, 0, 0, 1) in call_actions("zb-v", 2, 4, 0, 0, fill=True,
                                                            drain=True)
