"""Our checkpoints hold Megatron-LM's state, and a checkpoint in Megatron-LM's layout resumes here.

References are copied from Megatron-LM at tag core_v0.16.1, not from our code: the common state
and RNG state keys of ``generate_state_dict`` / ``get_rng_state``, the args fields
``load_checkpoint`` reads, the learning-rate scheduler's state and ``get_lr``, and the scheduler
flags' override semantics. One 2-stage run (Megatron's own schedule, no dropout) saves at
iterations 2 and 4; its losses after iteration 2 are what a resumed run must log. Guards: a
checkpoint written here reads as Megatron-LM's, and the reverse. Where each reference comes
from: docs/testing.md, "What each test module checks", test_checkpoint_format.py.
"""

from __future__ import annotations

import argparse
import io
import math
import random
import re
import shutil

import numpy as np
import pytest
import torch

from megatron_2bw.logparse import parse_log
from tests import dist as launch

GLOBAL_BATCH = 16
TRAIN_ITERS = 4
LR, MIN_LR, WARMUP, WEIGHT_DECAY = 1e-3, 1e-4, 1, 0.01
FLAGS = ["--cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "4",
         "--global-batch-size", str(GLOBAL_BATCH),
         "--mock-data", "--eval-iters", "0", "--log-interval", "1",
         "--pipeline-schedule", "megatron",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(TRAIN_ITERS),
         "--lr-warmup-iters", str(WARMUP), "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine",
         "--weight-decay", str(WEIGHT_DECAY), "--distributed-timeout-minutes", "1"]

# megatron/training/checkpointing.py generate_state_dict + save_checkpoint: the common
# (not sharded) entries and their types
MEGATRON_COMMON_STATE = {
    "args": argparse.Namespace,
    "checkpoint_version": float,
    "iteration": int,
    "opt_param_scheduler": dict,
    "num_floating_point_operations_so_far": (int, float),
}
MEGATRON_SHARDED = ("model", "optimizer", "rng_state")
CHECKPOINT_VERSION = 3.0
# get_rng_state: rng_state = {...}; rng_state_list = [rng_state]
RNG_STATE_KEYS = {"random_rng_state": tuple, "np_rng_state": tuple,
                  "torch_rng_state": torch.Tensor, "cuda_rng_state": torch.Tensor,
                  "rng_tracker_states": dict}
# load_checkpoint: getattr(checkpoint_args, ...) for the data position and (TP, PP) check
ARGS_READ_ON_LOAD = ("consumed_train_samples", "skipped_train_samples",
                     "consumed_valid_samples", "tensor_model_parallel_size",
                     "pipeline_model_parallel_size", "world_size", "data_parallel_size")


def megatron_scheduler_state(iteration: int, lr: float = LR) -> dict:
    """OptimizerParamScheduler.state_dict() of Megatron-LM's scheduler for FLAGS after
    ``iteration`` iterations (get_optimizer_param_scheduler, train_step's increment)."""
    return {"max_lr": lr, "lr_warmup_steps": WARMUP * GLOBAL_BATCH,
            "num_steps": iteration * GLOBAL_BATCH, "lr_decay_style": "cosine",
            "lr_decay_steps": TRAIN_ITERS * GLOBAL_BATCH, "min_lr": MIN_LR,
            "start_wd": WEIGHT_DECAY, "end_wd": WEIGHT_DECAY, "wd_incr_style": "constant",
            "wd_incr_steps": TRAIN_ITERS * GLOBAL_BATCH}


def cosine_lr(iteration: int, max_lr: float) -> float:
    """megatron-core's get_lr after ``iteration`` steps: linear warm-up, then cosine."""
    if iteration <= WARMUP:
        return max_lr * iteration / WARMUP
    ratio = (iteration - WARMUP) / (TRAIN_ITERS - WARMUP)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1) * (max_lr - MIN_LR)


def _train(*flags: str) -> launch.Launch:
    """torchrun, 2 pipeline stages on 2 processes."""
    return launch.torchrun(["pretrain_gpt_2bw.py", *FLAGS, "--pipeline-model-parallel-size",
                            "2", *flags], 2, timeout=240)


