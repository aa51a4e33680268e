"""Resuming every pipeline schedule exactly, with GPT-2-style and Llama-style models.

Each case trains 4 iterations on 2 CPU processes, saving at iteration 2; a run resumed from that
checkpoint alone must log the uninterrupted run's losses of iterations 3-4 and its validation
loss, to 1e-6 relative (RESHARDED: 1e-5). The cases cover every schedule, virtual stages, the
V's, the distributed optimizer, TP, Muon, and resumes across schedules (CROSS) and layer splits
(UNEVEN_CROSS). Reference: the uninterrupted run. Guards: a checkpoint keys each layer by its
global number and holds the older weight version. The cases and the bugs they caught:
docs/testing.md, "What each test module checks", test_resume_matrix.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import dist as launch
from tests.test_interleaved import _resume_dir, _same, _train, train_saving
from tests.test_model_features import LLAMA

SAVED_AT = 2
PP1 = ["--pipeline-model-parallel-size", "1"]
LAST1 = ["--decoder-last-pipeline-num-layers", "1"]
LAYOUT_1_3 = ["--pipeline-model-parallel-layout", "E,t|t*3,L"]
EF_BF16 = ["--bf16", "--stale-weight-correction", "ef", "--muon-fp32-matmul-prec", "high"]
CASES = {  # name -> flags (after test_interleaved's TINY: PP=2, 4 iterations)
    "2bw-llama-V2": ["--pipeline-schedule", "2bw", *LLAMA,
                     "--num-virtual-stages-per-pipeline-rank", "2"],
    "2bw-llama-distopt-DP2": ["--pipeline-schedule", "2bw", *LLAMA, *PP1,
                              "--use-distributed-optimizer"],
    "2bw-llama-TP2": ["--pipeline-schedule", "2bw", *LLAMA, *PP1,
                      "--tensor-model-parallel-size", "2"],
    "pipedream-llama": ["--pipeline-schedule", "pipedream", *LLAMA],
    # PipeDream's own setting, m = 1 (an update per microbatch): stage 0 keeps 2 versions
    "pipedream-gpt-m1": ["--pipeline-schedule", "pipedream", "--global-batch-size", "2"],
    "pipemare-T2-llama": ["--pipeline-schedule", "pipemare", *LLAMA,
                          "--pipemare-discrepancy-decay", "0.9"],
    "flush-llama-V2": ["--pipeline-schedule", "flush", *LLAMA,
                       "--num-virtual-stages-per-pipeline-rank", "2"],
    "flush-gpt-distopt-DP2": ["--pipeline-schedule", "flush", *PP1,
                              "--use-distributed-optimizer"],
    "zb-v-llama": ["--pipeline-schedule", "zb-v", *LLAMA],
    "dualpipev-gpt-distopt": ["--pipeline-schedule", "dualpipev",
                              "--untie-embeddings-and-output-weights",
                              "--use-distributed-optimizer"],
    # Muon (a chain of Muon and Adam, both optimizers' state) and 2bw's stale-weight
    # corrections (predict's R(newest), ef's last update, dc's W(t-1): the older version)
    "flush-llama-muon": ["--pipeline-schedule", "flush", *LLAMA, "--optimizer", "muon"],
    "2bw-gpt-muon": ["--pipeline-schedule", "2bw", "--optimizer", "muon"],
    "2bw-llama-predict": ["--pipeline-schedule", "2bw", *LLAMA,
                          "--stale-weight-correction", "predict"],
    "2bw-gpt-ef-muon": ["--pipeline-schedule", "2bw", "--optimizer", "muon",
                        "--stale-weight-correction", "ef"],
    # ef under bf16 on the fp32 master copies (its U_{t-1} in fp32)
    "2bw-gpt-ef-muon-bf16": ["--pipeline-schedule", "2bw", "--optimizer", "muon",
                             "--stale-weight-correction", "ef", "--bf16"],
    # Muon's state sharded by parameter over the replicas (dist_muon, the form
    # --use-distributed-optimizer takes with Muon), ef's U_{t-1} written by each parameter's
    # stepping replica only (Newton-Schulz in fp32: RESHARDED's sums reordered stay 1e-7 apart)
    "2bw-gpt-ef-dist-muon-bf16-DP2": ["--pipeline-schedule", "2bw", *PP1, "--optimizer", "muon",
                                      "--use-distributed-optimizer", *EF_BF16],
    # ef with the distributed optimizer: each replica writes U_{t-1} of its shards only (a
    # resumed fp32 run logged validation 6.850642 against 6.883142 before a save summed them);
    # under bf16 on the shards of the fp32 masters, as without sharding (SHARDED_LIKE_WHOLE)
    "2bw-gpt-ef-distopt-DP2": ["--pipeline-schedule", "2bw", *PP1, "--use-distributed-optimizer",
                               "--stale-weight-correction", "ef"],
    "2bw-gpt-ef-distopt-bf16-DP2": ["--pipeline-schedule", "2bw", *PP1, "--bf16",
                                    "--use-distributed-optimizer", "--stale-weight-correction",
                                    "ef"],
    "2bw-gpt-ef-bf16-DP2": ["--pipeline-schedule", "2bw", *PP1, "--bf16",
                            "--stale-weight-correction", "ef"],
    # predict under bf16 from the fp32 masters (R(newest) in bf16 in the checkpoint); with the
    # distributed optimizer each replica makes R on its shards and the replicas sum them
    "2bw-gpt-predict-distopt-bf16-DP2": ["--pipeline-schedule", "2bw", *PP1, "--bf16",
                                         "--use-distributed-optimizer",
                                         "--stale-weight-correction", "predict"],
    "2bw-gpt-predict-bf16-DP2": ["--pipeline-schedule", "2bw", *PP1, "--bf16",
                                 "--stale-weight-correction", "predict"],
    # predict under bf16 with a Llama-style model on two virtual stages per rank (R per chunk)
    "2bw-llama-V2-predict-bf16": ["--pipeline-schedule", "2bw", *LLAMA, "--bf16",
                                  "--num-virtual-stages-per-pipeline-rank", "2",
                                  "--stale-weight-correction", "predict"],
    # dc at PP=2, DP=1 keeps W(t-2) too, which its checkpoint does not hold (resuming it
    # stopped at its first iteration with an IndexError)
    "2bw-gpt-dc": ["--pipeline-schedule", "2bw", "--stale-weight-correction", "dc",
                   "--stale-weight-correction-coeff", "1000"],
    # under bf16 dc keeps the fp32 masters' W(t-1) itself: the checkpoint holds it
    "2bw-gpt-dc-bf16": ["--pipeline-schedule", "2bw", "--stale-weight-correction", "dc",
                        "--stale-weight-correction-coeff", "1000", "--bf16"],
    "2bw-gpt-dc-distopt-DP2": ["--pipeline-schedule", "2bw", *PP1, "--use-distributed-optimizer",
                               "--stale-weight-correction", "dc",
                               "--stale-weight-correction-coeff", "1000"],
    # uneven splits (layers 3|1 and 1|3) and the even one, under flush and 2bw: UNEVEN_CROSS
    "flush-gpt": ["--pipeline-schedule", "flush"],
    "flush-gpt-3|1": ["--pipeline-schedule", "flush", *LAST1],
    "2bw-gpt": ["--pipeline-schedule", "2bw"],
    "2bw-gpt-1|3": ["--pipeline-schedule", "2bw", *LAYOUT_1_3],
}
SWITCHED = ("2bw-gpt-ef-muon", ["--pipeline-schedule", "2bw", "--optimizer", "muon"])
"""A checkpoint of a corrected run, resumed without its correction: refused in one line."""
CROSS = {  # name -> (the case whose SAVED_AT checkpoint is loaded, the case whose flags resume
    # it, or the flags)
    "flush-V2-resumes-zb-v": ("zb-v-llama", "flush-llama-V2"),
    "zb-v-resumes-flush-V2": ("flush-llama-V2", "zb-v-llama"),
}
UNEVEN_CROSS = {  # the same, across layer splits (and pipeline sizes)
    "flush-3|1-resumes-even": ("flush-gpt", "flush-gpt-3|1"),
    "flush-even-resumes-3|1": ("flush-gpt-3|1", "flush-gpt"),
    "flush-PP1-resumes-3|1": ("flush-gpt-3|1", ["--pipeline-schedule", "flush", *PP1]),
    "2bw-1|3-resumes-even": ("2bw-gpt", "2bw-gpt-1|3"),
    "2bw-even-resumes-1|3": ("2bw-gpt-1|3", "2bw-gpt"),
    "2bw-3|1-resumes-1|3": ("2bw-gpt-1|3", ["--pipeline-schedule", "2bw", *LAST1]),
    "2bw-PP1-resumes-1|3": ("2bw-gpt-1|3", ["--pipeline-schedule", "2bw", *PP1]),
    # the V's chunks (rank 0: virtual stages 0 and 3) numbered by an uneven split
    "zb-v-1|2|1|0-resumes-zb-v": ("zb-v-llama", ["--pipeline-schedule", "zb-v", *LLAMA,
                                                 "--pipeline-model-parallel-layout",
                                                 "E,t|t*2|t|L"]),
}
CROSS.update(UNEVEN_CROSS)
RESHARDED = {  # the same, on fewer data-parallel ranks (the sums of gradients reordered)
    "dist-muon-DP1-resumes-DP2": ("2bw-gpt-ef-dist-muon-bf16-DP2",
                                  ["--pipeline-schedule", "2bw", "--optimizer", "dist_muon",
                                   *EF_BF16]),
}
RESHARDED_RTOL = 1e-5


def _matrix_worker(rank: int, world: int, out: str) -> dict:
    """Every case: the uninterrupted run (saving at SAVED_AT and at the end), then the run
    resumed from the SAVED_AT checkpoint alone; then CROSS's resumed runs. A case that fails
    (on every rank: the trainer agrees on a non-finite loss) is recorded as its error's line,
    and the next runs."""
    import torch.distributed as dist

    out, runs, uninterrupted = Path(out), {}, {}
    for name, flags in CASES.items():
        full, _, start = train_saving(rank, flags, out / _dir(name), SAVED_AT)
        uninterrupted[name] = full
        runs[name] = _with(full, _resumed(flags, start))
    for name, (saved, resumer) in {**CROSS, **RESHARDED}.items():
        flags = CASES[resumer] if isinstance(resumer, str) else resumer
        runs[name] = _with(uninterrupted[saved], _resumed(flags, out / _dir(saved) / "start"))
    runs["switched"] = _resumed(SWITCHED[1], out / _dir(SWITCHED[0]) / "start")
    runs["release"] = _from_release(rank, out / _dir(RELEASE_CASE) / "saved", out / "release")
    return runs


def _dir(case: str) -> str:
    """A case's folder (its name without the split's "|")."""
    return case.replace("|", "-")


def _resumed(flags: list[str], start: Path):
    """The run of ``flags`` resumed from ``start``, or its error's line if it raised."""
    try:
        return _train([*flags, "--load", str(start)])
    except Exception as error:  # noqa: BLE001 -- reported by the case's test
        _tear_down()
        return f"the resumed run failed: {type(error).__name__}: {error}"


