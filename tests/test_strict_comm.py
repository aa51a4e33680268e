"""The strict NCCL mode itself (``tests/strict/strict_comm.py``) on real 2-process gloo runs.

References, each a rule of NCCL the mode must enforce and plain gloo does not: mirrored fused
groups deliver; unbatched send-before-receive raises the deadlock error; a collective from a
second thread raises; members issuing different collectives are reported by ``check()``; and
a real training run (2 and 4 stages, 2BW) runs with the wrappers, never blocks in lazy
communicator creation, and its members agree.
Guards: patterns that would hang under NCCL fail the tests on gloo.
Each rule: docs/testing.md, "What each test module checks", test_strict_comm.py.
"""

from __future__ import annotations

import sys

import pytest

from tests import dist as launch
from tests.strict import strict_comm


def _init(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _strict_active() -> bool:
    module = sys.modules.get("strict_comm")  # the copy sitecustomize installed
    return module is not None and module.installed()


def _layers() -> int:
    """How many strict wrappers torch.distributed.isend is inside (one: installed once, though
    sitecustomize and tests.dist's worker both install)."""
    import torch.distributed as dist

    function, layers = dist.isend, 0
    while getattr(function, "_megatron_2bw_strict", False):
        function, layers = function.__wrapped__, layers + 1
    return layers


def _finish() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def _fused_worker(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    _init(rank, world_size)
    peer = 1 - rank
    mine, theirs = torch.full((4,), float(rank + 1)), torch.zeros(4)
    send, recv = dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)
    for work in dist.batch_isend_irecv([send, recv] if rank == 0 else [recv, send]):
        work.wait()
    _finish()
    return {"got": theirs.tolist(), "strict": _strict_active(), "layers": _layers()}


def _unbatched_worker(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    _init(rank, world_size)
    peer = 1 - rank
    mine, theirs = torch.full((4,), float(rank + 1)), torch.zeros(4)
    try:  # as the executor once did: both ranks issue their send first, then their receive
        send = dist.isend(mine, peer)
        recv = dist.irecv(theirs, peer)
        send.wait()
        recv.wait()
    except RuntimeError as error:
        return {"error": str(error), "strict": _strict_active()}
    _finish()
    return {"error": None, "got": theirs.tolist(), "strict": _strict_active()}


def _thread_worker(rank: int, world_size: int) -> dict:
    import threading

    import torch
    import torch.distributed as dist

    _init(rank, world_size)
    errors = []

    def off_main_thread():
        try:
            dist.all_reduce(torch.ones(2))
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=off_main_thread, name="helper")
    thread.start()
    thread.join()
    total = torch.ones(2)
    dist.all_reduce(total)
    _finish()
    return {"errors": errors, "total": total.tolist(), "strict": _strict_active()}


def _shapes_worker(rank: int, world_size: int, differ: bool) -> dict:
    import torch
    import torch.distributed as dist

    _init(rank, world_size)
    dist.all_reduce(torch.ones(6))
    shape = (2, 3) if differ and rank == 0 else (6,)
    dist.all_reduce(torch.ones(shape))  # the same 6 elements: gloo does not notice
    _finish()
    return _strict_active()


@pytest.fixture
def own_records(tmp_path, monkeypatch):
    """This test's runs record into their own directory, strict mode on."""
    records = tmp_path / "records"
    monkeypatch.setenv("MEGATRON_2BW_STRICT", "1")
    monkeypatch.setenv("MEGATRON_2BW_STRICT_DIR", str(records))
    monkeypatch.setenv("MEGATRON_2BW_STRICT_TIMEOUT_S", "3")
    return records


def _strict_path(monkeypatch) -> None:
    """Children find tests/strict/sitecustomize.py (also when the session runs with
    MEGATRON_2BW_STRICT=0 and conftest did not add it)."""
    import os

    path = str(launch.REPO / "tests" / "strict")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [path, os.environ.get(
        "PYTHONPATH")])))


def test_mirrored_fused_groups_pass(own_records, tmp_path, monkeypatch):
    _strict_path(monkeypatch)
    results = launch.spawn(_fused_worker, 2, out_dir=tmp_path / "out", timeout=60)
    assert [(r["strict"], r["layers"]) for r in results] == [(True, 1), (True, 1)]
    assert results[0]["got"] == [2.0] * 4 and results[1]["got"] == [1.0] * 4


