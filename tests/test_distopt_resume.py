"""Resuming a --use-distributed-optimizer checkpoint on 2 CPU processes (DP=2, torch's Adam: no
Apex or transformer-engine), in megatron-core's 'dp_reshardable' form.

1. torchrun, --pipeline-schedule 2bw: an uninterrupted run of 5 iterations saves at iteration
   2; a run resumed from that checkpoint logs the losses of iterations 3..5 of the
   uninterrupted one to 1e-6. Iteration 3 reads the older weight version (2BW: batch t reads
   W(t-1), saved beside the optimizer's shards, which are views of the newest version in
   megatron-core's parameter buffer); 4 and 5 follow Adam steps taken with the loaded moments
   and step count (torch's Adam's bias corrections ``1 - beta ** step``: a step count shared by
   all parameters, megatron-core's load, is off from the first step on).
2. Spawned workers: after 3 steps, a save, and a load into a freshly built model and
   optimizer (one that has not stepped), every parameter shard's Adam state equals what the
   trained optimizer held: step 3 (the steps taken) in a tensor of its own, exp_avg,
   exp_avg_sq and the fp32 main weights bit for bit.
"""

from __future__ import annotations

import shutil

import torch

from megatron_2bw.logparse import parse_log
from tests import dist as launch
from tests.test_overlap import TINY, _build

RTOL = 1e-6
ITERS, SAVED_AT = 5, 2


def _losses(flags: list[str]) -> dict[int, float]:
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--train-iters", str(ITERS),
                              "--use-distributed-optimizer", "--eval-iters", "0",
                              "--pipeline-schedule", "2bw", *flags], 2,
                             timeout=120)
    assert result.returncode == 0, result.tail(60)
    return {r.iteration: r.loss for r in parse_log(result.output).iterations}


def _only_checkpoint(root, iteration: int, into):
    """A --load directory holding ``root``'s checkpoint of ``iteration`` alone."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(root / name, into / name)
    (into / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return into


def test_resumed_run_logs_the_uninterrupted_losses(tmp_path):
    saved = tmp_path / "saved"
    uninterrupted = _losses(["--save", str(saved), "--save-interval", str(SAVED_AT)])
    load = _only_checkpoint(saved, SAVED_AT, tmp_path / "load")
    resumed = _losses(["--load", str(load)])
    assert sorted(uninterrupted) == list(range(1, ITERS + 1))
    assert sorted(resumed) == list(range(SAVED_AT + 1, ITERS + 1)), resumed
    for i in resumed:
        assert abs(resumed[i] - uninterrupted[i]) <= RTOL * abs(uninterrupted[i]), \
            f"iteration {i}: resumed {resumed[i]!r}, uninterrupted {uninterrupted[i]!r}"


def _adam_state(optimizer) -> list[dict]:
    """Per parameter shard of this rank: its Adam state and fp32 main weights (copies)."""
    adam = optimizer.optimizer
    return [{"step_id": id(adam.state[p]["step"]), "step": float(adam.state[p]["step"]),
             "exp_avg": adam.state[p]["exp_avg"].clone(),
             "exp_avg_sq": adam.state[p]["exp_avg_sq"].clone(), "param": p.detach().clone()}
            for group in adam.param_groups for p in group["params"]]


def _resume_worker(rank: int, world: int, root: str) -> dict:
    from megatron_2bw.training.checkpointing import TrainState, load_checkpoint, save_checkpoint
    from tests.test_overlap import _train

    flags = ["--use-distributed-optimizer"]
    built = _build(world, "megatron", flags)
    args, _, model, optimizer, scheduler, _, _ = built
    _train("trained", built)
    trained = _adam_state(optimizer)
    state = TrainState(iteration=args.train_iters,
                       consumed_train_samples=args.train_iters * args.global_batch_size)
    save_checkpoint(root, model, optimizer, scheduler, state, args)

    args, _, model, optimizer, scheduler, _, _ = _build(world, "megatron", flags)
    fresh_state_entries = len(optimizer.optimizer.state)
    loaded_state = load_checkpoint(root, model, optimizer, scheduler, args)
    return {"trained": trained, "loaded": _adam_state(optimizer),
            "fresh_state_entries": fresh_state_entries, "iteration": loaded_state.iteration,
            "steps_taken": args.train_iters}


def test_loaded_adam_state_equals_the_saved_one(tmp_path):
    results = launch.spawn(_resume_worker, 2, str(tmp_path / "ckpt"), out_dir=tmp_path,
                           timeout=120)
    for r in results:
        assert r["fresh_state_entries"] == 0  # loaded into an optimizer that never stepped
        assert r["iteration"] == r["steps_taken"] == 3
        trained, loaded = r["trained"], r["loaded"]
        assert len(loaded) == len(trained) > 1
        assert len({s["step_id"] for s in loaded}) == len(loaded), "a step tensor is shared"
        for i, (want, got) in enumerate(zip(trained, loaded)):
            assert want["step"] == got["step"] == r["steps_taken"], (i, want["step"], got["step"])
            for key in ("exp_avg", "exp_avg_sq", "param"):
                assert torch.equal(got[key], want[key]), f"shard {i}: {key} differs"