def _train_in_one_process(*flags: str) -> launch.Launch:
    """One plain process (TP=PP=DP=1): it loads the 2-stage checkpoints resharded."""
    return launch.python(["pretrain_gpt_2bw.py", *FLAGS, *flags], timeout=240)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The uninterrupted run: checkpoints at iterations 2 and 4, its parsed log."""
    root = tmp_path_factory.mktemp("format") / "checkpoints"
    result = _train("--lr", str(LR), "--save", str(root), "--save-interval", "2")
    assert result.returncode == 0, result.tail()
    return root, parse_log(result.output)


def _read_rng_objects(path) -> dict:
    """The 'rng_state' ShardedObjects of a torch_dist checkpoint, read with torch's own reader
    (megatron-core's torch_dist strategy stores each object's data in a one-element list)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(str(path))
    keys = [k for k in reader.read_metadata().state_dict_metadata if k.startswith("rng_state/")]
    objects = {k: io.BytesIO() for k in keys}
    load(objects, storage_reader=reader, no_dist=True)
    return {k: v[0] for k, v in objects.items()}


def test_our_checkpoint_holds_megatron_lm_state(run):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    root, _ = run
    path = root / "iter_0000002"
    common = dist_checkpointing.load_common_state_dict(str(path))  # weights_only, as Megatron-LM
    for key, kind in MEGATRON_COMMON_STATE.items():
        assert isinstance(common.get(key), kind), (key, type(common.get(key)))
    assert common["checkpoint_version"] == CHECKPOINT_VERSION
    assert common["iteration"] == 2
    assert common["opt_param_scheduler"] == megatron_scheduler_state(2)
    assert common["num_floating_point_operations_so_far"] > 0
    saved_args = common["args"]
    for name in ARGS_READ_ON_LOAD:
        assert hasattr(saved_args, name), name
    assert (saved_args.consumed_train_samples, saved_args.consumed_valid_samples) == (32, 0)
    assert (saved_args.tensor_model_parallel_size, saved_args.pipeline_model_parallel_size,
            saved_args.data_parallel_size, saved_args.world_size) == (1, 2, 1, 2)
    assert common["layout"] == {"tensor": 1, "pipeline": 2, "data": 1, "expert": 1}  # ours
    assert common["rng_device"] == "cpu"  # ours: the "cuda" RNG states are the CPU generator's

    sharded = load_sharded_metadata(str(path))
    tensors = {k for k, v in sharded.items() if isinstance(v, ShardedTensor)}
    model = {k for k in tensors if not k.startswith("optimizer.")}
    # one model: the first stage's embedding, the last stage's final norm, and each layer
    # weight stacked over both stages' layers (megatron-core's global layer dimension)
    assert {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
            "decoder.layers.mlp.linear_fc1.weight"} <= model, sorted(model)
    assert sharded["decoder.layers.mlp.linear_fc1.weight"].global_shape[0] == 2
    assert tensors - model == {f"optimizer.state.{moment}.{k}" for k in model
                               for moment in ("exp_avg", "exp_avg_sq")}
    rng = [v for v in sharded.values() if isinstance(v, ShardedObject) and v.key == "rng_state"]
    assert sorted(v.global_offset for v in rng) == [(0, 0), (1, 0)], rng  # (PP rank, TP rank)
    assert all(v.global_shape == (2, 1) for v in rng), rng  # (PP size, TP size)
    for states in _read_rng_objects(path).values():
        assert isinstance(states, list) and len(states) == 1, states
        assert {k: type(v) for k, v in states[0].items()}.keys() == RNG_STATE_KEYS.keys()
        for key, kind in RNG_STATE_KEYS.items():
            assert isinstance(states[0][key], kind), key


def _as_megatron_lm_wrote_it(source, target) -> None:
    """``source`` with the common state Megatron-LM's save_checkpoint writes and nothing of
    ours: its keys only (no "layout"), args holding only Megatron-LM fields, the scheduler as
    Megatron-LM counts it; the sharded files (model, optimizer, rng_state) as they are."""
    shutil.copytree(source, target)
    common = torch.load(target / "common.pt", weights_only=False)
    ours = common["args"]
    megatron_args = argparse.Namespace(
        consumed_train_samples=ours.consumed_train_samples, skipped_train_samples=0,
        consumed_valid_samples=0, tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
        data_parallel_size=1, world_size=2, num_layers=2, hidden_size=32, num_attention_heads=4,
        global_batch_size=GLOBAL_BATCH, ckpt_format="torch_dist", no_save_rng=None,
        no_save_optim=None)
    rewritten = {"args": megatron_args, "checkpoint_version": CHECKPOINT_VERSION,
                 "iteration": common["iteration"],
                 "optimizer": common["optimizer"],  # the optimizer's non-tensor part
                 "opt_param_scheduler": megatron_scheduler_state(common["iteration"]),
                 "num_floating_point_operations_so_far": 1.0e9,
                 "content_metadata": common["content_metadata"]}
    torch.save(rewritten, target / "common.pt")
    (target.parent / "latest_checkpointed_iteration.txt").write_text(str(common["iteration"]))