def _with(full: tuple, resumed: tuple | str) -> tuple | str:
    """(the uninterrupted run, the resumed run), or the resumed run's failure."""
    return resumed if isinstance(resumed, str) else (full, resumed)


def _from_release(rank: int, saved: Path, into: Path):
    """A run of RELEASE_CASE's flags from a Megatron-LM release checkpoint holding the weights
    its uninterrupted run saved at the end."""
    import shutil

    import torch.distributed as dist

    from megatron_2bw.training.checkpointing import TRACKER_FILE, checkpoint_dir

    if rank == 0:
        into.mkdir()
        shutil.copytree(checkpoint_dir(str(saved), 4), into / "release")
        (into / TRACKER_FILE).write_text("release")
    dist.barrier()
    return _train([*CASES[RELEASE_CASE], "--load", str(into)])


def _tear_down() -> None:
    """What test_interleaved's _train does after a run, for one that raised."""
    from megatron_2bw.schedules import executor

    launch.tear_down_groups()
    executor.reset_runners()


RELEASE_CASE = "flush-gpt-distopt-DP2"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("resume_matrix")
    ranks = launch.spawn(_matrix_worker, 2, str(root), out_dir=root / "results", timeout=1200)
    return {name: _of_the_loss_ranks([rank[name] for rank in ranks], name) for name in ranks[0]}


