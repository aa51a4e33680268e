"""No schedule of ours makes more host syncs per iteration than megatron-core's own.

The counter (tests/strict/host_syncs.py) wraps every host-syncing call (``.item()``, ``.cpu()``,
synchronize, ...) in every process of a real 2-stage pipeline run (tests/schedule_worker.py,
``--bf16``) for every schedule, with one and two model chunks, and counts the steady-state
iterations. Reference: megatron-core's own schedule (``--pipeline-schedule megatron``) on the
same flags, stage and processes. Guards: no sync added to the executor's hot path. The method
and the counts observed: docs/testing.md, "What each test module checks", test_host_syncs.py.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.dist import REPO
from tests.test_schedules_exact import _run_bounded

WORKER = REPO / "tests" / "schedule_worker.py"
ITERATIONS = 6
STEADY_FROM = 2  # iterations 0 and 1 (set-up, fill, the drain after 1) are left out
TWO_CHUNKS = ["--num-virtual-stages-per-pipeline-rank", "2"]
FLAGS = ["--bf16"]
RUNS = {  # name -> (schedule, more flags, the megatron run it is held to)
    "megatron": ("megatron", [], None),
    "flush": ("flush", [], "megatron"),
    "gpipe": ("gpipe", [], "megatron"),
    "naive": ("naive", [], "megatron"),
    "zb-h1": ("zb-h1", [], "megatron"),
    "2bw": ("2bw", [], "megatron"),
    "pipedream": ("pipedream", [], "megatron"),
    "pipemare": ("pipemare", ["--pipemare-discrepancy-decay", "0.5"], "megatron"),
    "megatron-v2": ("megatron", TWO_CHUNKS, None),
    "flush-v2": ("flush", TWO_CHUNKS, "megatron-v2"),
    "2bw-v2": ("2bw", TWO_CHUNKS, "megatron-v2"),
}


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict[str, list[dict]]:
    """run -> per rank: the steady state's syncs per iteration and by site (summed)."""
    out = tmp_path_factory.mktemp("host_syncs")
    runs = [{"name": name, "schedule": schedule, "tp": 1, "pp": 2, "m": 4,
             "iters": ITERATIONS, "flags": FLAGS + flags, "drains": [STEADY_FROM - 1]}
            for name, (schedule, flags, _) in RUNS.items()]
    spec = {"out": str(out), "init": None, "timeout_minutes": 1.0, "count_host_syncs": True,
            "groups": {"pipeline": {"world": 2, "timeout_s": 150, "runs": runs}}}
    (out / "spec.json").write_text(json.dumps(spec))
    code, output, _ = _run_bounded([sys.executable, str(WORKER), str(out / "spec.json")], 240)
    summary = json.loads((out / "launch.json").read_text()) if code == 0 else {}
    logs = "\n".join(log.read_text()[-3000:] for log in sorted((out / "pipeline").glob("*.log")))
    assert summary.get("pipeline", {}).get("exit_codes") == [0, 0], f"{output[-3000:]}\n{logs}"
    return {name: [_steady(torch.load(out / name / f"rank{rank}.pt", weights_only=False))
                   for rank in range(2)] for name in RUNS}


def _steady(result: dict) -> dict:
    iterations = result["host_syncs"][STEADY_FROM:]
    assert len(iterations) == ITERATIONS - STEADY_FROM, "the counter was not installed"
    sites: dict[str, int] = {}
    for counts in iterations:
        for site, n in counts.items():
            sites[site] = sites.get(site, 0) + n
    return {"per_iteration": sum(sites.values()) / len(iterations), "sites": sites}


def _excess(ours: dict, theirs: dict) -> str:
    """The sites where ``ours`` syncs more often than ``theirs``, per iteration."""
    n = ITERATIONS - STEADY_FROM
    return "\n".join(f"    {site}: {count / n:g} vs {theirs['sites'].get(site, 0) / n:g}"
                     for site, count in sorted(ours["sites"].items())
                     if count > theirs["sites"].get(site, 0))


@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if run[2]])
def test_no_more_host_syncs_than_megatron(counted, name):
    """On every stage, the schedule's syncs per steady-state iteration <= megatron-core's."""
    bound = RUNS[name][2]
    for stage, (ours, theirs) in enumerate(zip(counted[name], counted[bound])):
        assert ours["per_iteration"] <= theirs["per_iteration"], (
            f"{name}, stage {stage}: {ours['per_iteration']:g} host syncs per iteration, "
            f"{bound} {theirs['per_iteration']:g}; more often at:\n{_excess(ours, theirs)}")


@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if run[2]])
def test_no_host_sync_per_microbatch(counted, name):
    """No site of this package syncs more than once per iteration (4 microbatches): the
    per-microbatch path syncs nowhere. (megatron-core's p2p synchronizes after every batched
    exchange, which leaves room under the bound above for a few syncs of ours per call.)"""
    n = ITERATIONS - STEADY_FROM
    for stage, counts in enumerate(counted[name]):
        ours = {site: count / n for site, count in counts["sites"].items()
                if " megatron_2bw/" in site and count > n}
        assert not ours, f"{name}, stage {stage}: syncs per iteration {ours}"


def test_counter_sees_megatrons_syncs(counted):
    """The counter works: megatron-core's schedule syncs at its p2p (torch.cuda.synchronize
    after each batched exchange, the CPU runtime's stand-in) and the loss average reads its
    value, on the last stage, once per iteration."""
    megatron = counted["megatron"]
    assert any(site.startswith("cuda.synchronize megatron/core/pipeline_parallel/p2p")
               for site in megatron[0]["sites"]), megatron[0]["sites"]
    per_iteration = {site: n / (ITERATIONS - STEADY_FROM)
                     for site, n in megatron[1]["sites"].items()}
    assert per_iteration.get(f"Tensor.__float__ {_LOSS_SITE}") == 1, per_iteration


_LOSS_SITE = "tests/schedule_worker.py:" + str(next(
    number for number, line in enumerate(WORKER.read_text().splitlines(), 1)
    if "losses.append({key: float(" in line))