def test_a_megatron_lm_checkpoint_resumes_where_it_stopped(run, tmp_path):
    root, reference = run
    load = tmp_path / "megatron-lm"
    _as_megatron_lm_wrote_it(root / "iter_0000002", load / "iter_0000002")
    result = _train("--lr", str(LR), "--load", str(load))
    assert result.returncode == 0, result.tail()
    assert f"resumed from {load} at iteration 2" in result.output
    assert "was saved with" not in result.output, result.tail()  # same layout, read from args
    resumed = {r.iteration: r for r in parse_log(result.output).iterations}
    expected = {r.iteration: r for r in reference.iterations}
    assert sorted(resumed) == [3, 4], result.tail()
    for i in (3, 4):
        assert resumed[i].loss == pytest.approx(expected[i].loss, rel=1e-6), i
        assert resumed[i].learning_rate == pytest.approx(cosine_lr(i, LR), rel=1e-6), i
    assert re.search(r"iteration +3/ +4 \| consumed samples: +48 \|", result.output), \
        result.tail()


def test_a_schedule_that_differs_from_the_flags_is_one_line(run):
    root, _ = run
    result = _train_in_one_process("--lr", "2e-3", "--load", str(root))
    assert result.returncode == 2, result.tail()
    errors = set(re.findall(r"^error: .*$", result.output, re.MULTILINE))
    assert errors == {f"error: --load: {root}/iter_0000004 holds another learning-rate schedule "
                      f"than the flags: --lr 0.002 (checkpoint: 0.001); pass "
                      f"--override-opt_param-scheduler to use the flags or "
                      f"--use-checkpoint-opt_param-scheduler to use the checkpoint's"}, \
        result.tail()
    assert "Traceback" not in result.output, result.tail()


def test_override_takes_the_schedule_from_the_flags(run, tmp_path):
    root, reference = run
    load = tmp_path / "checkpoints"
    shutil.copytree(root / "iter_0000002", load / "iter_0000002")
    (load / "latest_checkpointed_iteration.txt").write_text("2")
    result = _train_in_one_process("--lr", "2e-3", "--load", str(load),
                                   "--override-opt_param-scheduler")
    assert result.returncode == 0, result.tail()
    logged = {r.iteration: r.learning_rate for r in parse_log(result.output).iterations}
    for i in (3, 4):
        assert logged[i] == pytest.approx(cosine_lr(i, 2e-3), rel=1e-6), (i, logged)
    assert logged[3] != pytest.approx(cosine_lr(3, LR), rel=1e-2)


# ---- RNG states of another kind of device, in one process --------------------------------------

def _philox_state(seed: int, offset: int) -> torch.Tensor:
    """A CUDA generator's state as ``torch.cuda.get_rng_state`` returns it: torch's Philox
    generator, its seed and offset as two 8-byte little-endian integers (16 bytes)."""
    return torch.tensor(list(seed.to_bytes(8, "little") + offset.to_bytes(8, "little")),
                        dtype=torch.uint8)


