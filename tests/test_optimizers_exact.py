"""Muon and 2BW's stale-weight corrections on real megatron-core models over gloo, against
single-process references (tests/reference.py: ``muon_step``, ``_read_version`` and the
"dc"/"ef" lines of ``reference_run``), as tests/test_schedules_exact.py checks the schedules.

Each run's weights equal its reference within 1e-6 and lie away from the same rule without the
correction (or with Adam instead of Muon), so a correction that does nothing fails. The cases
covered (schedules, replicas, TP, virtual stages, checkpoints): docs/testing.md, "What each test
module checks", test_optimizers_exact.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.test_schedules_exact import (DISTINCT, TOLERANCE, TWO_CHUNKS, Case, Launch, _gather,
                                        _reference, _worst_tensor, groups_by_world,
                                        launch_worker, reference_job, relative_error)

DISTOPT = ("--use-distributed-optimizer",)
CHANGED = 1e-5
"""A correction's result lies at least this far from the uncorrected rule's."""

MUON_CASES = [
    Case("flush", d=2, m=4, w=1, iters=5, optimizer="muon"),
    Case("megatron", d=2, m=4, w=1, iters=5, optimizer="muon"),
    Case("pipedream", d=2, m=2, w=1, iters=6, optimizer="muon"),
    Case("zb-v", d=2, m=4, w=1, iters=6, tie=False, llama=True, optimizer="muon"),
    Case("2bw", d=2, m=2, w=1, iters=6, warmup=3, optimizer="muon"),
    Case("2bw", d=2, m=2, w=1, iters=6, deferred=False, optimizer="muon"),
    Case("2bw", d=2, m=4, w=1, iters=6, flags=TWO_CHUNKS, optimizer="muon"),
    Case("2bw", d=2, m=2, w=1, iters=6, tp=2, optimizer="muon"),
    # --use-distributed-optimizer with Muon: --optimizer dist_muon, each replica steps whole
    # parameters and all-gathers them (the deferred step's too; its norm spans the world)
    Case("2bw", d=2, m=2, w=2, iters=6, optimizer="muon", flags=DISTOPT),
    Case("flush", d=2, m=4, w=2, iters=5, optimizer="muon", flags=DISTOPT),
    # dealt out with tensor parallelism (each TP rank's blocks of the parameters it steps) and
    # over the chunks of virtual stages (one deferred step and all-gather for both)
    Case("flush", d=1, m=2, w=2, iters=5, tp=2, optimizer="muon", flags=DISTOPT),
    Case("2bw", d=2, m=4, w=2, iters=6, optimizer="muon", flags=TWO_CHUNKS + DISTOPT),
]
CORRECTION_CASES = [
    Case("2bw", d=2, m=2, w=2, iters=6, correction="predict"),
    Case("2bw", d=2, m=2, w=1, iters=6, warmup=3, deferred=False, correction="predict"),
    Case("2bw", d=2, m=2, w=1, iters=6, tp=2, correction="predict"),
    # R made on each replica's shards (of Adam's, whole parameters of dist_muon's) and summed
    # over the replicas: right after the deferred step, and before --overlap-param-gather's
    # all-gather of the weights (the next forward's)
    Case("2bw", d=2, m=2, w=2, iters=6, correction="predict", flags=DISTOPT),
    Case("2bw", d=2, m=2, w=2, iters=6, correction="predict", optimizer="muon", flags=DISTOPT),
    Case("2bw", d=1, m=2, w=2, iters=6, correction="predict",
         flags=DISTOPT + ("--overlap-grad-reduce", "--overlap-param-gather")),
    Case("2bw", d=2, m=2, w=1, iters=7, correction="predict", drains=(3,), round_trip=True),
    Case("2bw", d=2, m=2, w=1, iters=6, correction="dc", coeff=1000.0),
    Case("2bw", d=2, m=2, w=2, iters=6, deferred=False, correction="dc", coeff=1000.0,
         flags=DISTOPT),
    Case("2bw", d=2, m=4, w=1, iters=6, flags=TWO_CHUNKS, correction="dc", coeff=1000.0),
    Case("2bw", d=2, m=2, w=2, iters=6, correction="ef", flags=DISTOPT),
    Case("2bw", d=2, m=2, w=1, iters=6, deferred=False, correction="ef", optimizer="muon"),
    Case("2bw", d=2, m=2, w=2, iters=6, correction="ef", optimizer="muon", flags=DISTOPT),
    Case("2bw", d=2, m=4, w=1, iters=6, flags=TWO_CHUNKS, correction="ef"),
    Case("2bw", d=2, m=2, w=1, iters=7, correction="ef", tie=False, llama=True, drains=(3,),
         round_trip=True),
    Case("2bw", d=1, m=2, w=1, iters=6, correction="ef"),
    # the corrected shards all-gathered by the next forward's hooks
    Case("2bw", d=1, m=2, w=2, iters=6, correction="ef",
         flags=DISTOPT + ("--overlap-grad-reduce", "--overlap-param-gather")),
]
CASES = MUON_CASES + CORRECTION_CASES


def _plain(case: Case) -> Case:
    """The same run without what this module tests: Adam for Muon, no correction."""
    return replace(case, optimizer="adam") if case.correction == "none" else \
        replace(case, correction="none")


def _reference_jobs() -> dict:
    jobs = {}
    for case in CASES:
        jobs[case.reference()] = reference_job(case, case.rule)
        plain = _plain(case)
        jobs[plain.reference()] = reference_job(plain, plain.rule)
    return jobs


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launch:
    return launch_worker(tmp_path_factory.mktemp("optimizers_exact"), _reference_jobs(),
                         groups_by_world(CASES), timeout_s=480)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_run_matches_its_reference(launch, case):
    """Weights within 1e-6 of the reference of the run's rule, optimizer and correction, and
    away from the same run without the Muon or the correction; losses as the reference's."""
    launch.finished(f"world{case.world}")
    if case.schedule == "2bw" and case.d > 1:
        modes = {torch.load(path)["step_mode"] for path in (launch.out / case.name).glob("*.pt")}
        assert modes == ({"deferred"} if case.deferred else
                         {"at the loop's optimizer.step() (--no-deferred-step)"}), modes
    weights, losses = _gather(launch.out, case)
    ref = _reference(launch.out, case.reference())
    error = relative_error(weights, ref["weights"])
    assert error <= TOLERANCE, (f"{case.name}: relative error {error:.3g} > {TOLERANCE} against "
                                f"{case.reference()}; {_worst_tensor(weights, ref['weights'])}")
    plain = _plain(case)
    distance = relative_error(weights, _reference(launch.out, plain.reference())["weights"])
    assert distance > (CHANGED if case.correction != "none" else DISTINCT), \
        f"{case.name}: only {distance:.3g} from {plain.reference()}"
    for replica, seen in losses.items():
        expected = [batch[replica] for batch in ref["losses"]]
        assert max(abs(a - b) for a, b in zip(seen, expected)) < 1e-5, \
            f"{case.name}: replica {replica} losses {seen}, reference {expected}"
    print(f"\n{case.name}: relative error {error:.2e}, {distance:.2e} from {plain.reference()}")
