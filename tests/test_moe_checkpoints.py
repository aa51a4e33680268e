"""MoE checkpoints: resumed exactly, resharded across expert-parallel sizes, keyed as
megatron-core keys them, with 2BW's older version of every expert.

Four spawned processes (PP = 2 x EP = 2) train a Llama-style MoE GPT; a run resumed from the
iteration-2 checkpoint alone must log the uninterrupted run's losses (1e-6 relative) under 2bw
(also with Muon and ef) and zb-v, and across EP = 2 / EP = 1 resharding (1e-5). The checkpoints
hold megatron-core's expert keys, and 2bw's the older version under ``twobw_older.``. Reference:
the uninterrupted run. The cases: docs/testing.md, "What each test module checks",
test_moe_checkpoints.py; the story: docs/moe.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import dist as launch

SAVED_AT = 2
WORLD = 4
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall", "--swiglu", "--normalization", "RMSNorm",
       "--position-embedding-type", "rope", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "128",
       "--global-batch-size", "16"]
EP2 = ["--expert-model-parallel-size", "2"]
CASES = {  # name -> flags: saved at SAVED_AT and resumed with the same flags
    "2bw": ["--pipeline-schedule", "2bw", *EP2],
    "zb-v": ["--pipeline-schedule", "zb-v", *EP2],
    # Muon per expert matrix (the expert optimizer's momentum) and ef's last update of each
    "2bw-muon-ef": ["--pipeline-schedule", "2bw", *EP2, "--optimizer", "muon",
                    "--stale-weight-correction", "ef"],
    # Muon's state dealt out by parameter (dist_muon), the experts over their 2 data-parallel
    # ranks at EP = 1, in bf16: each rank saves what it steps, ef's U_{t-1} summed per group
    "2bw-dist-muon-ef-bf16": ["--pipeline-schedule", "2bw", "--optimizer", "dist_muon",
                              "--stale-weight-correction", "ef", "--bf16"],
}
PP1 = ["--pipeline-model-parallel-size", "1", "--pipeline-schedule", "flush"]
RESHARDED = {  # name -> (flags saving, flags resuming): the optimizer's state resharded too
    "ep2-to-ep4": ([*PP1, *EP2], [*PP1, "--expert-model-parallel-size", "4"]),
}
WEIGHTS_ONLY = {  # between EP = 1 and EP > 1 the optimizers differ: the weights reshard
    "ep2-to-ep1": (["--pipeline-schedule", "flush", *EP2], ["--pipeline-schedule", "flush"]),
    "ep1-to-ep2": (["--pipeline-schedule", "flush"], ["--pipeline-schedule", "flush", *EP2]),
}
RESHARD_RTOL = 1e-5


def _train(flags: list[str]) -> tuple[dict, float | None]:
    """tests/test_interleaved's ``_train`` on this launch's 4 processes."""
    from tests import test_interleaved

    parse = test_interleaved.parse_args
    test_interleaved.parse_args = lambda argv, world_size: parse(argv, world_size=WORLD)
    try:
        return test_interleaved._train([*MOE, *flags])
    finally:
        test_interleaved.parse_args = parse


def _keys(path: Path) -> list[str]:
    from megatron.core import dist_checkpointing

    return sorted(dist_checkpointing.load_tensors_metadata(str(path)))


def _worker(rank: int, world: int, out: str) -> dict:
    from megatron_2bw.training.checkpointing import checkpoint_dir
    from tests.test_interleaved import train_saving

    out, runs = Path(out), {}
    for name, flags in CASES.items():
        full, saved, start = train_saving(rank, flags, out / name, SAVED_AT, _train)
        runs[name] = (full, _train([*flags, "--load", str(start)]))
        runs[f"{name}-keys"] = _keys(Path(checkpoint_dir(str(saved), SAVED_AT)))
    for name, (saving, resuming) in {**RESHARDED, **WEIGHTS_ONLY}.items():
        full, saved, start = train_saving(rank, saving, out / name, SAVED_AT, _train)
        runs[f"{name}-keys"] = _keys(Path(checkpoint_dir(str(saved), SAVED_AT)))
        if name in RESHARDED:
            runs[name] = (full, _train([*resuming, "--load", str(start)]))
            continue
        runs[f"{name}-refused"] = _refusal([*resuming, "--load", str(start)])
        runs[name] = (full, _train([*resuming, "--load", str(start), "--no-load-optim"]))
    return runs


def _refusal(flags: list[str]) -> str:
    """The one line a refused --load raises (the model-parallel groups torn down after it)."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.errors import CheckpointRefused
    from megatron_2bw.schedules import executor

    try:
        _train(flags)
    except CheckpointRefused as error:
        return str(error)
    finally:
        ps.destroy_model_parallel()
        executor.reset_runners()
    return "not refused"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_checkpoints")
    ranks = launch.spawn(_worker, WORLD, str(root), out_dir=root / "results", timeout=500)
    merged = {}
    for name in ranks[0]:
        if name.endswith(("-keys", "-refused")):
            merged[name] = ranks[0][name]
            continue
        # the losses are on the last pipeline stage's ranks (rank 0's under the V)
        merged[name] = next(tuple(r[name]) for r in reversed(ranks) if r[name][0][1] is not None)
    return merged


