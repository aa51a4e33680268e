"""Uneven pipeline layouts under every schedule, against the single-process references.

Each case splits the layers with one of Megatron-LM's flags and states the split it expects;
the chunks load the reference's weights by that split, so a run whose chunks hold other
layers fails to load or ends far from its reference. References: the PP=1 ones of
tests/test_schedules_exact.py (a split changes where layers run, not the update rule),
tolerance 1e-6 relative. Every case runs on 2 processes (d = 2, m = 4) in one process group:
the loop schedules, virtual stages and the V's.
The cases: docs/testing.md, "What each test module checks", test_layouts_exact.py.
"""

from __future__ import annotations

import pytest

from tests.test_schedules_exact import (Case, Launch, _check_against_reference,
                                        _reference_jobs_of, groups_by_world, launch_worker)

LAST1 = ("--decoder-last-pipeline-num-layers", "1")
CASES = [
    # the loop, one chunk per rank
    Case("flush", d=2, m=4, w=1, iters=5, flags=LAST1, split=(3, 1)),
    Case("gpipe", d=2, m=4, w=1, iters=5, flags=("--decoder-first-pipeline-num-layers", "1"),
         split=(1, 3)),
    Case("naive", d=2, m=4, w=1, iters=5, layers=5,
         flags=("--account-for-loss-in-pipeline-split",), split=(3, 2)),
    Case("zb-h1", d=2, m=4, w=1, iters=5, flags=("--pipeline-model-parallel-layout", "E|t*4,L"),
         split=(0, 4)),
    Case("megatron", d=2, m=4, w=1, iters=5, flags=LAST1, split=(3, 1)),
    Case("2bw", d=2, m=4, w=1, iters=6, flags=LAST1, split=(3, 1)),
    Case("2bw", d=2, m=4, w=1, iters=6, tie=False,
         flags=("--pipeline-model-parallel-layout", "Et*4|L"), split=(4, 0)),
    Case("pipedream", d=2, m=4, w=1, iters=6, flags=("--decoder-first-pipeline-num-layers", "3"),
         split=(3, 1)),
    Case("pipemare", d=2, m=4, w=1, iters=6, flags=LAST1, split=(3, 1)),
    # virtual stages: chunk c of rank i holds virtual stage 2c + i
    Case("flush", d=2, m=4, w=1, iters=5,
         flags=("--pipeline-model-parallel-layout", "Et|tt|t|L"), split=(1, 2, 1, 0)),
    Case("2bw", d=2, m=4, w=1, iters=6, layers=6,
         flags=("--num-virtual-stages-per-pipeline-rank", "2", "--decoder-last-pipeline-num-"
                "layers", "2"), split=(2, 1, 2, 1)),
    Case("megatron", d=2, m=4, w=1, iters=5,
         flags=("--pipeline-model-parallel-layout", "Ett|t||tL"), split=(2, 1, 0, 1)),
    # the V: rank i holds virtual stages i and 3 - i, rank 0 the embedding and the loss
    Case("zb-v", d=2, m=4, w=1, iters=6, tie=False,
         flags=("--pipeline-model-parallel-layout", "E,t|t*2|t|L"), split=(1, 2, 1, 0)),
    Case("dualpipev", d=2, m=4, w=1, iters=6, tie=False,
         flags=("--pipeline-model-parallel-layout", "E|t|t*2|t,L"), split=(0, 1, 2, 1)),
]


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launch:
    groups = groups_by_world(CASES, prefix="uneven-world")
    groups["uneven-world2"]["timeout_s"] = 20 * len(CASES)  # a run ~3 s on 2 idle cores
    launched = launch_worker(tmp_path_factory.mktemp("layouts_exact"), _reference_jobs_of(CASES),
                             groups, timeout_s=600)
    launched.finished("uneven-world2")
    return launched


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_an_uneven_split_trains_as_its_reference(launch, case):
    """The weights after the run equal its rule's PP=1 reference (and lie far from the other
    rule's); the losses are the reference's."""
    _check_against_reference(launch, case)