def _rng_list(device_state: torch.Tensor) -> list:
    """Megatron-LM's ``get_rng_state`` entry for one rank whose device generator state (and the
    tracker's, megatron-core's "model-parallel-rng") is ``device_state``; the CPU generators
    drawn from seed 1."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": device_state,
             "rng_tracker_states": {"model-parallel-rng": device_state.clone()}}]


@pytest.mark.parametrize("written_on, device_state, resumed_on", [
    ("cuda", _philox_state(1234, 8), "cpu"),  # Megatron-LM's or ours, from a GPU
    ("cpu", torch.Generator().manual_seed(5).get_state(), "cuda"),  # a CPU run's, on a GPU
])
def test_rng_states_of_another_device_kind_restore_the_cpu_generators(
        monkeypatch, written_on, device_state, resumed_on):
    """A checkpoint's "cuda_rng_state" and tracker states are its device generator's: a GPU's
    (16 bytes) is no CPU generator state and a CPU run's (5056 bytes) no CUDA one, and
    ``set_rng_state`` rejects either on the other kind (the checkpoint would be reported
    unreadable). Across kinds the python, numpy and torch CPU generators are restored, the
    device generator and the tracker keep their state (never set), one warning says so."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_2bw.training import checkpointing

    saved = _rng_list(device_state)
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    tracker_before = dict(get_cuda_rng_tracker().get_states())

    def never(*_args, **_kwargs):
        raise AssertionError(f"a {written_on} generator state was set on {resumed_on}")

    monkeypatch.setattr(torch.cuda, "set_rng_state", never)
    monkeypatch.setattr(get_cuda_rng_tracker(), "set_states", never)
    warnings = []
    checkpointing._set_rng_state(saved, resumed_on, None, "ckpt/iter_0000002", warnings.append)
    assert random.getstate() == saved[0]["random_rng_state"]
    assert (np.random.get_state()[1] == saved[0]["np_rng_state"][1]).all()
    assert torch.equal(torch.get_rng_state(), saved[0]["torch_rng_state"])
    assert get_cuda_rng_tracker().get_states().keys() == tracker_before.keys()
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        f" warning: ckpt/iter_0000002 holds device RNG states of a {written_on.upper()} run, "
        f"this run is on {resumed_on.upper()}: the CPU generators (python, numpy, torch) are "
        f"restored; the {resumed_on.upper()} generator"), warnings[0]
    assert "--no-load-rng" in warnings[0]


@pytest.mark.parametrize("saved_kind, device_kind, restored", [
    ("cpu", "cpu", True), ("cuda", "cuda", True), ("cpu", "cuda", False), ("cuda", "cpu", False)])
def test_device_rng_states_are_restored_on_their_own_kind_only(saved_kind, device_kind,
                                                               restored):
    from megatron_2bw.training import checkpointing

    assert checkpointing.restores_device_rng(saved_kind, device_kind) is restored


def test_the_device_kind_of_an_rng_state_is_told_by_its_size():
    """Checkpoints without "rng_device" (Megatron-LM's): a CPU generator state is the CPU's,
    CUDA's 16-byte Philox state the GPU's."""
    from megatron_2bw.training import checkpointing

    assert checkpointing.rng_device_of(torch.get_rng_state()) == "cpu"
    assert checkpointing.rng_device_of(_philox_state(1, 0)) == "cuda"


# ---- the scheduler flags on megatron-core's own scheduler, in one process ----------------------

def _scheduler(lr: float):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return OptimizerParamScheduler(sgd, init_lr=0.0, max_lr=lr, min_lr=MIN_LR,
                                   lr_warmup_steps=WARMUP * GLOBAL_BATCH,
                                   lr_decay_steps=TRAIN_ITERS * GLOBAL_BATCH,
                                   lr_decay_style="cosine", start_wd=WEIGHT_DECAY,
                                   end_wd=WEIGHT_DECAY, wd_incr_steps=TRAIN_ITERS * GLOBAL_BATCH,
                                   wd_incr_style="constant")


@pytest.mark.parametrize("flag, max_lr", [("--override-opt_param-scheduler", 2e-3),
                                          ("--use-checkpoint-opt_param-scheduler", LR),
                                          (None, None)])
def test_scheduler_flags_choose_the_side(flag, max_lr):
    """A checkpoint saved with --lr 1e-3 at iteration 2, loaded with --lr 2e-3: the flag decides
    which learning rate the next iterations use (without one, CheckpointError); the position
    (2 iterations) always comes from the checkpoint."""
    from megatron_2bw.arguments import parse_args
    from megatron_2bw.training import checkpointing

    args = parse_args([*FLAGS, "--lr", "2e-3", *([flag] if flag else [])], world_size=1)
    scheduler = _scheduler(2e-3)
    saved = megatron_scheduler_state(2)  # samples, the unit of ours and Megatron-LM's
    if flag is None:
        with pytest.raises(checkpointing.CheckpointError, match=r"--lr 0.002 \(checkpoint: "
                                                                r"0.001\);"):
            checkpointing._check_scheduler("ckpt", saved, scheduler, args)
        return
    checkpointing._check_scheduler("ckpt", saved, scheduler, args)
    checkpointing._load_scheduler(scheduler, saved, args)
    assert scheduler.num_steps == 2 * GLOBAL_BATCH
    scheduler.step(increment=GLOBAL_BATCH)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(cosine_lr(3, max_lr))