def _of_the_loss_ranks(results: list, name: str):
    """One entry of the matrix from the two ranks' results: each run's (losses, validation
    loss) from the rank that holds them (the last pipeline stage or a replica: rank 1; rank 0
    under the V schedules), or the failure both ranks recorded."""
    if isinstance(results[1], str):
        return results[1]
    if name == "release":
        return _loss_rank_run(results)
    return tuple(_loss_rank_run(runs) for runs in zip(*results))


def _loss_rank_run(runs) -> tuple:
    return next((run for run in runs if run[1] is not None), runs[1])


@pytest.mark.parametrize("case", [*CASES, *CROSS])
def test_a_resumed_run_logs_the_uninterrupted_losses(matrix, case):
    assert not isinstance(matrix[case], str), matrix[case]
    (full, full_valid), (resumed, resumed_valid) = matrix[case]
    assert sorted(full) == [1, 2, 3, 4] and full_valid is not None, (full, full_valid)
    _same(resumed, full, [SAVED_AT + 1, 4])
    _same({4: resumed_valid}, {4: full_valid}, [4])


@pytest.mark.parametrize("case", RESHARDED)
def test_a_run_resumed_on_fewer_replicas_logs_the_uninterrupted_losses(matrix, case):
    """Saved at PP=1, DP=2 with Muon's state sharded by parameter (and ef's U_{t-1}), resumed
    at PP=2, DP=1 with the same global batch: every parameter's state found by its key."""
    assert not isinstance(matrix[case], str), matrix[case]
    (full, full_valid), (resumed, resumed_valid) = matrix[case]
    assert sorted(resumed) == [SAVED_AT + 1, 4], resumed
    for seen, expected in [(resumed[i], full[i]) for i in (SAVED_AT + 1, 4)] + [
            (resumed_valid, full_valid)]:
        assert abs(seen - expected) <= RESHARDED_RTOL * abs(expected), (resumed, full)