def _same(actual: dict, expected: dict, iterations, rtol: float) -> None:
    assert sorted(actual) == list(iterations), (actual, expected)
    for i in iterations:
        assert abs(actual[i] - expected[i]) <= rtol * abs(expected[i]), \
            f"iteration {i}: {actual[i]!r}, expected {expected[i]!r}"


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_moe_run_logs_the_uninterrupted_losses(runs, case):
    (full, full_valid), (resumed, resumed_valid) = runs[case]
    assert sorted(full) == [1, 2, 3, 4] and full_valid is not None
    _same(resumed, full, [SAVED_AT + 1, 4], 1e-6)
    _same({4: resumed_valid}, {4: full_valid}, [4], 1e-6)


@pytest.mark.parametrize("case", list(RESHARDED))
def test_an_moe_checkpoint_resumes_at_another_expert_parallel_size(runs, case):
    """EP = 2 (2 experts a rank) saved, EP = 4 (1 a rank) resumed, model and optimizer state
    resharded by dist_checkpointing: the uninterrupted run's losses."""
    (full, full_valid), (resumed, resumed_valid) = runs[case]
    _same(resumed, full, [SAVED_AT + 1, 4], RESHARD_RTOL)
    _same({4: resumed_valid}, {4: full_valid}, [4], RESHARD_RTOL)


@pytest.mark.parametrize("case", list(WEIGHTS_ONLY))
def test_an_moe_checkpoint_gives_its_weights_between_ep1_and_ep2(runs, case):
    """With its optimizer state the load is refused in one line naming --no-load-optim; with
    --no-load-optim the weights reshard: iteration 3, which reads the saved weights before any
    step, logs the uninterrupted run's loss (iteration 4 differs: Adam starts afresh)."""
    refusal = runs[f"{case}-refused"]
    assert refusal.startswith("--load: ") and "--no-load-optim" in refusal, refusal
    assert "\n" not in refusal and "expert-parallel size" in refusal, refusal
    (full, _), (resumed, _) = runs[case]
    _same({3: resumed[3]}, {3: full[3]}, [3], RESHARD_RTOL)
    assert abs(resumed[4] - full[4]) > RESHARD_RTOL * abs(full[4]), (resumed, full)


def test_expert_keys_are_megatron_cores_at_every_expert_parallel_size(runs):
    """One key per layer's expert fc1/fc2 (megatron-core's SequentialMLP sharded state: the
    experts along an axis of one global tensor), the same set whatever EP saved it; 2bw's
    checkpoint holds each again as the older version."""
    experts = {name: [k for k in runs[f"{name}-keys"] if ".experts." in k]
               for name in ("ep2-to-ep1", "ep1-to-ep2", "2bw")}
    def model_keys(keys: list[str]) -> list[str]:
        return [k for k in keys if not k.startswith("optimizer.")]

    assert model_keys(experts["ep2-to-ep1"]) == model_keys(experts["ep1-to-ep2"]), experts
    plain = [k for k in model_keys(experts["ep2-to-ep1"]) if not k.startswith("twobw_")]
    assert any("mlp.experts.experts.linear_fc1" in k for k in plain), plain
    assert any("mlp.experts.experts.linear_fc2" in k for k in plain), plain
    older = {k.removeprefix("twobw_older.") for k in experts["2bw"] if
             k.startswith("twobw_older.")}
    assert set(plain) <= older, sorted(set(plain) - older)
    router = [k for k in runs["2bw-keys"] if "router.weight" in k]
    assert any(k.startswith("twobw_older.") for k in router), router
