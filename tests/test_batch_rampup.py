"""Sample-based training and batch-size ramp-up (--train-samples, --rampup-batch-size,
--lr-warmup-samples / --lr-decay-samples), against references written here and in
tests/reference.py.

Checks Megatron-LM's ``validate_args`` flag rules and megatron-core's ramp-up divisibility (each
bad command line beside a repaired twin), that PP=2 flush and 2bw runs through a mid-ramp
checkpoint log the single-process reference's loss at every iteration with the ramp's batch
sizes and consumed samples, and that the learning rate follows the warm-up and decay in consumed
samples. Guards: a ramp changes the batch, never the update rule. The grid, the ramp formula and
the tolerance: docs/testing.md, "What each test module checks", test_batch_rampup.py.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_2bw.arguments import FlagError, parse_args
from megatron_2bw.logparse import parse_log
from megatron_2bw.runtime.ports import free_port
from tests import dist as launch
from tests.reference import MODEL

MICRO, GLOBAL, START, INCREMENT, RAMPUP, TRAIN_SAMPLES = 2, 8, 4, 2, 16, 36
LR, MIN_LR, WARMUP_SAMPLES, DECAY_SAMPLES = 1e-3, 1e-4, 8, 32
ADAM_EPS = 1e-6  # as tests/test_schedules_exact.py (gradient noise near zero, see there)
LOSS_RTOL = 2e-6
STOP_AT = 3  # the 2bw run stops (with a checkpoint) after this iteration, mid-ramp


def ramp_batch(consumed: int) -> int:
    """The global batch after `consumed` samples (the module docstring's formula)."""
    if consumed > RAMPUP:
        return GLOBAL
    samples_per_increment = RAMPUP / ((GLOBAL - START) // INCREMENT)
    return START + int(consumed / samples_per_increment) * INCREMENT


def ramp_schedule() -> list[tuple[int, int]]:
    """(batch size, consumed samples before it) of every iteration: Megatron-LM's
    update_train_iters (training.py) counts the ramp's batches while consumed <= RAMPUP, then
    whole global batches up to --train-samples."""
    schedule, consumed = [], 0
    while consumed <= RAMPUP and consumed <= TRAIN_SAMPLES:
        schedule.append((ramp_batch(consumed), consumed))
        consumed += ramp_batch(consumed)
    while consumed + GLOBAL <= TRAIN_SAMPLES:
        schedule.append((GLOBAL, consumed))
        consumed += GLOBAL
    return schedule


def lr_at(samples: int) -> float:
    """megatron-core's OptimizerParamScheduler.get_lr, linear style, written out: from 0 up to
    LR over WARMUP_SAMPLES, then down to MIN_LR at DECAY_SAMPLES, MIN_LR after."""
    if samples <= WARMUP_SAMPLES:
        return LR * samples / WARMUP_SAMPLES
    if samples > DECAY_SAMPLES:
        return MIN_LR
    return MIN_LR + (LR - MIN_LR) * (1 - (samples - WARMUP_SAMPLES) /
                                     (DECAY_SAMPLES - WARMUP_SAMPLES))


# ---- (a) flag rules -----------------------------------------------------------------------

BASE = ["--mock-data", "--cpu", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
        "--lr", "1e-3", "--micro-batch-size", "2",
        "--global-batch-size", "8"]
RAMP = ["--rampup-batch-size", "4", "2", "16"]
PP2_2BW = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]

FLAG_CASES = {
    # id: (bad flags, repaired flags, world size, flag named, fragments of the message)
    "no-training-length": ([], ["--train-iters", "3"], 1, "--train-iters", ["one of"]),
    "iters-and-samples": (["--train-iters", "3", "--train-samples", "24"],
                          ["--train-samples", "24"], 1, "--train-samples", ["exclusive"]),
    "warmup-samples-with-iters": (["--train-iters", "3", "--lr-warmup-samples", "8"],
                                  ["--train-iters", "3", "--lr-warmup-iters", "1"], 1,
                                  "--lr-warmup-samples", ["--train-iters"]),
    "decay-samples-with-iters": (["--train-iters", "3", "--lr-decay-samples", "8"],
                                 ["--train-iters", "3", "--lr-decay-iters", "1"], 1,
                                 "--lr-decay-samples", ["--train-iters"]),
    "decay-iters-with-samples": (["--train-samples", "24", "--lr-decay-iters", "3"],
                                 ["--train-samples", "24", "--lr-decay-samples", "24"], 1,
                                 "--lr-decay-iters", ["--train-samples"]),
    "warmup-iters-with-samples": (["--train-samples", "24", "--lr-warmup-iters", "1"],
                                  ["--train-samples", "24", "--lr-warmup-fraction", "0.1"], 1,
                                  "--lr-warmup-iters", ["--train-samples"]),
    "wsd-iters-with-samples": (["--train-samples", "24", "--lr-decay-style", "WSD",
                                "--lr-wsd-decay-iters", "1"],
                               ["--train-samples", "24", "--lr-decay-style", "WSD",
                                "--lr-wsd-decay-samples", "8"], 1,
                               "--lr-wsd-decay-iters", ["--train-samples"]),
    "wsd-without-annealing-length": (["--train-iters", "3", "--lr-decay-style", "WSD"],
                                     ["--train-iters", "3", "--lr-decay-style", "WSD",
                                      "--lr-wsd-decay-iters", "1"], 1,
                                     "--lr-wsd-decay-iters", ["required"]),
    "fraction-and-warmup-samples": (["--train-samples", "24", "--lr-warmup-fraction", "0.1",
                                     "--lr-warmup-samples", "8"],
                                    ["--train-samples", "24", "--lr-warmup-samples", "8"], 1,
                                    "--lr-warmup-fraction", ["--lr-warmup-samples"]),
    "rampup-with-iters": (["--train-iters", "3", *RAMP], ["--train-samples", "36", *RAMP], 1,
                          "--rampup-batch-size", ["--train-samples"]),
    "rampup-start-not-divisible": (["--train-samples", "36", "--rampup-batch-size", "3", "1",
                                    "16"], ["--train-samples", "36", *RAMP], 1,
                                   "--rampup-batch-size",
                                   ["START 3", "micro batch (2)", "data-parallel size (1) = 2"]),
    "rampup-increment-not-divisible": (["--train-samples", "36", "--micro-batch-size", "1",
                                        "--global-batch-size", "8", "--rampup-batch-size", "2",
                                        "3", "16"],
                                       ["--train-samples", "36", "--micro-batch-size", "1",
                                        "--global-batch-size", "8", "--rampup-batch-size", "2",
                                        "2", "16"], 2, "--rampup-batch-size",
                                       ["INCREMENT 3", "micro batch (1)",
                                        "data-parallel size (2) = 2"]),
    "rampup-steps-miss-the-global-batch": (["--train-samples", "36", "--rampup-batch-size", "2",
                                            "4", "16"], ["--train-samples", "36", *RAMP], 1,
                                           "--rampup-batch-size", ["8 - START 2 = 6",
                                                                   "INCREMENT 4"]),
    "rampup-start-not-below-global": (["--train-samples", "36", "--rampup-batch-size", "8", "2",
                                       "16"], ["--train-samples", "36", *RAMP], 1,
                                      "--rampup-batch-size", ["START 8", "below"]),
    "rampup-2bw-first-batch-below-depth": (["--train-samples", "36", *PP2_2BW,
                                            "--rampup-batch-size", "2", "2", "16"],
                                           ["--train-samples", "36", *PP2_2BW, *RAMP], 2,
                                           "--rampup-batch-size",
                                           ["START 2 / (2 x 1) = 1", "pipeline depth 2",
                                            "at least 4"]),
}


@pytest.mark.parametrize("case", FLAG_CASES, ids=list(FLAG_CASES))
def test_flag_rules(case):
    bad, repaired, world, flag, fragments = FLAG_CASES[case]
    parse_args([*BASE, *repaired], world_size=world)  # the repaired twin is valid
    with pytest.raises(FlagError) as error:
        parse_args([*BASE, *bad], world_size=world)
    assert error.value.flag == flag, str(error.value)
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


def test_train_samples_set_the_iterations_as_megatron_lm():
    """--train-samples without ramp-up: whole global batches (a partial last one dropped);
    with it: the ramp's batches, then whole global batches; the decay length defaults to
    --train-samples; the dataset is asked for --train-samples training samples."""
    from megatron_2bw.entry import _sample_counts

    args = parse_args([*BASE, "--train-samples", "30"], world_size=1)
    assert (args.train_iters, args.lr_decay_samples) == (30 // 8, 30)
    assert _sample_counts(args)[0] == 30
    args = parse_args([*BASE, "--train-samples", str(TRAIN_SAMPLES), *RAMP], world_size=1)
    assert args.train_iters == len(ramp_schedule()) == 6
    assert _sample_counts(parse_args([*BASE, "--train-iters", "5"], world_size=1))[0] == 5 * 8


# ---- (b), (c) runs ------------------------------------------------------------------------

def _flags(schedule: str) -> list[str]:
    m = MODEL
    return [str(f) for f in [
        "--cpu", "--mock-data", "--num-layers", m.num_layers, "--hidden-size", m.hidden_size,
        "--num-attention-heads", m.num_attention_heads, "--seq-length", m.seq_length,
        "--max-position-embeddings", m.seq_length, "--vocab-size", m.vocab_size,
        "--hidden-dropout", 0, "--attention-dropout", 0, "--init-method-std", m.init_method_std,
        "--micro-batch-size", MICRO, "--global-batch-size", GLOBAL,
        "--rampup-batch-size", START, INCREMENT, RAMPUP, "--train-samples", TRAIN_SAMPLES,
        "--optimizer", "adam", "--lr", LR, "--min-lr", MIN_LR, "--lr-decay-style", "linear",
        "--lr-warmup-samples", WARMUP_SAMPLES, "--lr-decay-samples", DECAY_SAMPLES,
        "--weight-decay", m.weight_decay, "--clip-grad", m.clip_grad,
        "--adam-beta1", m.adam_beta1, "--adam-beta2", m.adam_beta2, "--adam-eps", ADAM_EPS,
        "--seed", m.seed, "--pipeline-model-parallel-size", 2, "--pipeline-schedule", schedule,
        "--eval-iters", 0, "--log-interval", 1, "--distributed-timeout-minutes", 1]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The references (2bw and sync rules), a flush run, and a 2bw run stopped after
    STOP_AT iterations with a checkpoint and resumed from it."""
    root = tmp_path_factory.mktemp("rampup")
    schedule = ramp_schedule()
    job = {"replicas": 1, "microbatches": [size // MICRO for size, _ in schedule],
           "iterations": len(schedule), "tie": True, "model": {"adam_eps": ADAM_EPS},
           "lrs": [lr_at(consumed) for _, consumed in schedule]}  # step t: lr before it
    spec = {"init": str(root / "init.pt"), "out": str(root), "port": free_port(),
            "reference": {"2bw": {"rule": "2bw", **job}, "sync": {"rule": "sync", **job}}}
    (root / "spec.json").write_text(json.dumps(spec))
    reference = launch.python(["tests/reference.py", str(root / "spec.json")], timeout=120)
    assert reference.returncode == 0, reference.tail()
    worker = ["tests/rampup_worker.py", spec["init"]]
    save = ["--save", str(root / "ckpt"), "--exit-interval", str(STOP_AT)]
    with ThreadPoolExecutor(2) as pool:  # two launches at once: their start-up overlaps
        started = {"flush": pool.submit(launch.torchrun, [*worker, *_flags("flush")], nproc=2,
                                        timeout=150),
                   "2bw-stopped": pool.submit(launch.torchrun, [*worker, *_flags("2bw"), *save],
                                              nproc=2, timeout=150)}
        results = {name: future.result() for name, future in started.items()}
    results["2bw-resumed"] = launch.torchrun(
        [*worker, *_flags("2bw"), *save, "--load", str(root / "ckpt")], nproc=2, timeout=120)
    for name, result in results.items():
        assert result.returncode == 0, f"{name}:\n{result.tail(60)}"
    references = {rule: torch.load(root / f"{rule}.pt") for rule in ("2bw", "sync")}
    return results, references


def _logged(output: str) -> dict[int, tuple]:
    """iteration -> (loss, learning rate, global batch size, consumed samples)."""
    consumed = {int(i): int(c) for i, c in re.findall(
        r"iteration +(\d+)/ *\d+ \| consumed samples: +(\d+) \|", output)}
    return {r.iteration: (r.loss, r.learning_rate, r.global_batch_size, consumed[r.iteration])
            for r in parse_log(output).iterations}


def _reference_losses(reference: dict) -> dict[int, float]:
    return {t + 1: losses[0] for t, losses in enumerate(reference["losses"])}


def test_flush_losses_equal_the_synchronous_reference(runs):
    results, references = runs
    logged = _logged(results["flush"].output)
    expected = _reference_losses(references["sync"])
    assert sorted(logged) == sorted(expected) == list(range(1, 7))
    for iteration, loss in expected.items():
        assert logged[iteration][0] == pytest.approx(loss, rel=LOSS_RTOL), iteration


def test_2bw_resumed_mid_ramp_equals_the_2bw_reference(runs):
    """Iterations 1..3 (m = 2, 2, 3; the loop drains before each change of m) and, resumed
    from the checkpoint at 14 consumed samples, 4..6 (m = 3, 4, 4) equal the 1-stale rule's
    reference; the synchronous rule's losses lie far away after the first updates."""
    results, references = runs
    stopped, resumed = (_logged(results[name].output) for name in ("2bw-stopped",
                                                                    "2bw-resumed"))
    assert sorted(stopped) == [1, 2, 3] and sorted(resumed) == [4, 5, 6]
    assert f"stopping at iteration {STOP_AT}" in results["2bw-stopped"].output
    assert "resumed from" in results["2bw-resumed"].output
    logged = {**stopped, **resumed}
    expected, sync = (_reference_losses(references[rule]) for rule in ("2bw", "sync"))
    for iteration, loss in expected.items():
        assert logged[iteration][0] == pytest.approx(loss, rel=LOSS_RTOL), iteration
    assert max(abs(expected[t] - sync[t]) / sync[t] for t in (5, 6)) > 20 * LOSS_RTOL


@pytest.mark.parametrize("name", ["flush", "2bw-stopped", "2bw-resumed"])
def test_logged_batch_sizes_and_consumed_samples_follow_the_ramp(runs, name):
    results, _ = runs
    logged = _logged(results[name].output)
    for iteration, (size, consumed_before) in enumerate(ramp_schedule(), start=1):
        if iteration in logged:
            _, _, logged_size, logged_consumed = logged[iteration]
            assert (logged_size, logged_consumed) == (size, consumed_before + size), iteration
    assert re.search(r"iteration +\d+/ +6 \|", results[name].output), results[name].tail()


@pytest.mark.parametrize("name", ["flush", "2bw-stopped", "2bw-resumed"])
def test_learning_rates_follow_warmup_and_decay_in_samples(runs, name):
    """The line of iteration t shows the rate after t's scheduler step, at the samples
    consumed by then (Megatron-LM's training_log)."""
    results, _ = runs
    for iteration, (_, lr, _, consumed) in _logged(results[name].output).items():
        assert lr == pytest.approx(lr_at(consumed), rel=1e-6, abs=1e-12), iteration