SHARDED_LIKE_WHOLE = [("2bw-gpt-ef-distopt-bf16-DP2", "2bw-gpt-ef-bf16-DP2"),
                      ("2bw-gpt-predict-distopt-bf16-DP2", "2bw-gpt-predict-bf16-DP2")]


@pytest.mark.parametrize("sharded_case, whole_case", SHARDED_LIKE_WHOLE)
def test_a_correction_on_the_shards_of_bf16_masters_trains_as_on_whole_masters(
        matrix, sharded_case, whole_case):
    """ef and predict under bf16 with the distributed optimizer (each replica corrects its
    shards of the fp32 masters, U_{t-1} kept per shard; predict's R made per shard and summed
    over the replicas) log the losses of the rule on whole masters (which
    tests/test_corrections.py checks against plain torch) to 1e-5: the gradients' sums are
    reordered, the arithmetic is the same."""
    sharded, whole = matrix[sharded_case], matrix[whole_case]
    assert not isinstance(sharded, str) and not isinstance(whole, str), (sharded, whole)
    (sharded_losses, sharded_valid), _ = sharded
    (whole_losses, whole_valid), _ = whole
    for seen, expected in [(sharded_losses[i], whole_losses[i]) for i in range(1, 5)] + [
            (sharded_valid, whole_valid)]:
        assert abs(seen - expected) <= RESHARDED_RTOL * abs(expected), (sharded, whole)


def test_a_checkpoint_resumed_without_its_correction_is_refused(matrix):
    """ef's checkpoint holds its last update; a run without ef would read the older version
    as 2BW's and go on differently: refused, naming both rules."""
    assert isinstance(matrix["switched"], str), matrix["switched"]
    assert "--stale-weight-correction ef" in matrix["switched"], matrix["switched"]
    assert "not none" in matrix["switched"], matrix["switched"]


def test_a_release_checkpoint_gives_the_weights_and_starts_at_iteration_zero(matrix):
    """Megatron-LM's tracker word 'release': the weights load, nothing else; training runs
    from iteration 1 on the first batches. A run from scratch logs the uninterrupted run's
    first loss to the bit (same seed, same data), so a different, lower one means the trained
    weights were read."""
    (full, _), _ = matrix[RELEASE_CASE]
    released, _ = matrix["release"]
    assert sorted(released) == [1, 2, 3, 4], released
    assert released[1] < full[1] - 1e-3, (released, full)