def test_unbatched_sends_deadlock_under_strict_mode_only(own_records, tmp_path, monkeypatch):
    _strict_path(monkeypatch)
    strict = launch.spawn(_unbatched_worker, 2, out_dir=tmp_path / "strict", timeout=60)
    for rank, result in enumerate(strict):
        assert result["strict"], rank
        assert result["error"] and "found no matching receive posted by rank " \
            f"{1 - rank} within 3 s: under NCCL this send never completes" in result["error"], \
            result
    monkeypatch.setenv("MEGATRON_2BW_STRICT", "0")
    gloo = launch.spawn(_unbatched_worker, 2, out_dir=tmp_path / "gloo", timeout=60)
    assert [r["strict"] for r in gloo] == [False, False]
    assert [r["error"] for r in gloo] == [None, None]
    assert gloo[0]["got"] == [2.0] * 4 and gloo[1]["got"] == [1.0] * 4


def test_a_collective_off_the_main_thread_is_refused(own_records, tmp_path, monkeypatch):
    _strict_path(monkeypatch)
    results = launch.spawn(_thread_worker, 2, out_dir=tmp_path / "out", timeout=60)
    for result in results:
        assert result["strict"]
        assert len(result["errors"]) == 1 and "torch.distributed.all_reduce called from " \
            "thread 'helper', not the main thread" in result["errors"][0], result
        assert result["total"] == [2.0, 2.0]


@pytest.mark.parametrize("differ", [True, False])
def test_members_with_different_collectives_are_reported(own_records, tmp_path, monkeypatch,
                                                         differ):
    _strict_path(monkeypatch)
    assert launch.spawn(_shapes_worker, 2, differ, out_dir=tmp_path / "out", timeout=60) \
        == [True, True]
    problems = strict_comm.check(own_records)
    if differ:
        assert len(problems) == 1, problems
        assert ("collective #1 is all_reduce([2, 3], torch.float32) on rank 0 but "
                "all_reduce([6], torch.float32) on rank 1") in problems[0]
    else:
        assert problems == []
        records = strict_comm.Records(own_records)
        assert len(records.update()) == 1
        (by_rank,) = records.sequences.values()
        assert by_rank[0] == by_rank[1] == [("all_reduce", [6], "torch.float32")] * 2


@pytest.mark.parametrize("depth", [2, 4])
def test_a_training_run_is_strict_and_its_members_agree(own_records, monkeypatch, depth):
    """The docs' example (2BW, Megatron's defaults: clipping 1.0, tied embeddings, the
    deferred step's async all-reduces) at d = 2 and 4, logging every iteration with timers and
    the parameter norm (world collectives right after the call): every group's first use is a
    barrier of its members, as NCCL's lazy communicator creation is. Before communicators were
    created up front, the last stage sat in the creation of the grad-norm group while stage 0
    waited in the log's world collective: the strict mode's creation barrier reported it after
    the 30 s timeout. DDP's and the loop's collectives are recorded on every rank and agree."""
    _strict_path(monkeypatch)
    monkeypatch.delenv("MEGATRON_2BW_STRICT_TIMEOUT_S")
    flags = [*launch.tiny_training_flags(seq_length=16, train_iters=3), "--mock-data",
             "--num-layers", str(depth), "--pipeline-model-parallel-size", str(depth),
             "--pipeline-schedule", "2bw", "--timing-log-level", "1", "--log-params-norm",
             "--distributed-timeout-minutes", "0.5"]
    result = launch.torchrun(["pretrain_gpt_2bw.py", *flags], depth, timeout=240)
    assert "lazy communicator creation would hang" not in result.output, result.tail()
    assert result.returncode == 0, result.tail()
    assert "2bw optimizer step on stage 0: deferred" in result.output
    assert "iteration        3/       3" in result.output, result.tail()
    records = strict_comm.Records(own_records)
    (run,) = records.update()
    ops = {op for (r, _), by_rank in records.sequences.items() if r == run
           for sequence in by_rank.values() for op, _, _ in sequence}
    assert "all_reduce" in ops, ops
    assert records.finished[run] == set(range(depth))
    assert records.problems() == []


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("depth", [2, 3, 4, 6])
def test_the_neighbour_warm_up_cannot_deadlock(depth, ring):
    """Each stage's warm-up exchanges (runtime.distributed.warm_up_pairs), run as rendezvous
    (an exchange happens once both stages have it first in their remaining lists), all happen:
    every neighbouring pair once, the ring's closing pair too with virtual stages."""
    from megatron_2bw.runtime.distributed import warm_up_pairs

    todo = {stage: list(warm_up_pairs(stage, depth, ring)) for stage in range(depth)}
    done = []
    while any(todo.values()):
        ready = {pairs[0] for stage, pairs in todo.items() if pairs
                 and all(todo[s] and todo[s][0] == pairs[0] for s in pairs[0])}
        assert ready, f"deadlock with {todo}"
        for pair in sorted(ready):
            for stage in pair:
                todo[stage].pop(0)
            done.append(pair)
    expected = {(s, s + 1) for s in range(depth - 1)} | ({(0, depth - 1)} if ring else set())
    assert sorted(done) == sorted(expected)
