"""Checkpoints with megatron-core's dist_checkpointing, in Megatron-LM's directory layout and
with Megatron-LM's state, so that either program resumes the other's checkpoints.

    {save}/iter_0000100/                 one dist_checkpointing directory per save
    {save}/latest_checkpointed_iteration.txt

A checkpoint holds Megatron-LM's keys (args, iteration, model, optimizer, opt_param_scheduler,
rng_state, ...) plus ours (layout, rng_device, a schedule's older weight version).

Invariants: a checkpoint directory is complete before the tracker file names it, and one saved
again at the same iteration replaces the old one only once complete; loading falls back from an
unreadable newest checkpoint to the newest readable one, all ranks agreeing; a checkpoint that
cannot serve the run ends the load in one line (:class:`CheckpointRefused`); a resumed run
continues exactly as an uninterrupted one would. More: docs/checkpoints_and_faults.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import shutil
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_2bw.errors import CheckpointError, CheckpointRefused

__all__ = ["TrainState", "save_checkpoint", "load_checkpoint", "latest_iteration", "model_keys",
           "checkpoint_dir", "saved_iterations", "check_paths", "CheckpointError",
           "CheckpointRefused", "RELEASE"]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # Megatron-LM's tracker word for {root}/release (weights only: iteration 0)
CHECKPOINT_VERSION = 3.0  # Megatron-LM's generate_state_dict


class _ScheduleMismatch(CheckpointRefused):
    """The flags disagree with the checkpoint's learning-rate schedule."""


@dataclass
class TrainState:
    """Where training stands; saved and restored with the weights. ``consumed_valid_samples``
    is carried over from the checkpoint (our evaluations re-read the same batches)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    num_floating_point_operations_so_far: float = 0


def checkpoint_dir(root: str, iteration: int | str) -> str:
    """``root``/iter_0000100, or ``root``/release for Megatron-LM's release checkpoint."""
    if iteration == RELEASE:
        return os.path.join(root, RELEASE)
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | str | None:
    """The iteration the tracker file names (or RELEASE), None when there is no tracker. A
    tracker holding anything else is refused, as Megatron-LM's ``read_metadata`` refuses it
    ("Invalid metadata file"): CheckpointRefused, no checkpoint is guessed instead."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as f:
        text = f.read().strip()
    if text == RELEASE:
        return RELEASE
    if not (text.isascii() and text.isdigit()):
        raise CheckpointRefused(f"--load: invalid tracker file {path}: it holds {text[:40]!r}, "
                                f"not an iteration number or '{RELEASE}' (fix it to name the "
                                "checkpoint to load, or remove it)")
    return int(text)


def _rng_state():
    """Megatron-LM's ``get_rng_state`` for torch_dist: one list of this rank's RNG states,
    sharded by (PP rank, TP rank) and replicated over data-parallel ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),  # the CPU runtime's generator on the CPU
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    shape = (ps.get_pipeline_model_parallel_world_size(),
             ps.get_tensor_model_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", [state], shape, offset,
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _set_rng_state(saved, device_kind: str, saved_kind: str | None, where: str,
                   warn: Callable[[str], None]) -> None:
    """Restore what :func:`_rng_state` saved (Megatron-LM's list, whose first entry all
    data-parallel ranks share, or the dict of checkpoints from before it) on a process that
    trains on ``device_kind``. The python, numpy and torch CPU generators are always restored;
    the device generator and megatron-core's model-parallel tracker only when their states
    come from the same kind of device (``saved_kind``, else told by the states themselves):
    a CUDA generator state is not a CPU one and ``set_rng_state`` rejects it. Across kinds
    they keep their state from --seed (as with --no-load-rng), said in one warning."""
    from megatron.core.tensor_parallel import convert_cuda_rng_state, get_cuda_rng_tracker

    if isinstance(saved, dict):  # megatron-2bw's own layout before Megatron-LM's
        saved = [{"random_rng_state": saved["random"], "np_rng_state": saved["np"],
                  "torch_rng_state": saved["torch"],
                  "cuda_rng_state": saved.get("cuda", saved["torch"]),
                  "rng_tracker_states": saved["tracker"]}]
    state = saved[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    saved_kind = saved_kind or rng_device_of(state["cuda_rng_state"])
    if not restores_device_rng(saved_kind, device_kind):
        warn(f" warning: {where} holds device RNG states of a {saved_kind.upper()} run, this "
             f"run is on {device_kind.upper()}: the CPU generators (python, numpy, torch) are "
             f"restored; the {device_kind.upper()} generator and megatron-core's "
             "model-parallel RNG tracker keep their state from --seed, as with --no-load-rng")
        return
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_cuda_rng_tracker().set_states({name: convert_cuda_rng_state(value) for name, value
                                       in state["rng_tracker_states"].items()})


def rng_device_of(cuda_rng_state: torch.Tensor) -> str:
    """The device kind whose generator wrote a checkpoint's "cuda_rng_state" (for checkpoints
    without our "rng_device" key: Megatron-LM's, ours from before it): "cpu" when it has the
    size of the CPU generator's state (torch's Mersenne Twister, 5056 bytes; the CPU runtime
    saves it there), "cuda" otherwise (CUDA's Philox state: seed and offset, 16 bytes)."""
    cpu_state_bytes = torch.Generator().get_state().numel()
    return "cpu" if cuda_rng_state.numel() == cpu_state_bytes else "cuda"


def restores_device_rng(saved_kind: str, device_kind: str) -> bool:
    """Whether a checkpoint's device RNG states ("cuda_rng_state" and the tracker's), written
    on ``saved_kind``, are restored on a process training on ``device_kind``: only on the same
    kind (a CPU generator's state is no CUDA one, and the reverse)."""
    return saved_kind == device_kind


def _device_kind() -> str:
    """What this process trains on, "cuda" or "cpu" (the CPU runtime's "cuda" RNG state is
    the CPU generator's)."""
    from megatron_2bw.runtime.device import training_device

    return training_device().type


def _layout() -> dict:
    """This run's parallel layout, saved in every checkpoint's common state."""
    from megatron.core import parallel_state as ps

    return {"tensor": ps.get_tensor_model_parallel_world_size(),
            "pipeline": ps.get_pipeline_model_parallel_world_size(),
            "data": ps.get_data_parallel_world_size(),
            "expert": ps.get_expert_model_parallel_world_size()}


def _saved_layout(common: dict) -> dict | None:
    """The layout a checkpoint was written with: our "layout" key, or Megatron-LM's args (TP
    and PP 1 where they are missing, as Megatron-LM assumes); None when neither is there."""
    if "layout" in common:
        return common["layout"]
    saved_args = common.get("args")
    if saved_args is None:
        return None
    return {"tensor": getattr(saved_args, "tensor_model_parallel_size", 1),
            "pipeline": getattr(saved_args, "pipeline_model_parallel_size", 1),
            "data": getattr(saved_args, "data_parallel_size", None),
            "expert": getattr(saved_args, "expert_model_parallel_size", 1)}


def _describe(layout: dict) -> str:
    expert = layout.get("expert", 1)
    return (f"TP={layout['tensor']} PP={layout['pipeline']} DP={layout['data']}"
            + (f" EP={expert}" if expert > 1 else ""))


def _check_expert_optimizer(path: str, common: dict) -> None:
    """megatron-core gives expert parameters an optimizer of their own only at expert-parallel
    size > 1 (``allreduce`` False on their parameters), so between EP = 1 and EP > 1 the
    optimizer's chain and its parameter groups differ and its state does not map: refused,
    naming --no-load-optim (the weights reshard over any EP; between two EP > 1 the
    optimizer's state does too)."""
    saved = (_saved_layout(common) or {}).get("expert", 1)
    now = _layout()["expert"]
    if (saved > 1) != (now > 1):
        raise CheckpointRefused(
            f"--load: {path} was saved at expert-parallel size {saved}, this run is at {now}: "
            "megatron-core builds a separate expert optimizer only at expert-parallel size > 1, "
            "so the optimizer state does not map; pass --no-load-optim to load the weights "
            "alone")


def _content_metadata(args: argparse.Namespace) -> dict:
    """Megatron-LM's ``_build_sharded_state_dict_metadata`` for torch_dist, which selects how
    the model and optimizer shard their state. The distributed optimizer keeps its state in
    Megatron-LM's default 'dp_reshardable' form (Megatron-LM reads the form back from the
    checkpoint). megatron-core 0.16's 'fully_sharded_model_space' is deprecated and refuses to
    save (flattened_range)."""
    from megatron.core import parallel_state as ps

    metadata = {}
    if args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return metadata


# scheduler state key -> the flag that sets it (build.build_scheduler)
# (its steps count samples, as Megatron-LM's: build.scheduler_steps)
_SCHEDULER_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr",
                    "lr_warmup_steps": "--lr-warmup-iters/--lr-warmup-samples",
                    "lr_decay_steps": "--lr-decay-iters/--lr-decay-samples",
                    "lr_decay_style": "--lr-decay-style", "start_wd": "--weight-decay",
                    "end_wd": "--weight-decay", "wd_incr_steps": "--train-iters/--train-samples",
                    "wd_incr_style": "weight-decay increment style",
                    "wsd_decay_steps": "--lr-wsd-decay-iters/--lr-wsd-decay-samples",
                    "lr_wsd_decay_style": "--lr-wsd-decay-style"}


def _differs(saved, ours) -> bool:
    """Numbers compare to rounding (a --lr-warmup-fraction's steps went through samples)."""
    if isinstance(saved, (int, float)) and isinstance(ours, (int, float)):
        return not math.isclose(saved, ours, rel_tol=1e-9, abs_tol=1e-12)
    return saved != ours


def _check_scheduler(path: str, saved: dict, scheduler, args: argparse.Namespace) -> None:
    """Megatron-LM's default on resume (OptimizerParamScheduler._check_and_set): every
    schedule setting in the checkpoint equals the flags', unless one of the two flags says
    which side wins. Raises one CheckpointError listing all."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    ours = scheduler.state_dict()
    differing = [f"{flag} {ours[key]} (checkpoint: {saved[key]})"
                 for key, flag in _SCHEDULER_FLAGS.items()
                 if key in saved and _differs(saved[key], ours[key])]
    if differing:
        raise _ScheduleMismatch(
            f"--load: {path} holds another learning-rate schedule than the flags: "
            f"{', '.join(dict.fromkeys(differing))}; pass --override-opt_param-scheduler to "
            f"use the flags or --use-checkpoint-opt_param-scheduler to use the checkpoint's")


def _load_optimizer(optimizer, saved: dict, args: argparse.Namespace) -> None:
    """The optimizer's state; its parameter groups carry the learning-rate bounds the scheduler
    reads (``max_lr``, ``min_lr``), which --override-opt_param-scheduler keeps from the flags.
    (Megatron-LM at core_v0.16.1 loaded the checkpoint's there, so the override missed --lr,
    NVIDIA/Megatron-LM#1138; its later load_checkpoint re-applies the flags' bounds.)"""
    from megatron_2bw.training import adam_steps

    flag_bounds = [{k: g[k] for k in ("max_lr", "min_lr") if k in g}
                   for g in optimizer.param_groups]
    with torch.no_grad():  # the distributed optimizer copies its fp32 shards in place, and
        # with fp32 weights those are views of the weights (leaves that require grad)
        optimizer.load_state_dict(saved)
    adam_steps.restore(optimizer, saved)  # torch Adam's per-parameter step (megatron-core gap)
    if args.override_opt_param_scheduler:
        for group, bounds in zip(optimizer.param_groups, flag_bounds):
            group.update(bounds)


def _load_scheduler(scheduler, saved: dict, args: argparse.Namespace) -> None:
    """megatron-core's load with Megatron-LM's two flags."""
    scheduler.override_opt_param_scheduler = args.override_opt_param_scheduler
    scheduler.use_checkpoint_opt_param_scheduler = not args.override_opt_param_scheduler
    scheduler.load_state_dict(saved)


def _saved_args(args: argparse.Namespace, state: TrainState) -> argparse.Namespace:
    """The flags as Megatron-LM saves them, with the data position its loader reads there.
    Only values that ``torch.load(weights_only=True)`` reads back are kept (both programs
    load the common state that way: anything else would make the checkpoint unreadable)."""
    saved = argparse.Namespace(**{k: v for k, v in vars(args).items() if _plain(v)})
    saved.consumed_train_samples = state.consumed_train_samples
    saved.skipped_train_samples = 0
    saved.consumed_valid_samples = state.consumed_valid_samples
    return saved


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype))


def model_keys(model: list) -> list[str]:
    """The state-dict key of each model chunk, as Megatron-LM's ``generate_state_dict`` names
    them: "model" for one chunk, "model0", "model1", ... for the chunks of virtual pipeline
    stages. The sharded entries under them are keyed by global layer and parameter names, so a
    checkpoint loads into any number of chunks."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _model_state(model: list, metadata: dict) -> dict:
    """Each chunk's sharded state dict under its :func:`model_keys` key."""
    return {key: chunk.module.sharded_state_dict(metadata=metadata)
            for key, chunk in zip(model_keys(model), model)}


def _load_model(model: list, loaded: dict) -> None:
    for key, chunk in zip(model_keys(model), model):
        chunk.module.load_state_dict(loaded[key])


def _state_to_save(model, optimizer, scheduler, state: TrainState, args: argparse.Namespace,
                   metadata: dict, extra: Callable[[dict], None] | None) -> dict:
    """Megatron-LM's ``generate_state_dict`` (+ ``num_floating_point_operations_so_far``) and
    our "layout"; ``extra`` adds a schedule's own entries. The model entries (one per chunk:
    :func:`model_keys`) and the optimizer entries are
    keyed by global layer and parameter names (dist_checkpointing reshards them for any
    layout, as ``metadata`` (:func:`_content_metadata`) asks); the RNG state is one object per
    (PP rank, TP rank)."""
    sharded = {"args": _saved_args(args, state), "checkpoint_version": CHECKPOINT_VERSION,
               "iteration": state.iteration, **_model_state(model, metadata)}
    if not args.no_save_optim:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=False,
                                                            metadata=metadata)
        sharded["opt_param_scheduler"] = scheduler.state_dict()
    if not args.no_save_rng:
        sharded["rng_state"] = _rng_state()
        sharded["rng_device"] = _device_kind()
    sharded["num_floating_point_operations_so_far"] = state.num_floating_point_operations_so_far
    sharded["layout"] = _layout()
    if extra is not None:
        extra(sharded)
    return sharded


def save_checkpoint(root: str, model, optimizer, scheduler, state: TrainState,
                    args: argparse.Namespace, extra: Callable[[dict], None] | None = None,
                    keep: int | None = None) -> str:
    """Save on every rank (collective); return the checkpoint directory.

    ``args`` are the run's flags (saved as Megatron-LM saves them; --no-save-optim and
    --no-save-rng leave those parts out). ``extra(sharded_state_dict)`` may add entries (the
    2BW schedule adds its second weight version). With ``keep``, only the ``keep`` newest
    checkpoints remain, older ones deleted after the new one is complete and named by the
    tracker. A save that fails on any rank (a full disk, a state that cannot be gathered)
    fails on every rank with CheckpointError; the partial directory is removed and the previous
    checkpoints and the tracker are untouched. Every step a rank can fail alone (rank 0's
    directory, each rank's state dict, the write, rank 0's publishing) is followed by an
    agreement, so no rank is left waiting in a collective the failed one never enters. A save
    that raises otherwise (a peer lost in one of the agreements) leaves no partial directory."""
    from megatron_2bw.runtime.lifetime import bind_helpers_to_this_process

    bind_helpers_to_this_process()  # megatron-core's writer processes end with this rank

    final = checkpoint_dir(root, state.iteration)
    tmp = final + ".tmp"
    try:
        _save_agreed(root, final, tmp, model, optimizer, scheduler, state, args, extra)
    except BaseException:  # a lost peer (the agreements are collectives), a signal, ...
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing partial stays behind
        raise
    if dist.get_rank() == 0 and keep is not None:
        _delete_older(root, keep)
    dist.barrier()
    return final


def _save_agreed(root: str, final: str, tmp: str, model, optimizer, scheduler,
                 state: TrainState, args: argparse.Namespace,
                 extra: Callable[[dict], None] | None) -> None:
    """Write ``tmp`` on every rank and publish it as ``final``, each step agreed on."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    error = None
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        error = _attempt(lambda: os.makedirs(tmp, exist_ok=True))
    _fail_unless_all_wrote(error, root, final, tmp, state.iteration)
    metadata = _content_metadata(args)
    sharded: dict = {}
    error = _attempt(lambda: sharded.update(
        _state_to_save(model, optimizer, scheduler, state, args, metadata, extra)))
    _fail_unless_all_wrote(error, root, final, tmp, state.iteration)
    error = _attempt(lambda: dist_checkpointing.save(
        sharded, tmp, content_metadata=_clean_metadata_for_serialization(metadata)))
    _fail_unless_all_wrote(error, root, final, tmp, state.iteration)
    if dist.get_rank() == 0:
        error = _attempt(lambda: _publish(root, tmp, final, state.iteration))
    _fail_unless_all_wrote(error, root, final, tmp, state.iteration)


def _attempt(action: Callable[[], None]) -> BaseException | None:
    """Run ``action``; its exception, or None (torch's CheckpointException is a
    BaseException)."""
    try:
        action()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as caught:
        return caught
    return None


def _fail_unless_all_wrote(error: BaseException | None, root: str, final: str, tmp: str,
                           iteration: int) -> None:
    """Collective: CheckpointError on every rank when any rank's write failed, after rank 0
    removed the partial ``tmp``; the tracker still names the last complete checkpoint."""
    if _all_ranks_agree(error is None):
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    why = _reason(error) if error is not None else "it failed on another rank"
    try:
        previous = latest_iteration(root)
    except CheckpointError:
        previous = None
    kept = ("no earlier checkpoint exists" if previous is None else
            f"the last complete checkpoint, {_named(previous)}, is intact")
    raise CheckpointError(f"--save: could not write the checkpoint of iteration {iteration} "
                          f"to {final} ({why}); {kept}")


def _named(iteration: int | str) -> str:
    return "the release checkpoint" if iteration == RELEASE else f"iteration {iteration}"


def _publish(root: str, tmp: str, final: str, iteration: int) -> None:
    """Rank 0, after every rank wrote ``tmp``: rename it to ``final`` and point the tracker at
    it, atomically and last; an older copy of the same iteration is replaced only after."""
    aside = final + ".old"
    if os.path.isdir(final):  # the same iteration saved again: replace, never lose both
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)
    tracker_tmp = os.path.join(root, TRACKER_FILE + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
    os.replace(tracker_tmp, os.path.join(root, TRACKER_FILE))


def _delete_older(root: str, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (``--ckpt-keep``)."""
    for iteration in saved_iterations(root)[keep:]:
        shutil.rmtree(checkpoint_dir(root, iteration), ignore_errors=True)


def saved_iterations(root: str) -> list[int]:
    """Iterations with a complete checkpoint directory under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    found = [int(name[len("iter_"):]) for name in os.listdir(root)
             if name.startswith("iter_") and name[len("iter_"):].isdigit()
             and os.path.isdir(os.path.join(root, name))]
    return sorted(found, reverse=True)


def check_paths(args) -> None:
    """Up front, on every rank: --save is a writable directory, and a --load that holds no
    checkpoint must not let a fresh run overwrite the checkpoints of another run in --save (a
    mistyped --load would otherwise start from scratch and rewind that run's tracker). Raises
    FlagError."""
    from megatron_2bw.flag_types import FlagError, require_writable_dir

    if args.save is None:
        return
    require_writable_dir("--save", args.save)
    if args.overwrite_save:
        return
    if args.load is None or os.path.abspath(args.load) == os.path.abspath(args.save):
        return  # no --load: Megatron-LM's behaviour, --save is written to
    theirs = _candidates(args.save)
    if theirs and not _candidates(args.load):
        raise FlagError("--load", f"{args.load} holds no checkpoint, but --save {args.save} "
                        f"holds another run's (iteration {theirs[0]}): fix --load, or pass "
                        f"--overwrite-save to start from scratch there")


def _candidates(root: str) -> list[int | str]:
    """The tracker's iteration first, then older complete checkpoints, newest first (a
    release checkpoint alone). A tracker that names none is refused (latest_iteration)."""
    named = latest_iteration(root)
    if named == RELEASE:
        return [RELEASE]
    older = [i for i in saved_iterations(root) if named is None or i < named]
    return ([named] if named is not None else []) + older


@contextlib.contextmanager
def _quiet_checkpoint_loggers():
    """torch.distributed.checkpoint (through the root logger) and megatron-core log a failed
    read with its traceback before raising; the caller reports it in one line (or falls back),
    so they are silenced while a checkpoint loads."""
    names = ("", "torch.distributed.checkpoint", "megatron.core.dist_checkpointing")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _all_ranks_agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (an all-reduce on the default group, on the
    training device as its backend needs)."""
    from megatron_2bw.runtime.device import training_device

    flag = torch.tensor([0.0 if ok else 1.0], device=training_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not flag.item()


def load_checkpoint(root: str, model, optimizer, scheduler, args: argparse.Namespace,
                    extra: Callable[[dict, str], None] | None = None,
                    on_loaded: Callable[[dict], None] | None = None,
                    warn: Callable[[str], None] = print) -> TrainState | None:
    """Restore the newest readable checkpoint under ``root`` (ours or Megatron-LM's) into the
    given objects; None when there is none. ``args`` are the run's flags (--no-load-optim,
    --no-load-rng, the scheduler flags). ``extra(sharded, checkpoint_path)`` lets a schedule
    request its own entries, ``on_loaded(loaded)`` read them back. A checkpoint that fails to
    load on any rank is skipped on every rank, with a warning; when none loads, CheckpointError
    names the newest. A learning-rate schedule that disagrees with the flags is a
    CheckpointError at once (the flags are wrong, not the checkpoint)."""
    candidates = _candidates(root)
    if not candidates:
        return None
    failures = []
    for iteration in candidates:
        path = checkpoint_dir(root, iteration)
        try:
            with _quiet_checkpoint_loggers():  # a failure is reported once, by this loop
                state = _load_one(path, model, optimizer, scheduler, args, extra, on_loaded,
                                  warn)
            error = None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as caught:  # torch's CheckpointException is a BaseException
            state, error = None, caught
        if _all_ranks_agree(error is None):
            if failures:
                warn(f" warning: skipped unreadable checkpoint(s) {'; '.join(failures)}; "
                     f"loaded {path}")
            return state
        if not _all_ranks_agree(not isinstance(error, CheckpointRefused)):
            raise error if isinstance(error, CheckpointRefused) else CheckpointRefused(
                f"--load: {path} was refused on another rank")
        why = "unreadable on another rank" if error is None else _reason(error)
        failures.append(f"{path} ({why})")
    raise CheckpointError(f"--load: no readable checkpoint in {root}: {failures[0]}")


def _reason(error: BaseException) -> str:
    """One line for a failed load: torch's CheckpointException wraps each rank's error."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and not failures:  # torch's: the failing rank is elsewhere
        return "it failed on another rank"
    if isinstance(failures, dict):
        error = next(iter(failures.values()))
        if isinstance(error, tuple) and error:  # (exception, its traceback frames)
            error = error[0]
        error = getattr(error, "exc", error)  # a wrapped remote traceback
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1][:200]}" if text else type(error).__name__


def _load_one(path: str, model, optimizer, scheduler, args: argparse.Namespace, extra,
              on_loaded, warn: Callable[[str], None]) -> TrainState:
    """Load one checkpoint as Megatron-LM's ``load_checkpoint`` does: the optimizer and
    scheduler unless --no-load-optim or the checkpoint has none (then mixed-precision main
    weights are refreshed from the model), the RNG state unless --no-load-rng, the checkpoint
    has none, or TP or PP changed. A release checkpoint gives the weights alone, and training
    starts at iteration 0 (Megatron-LM's ``release``)."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is missing")
    release = os.path.basename(path) == RELEASE
    if release:
        extra = None  # a schedule's state belongs to an iteration
    common = dist_checkpointing.load_common_state_dict(path)
    load_optim = not release and not args.no_load_optim and "opt_param_scheduler" in common
    _check_vocabulary(path, common.get("args"), args, load_optim, warn)
    saved_scheduler = None
    if load_optim:
        _check_expert_optimizer(path, common)
        saved_scheduler = common["opt_param_scheduler"]  # in samples, ours and Megatron-LM's
        _check_scheduler(path, saved_scheduler, scheduler, args)
    load_rng = not release and not args.no_load_rng and _rng_keyed_alike(
        path, common, warn) and not getattr(common.get("args"), "no_save_rng", False)
    loaded = dist_checkpointing.load(
        _state_to_load(model, optimizer if load_optim else None, common, load_rng,
                       None if extra is None else lambda sd: extra(sd, path)), path)
    _load_model(model, loaded)
    if load_optim:
        _load_optimizer(optimizer, loaded["optimizer"], args)
        _load_scheduler(scheduler, saved_scheduler, args)
    else:
        optimizer.reload_model_params()
    if load_rng:
        _set_rng_state(loaded["rng_state"], _device_kind(), common.get("rng_device"), path, warn)
    if release:
        loaded["iteration"] = 0
    if on_loaded is not None:
        on_loaded(loaded)
    return TrainState() if release else _train_state(loaded)


def _check_vocabulary(path: str, saved: argparse.Namespace | None, args: argparse.Namespace,
                      load_optim: bool, warn: Callable[[str], None]) -> None:
    """A checkpoint whose embedding has another number of rows (saved ``padded_vocab_size``)
    loads as megatron-core loads it (its embedding and output layer allow a shape mismatch: the
    rows both have are read, the others start at zero), with a warning; the distributed
    optimizer's flat state cannot, so with it CheckpointRefused asks for --no-load-optim."""
    rows, ours = getattr(saved, "padded_vocab_size", None), getattr(args, "padded_vocab_size", None)
    if rows is None or ours is None or rows == ours:
        return
    why = (f"{path} has a vocabulary of {rows} rows, this run {ours} (padded to a multiple of "
           f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} x TP "
           f"{args.tensor_model_parallel_size})")
    same_padding = all(getattr(saved, name, None) == getattr(args, name) for name in (
        "make_vocab_size_divisible_by", "tensor_model_parallel_size", "tokenizer_type"))
    if same_padding and args.tokenizer_type.startswith("BertWordPiece"):
        why += (": a BertWordPiece checkpoint from before megatron-2bw added [BOS] and [EOS] to "
                "the vocabulary file's tokens, as Megatron-LM does")
    if load_optim and getattr(args, "use_distributed_optimizer", False):
        raise CheckpointRefused(f"--load: {why}; the distributed optimizer's state cannot be "
                                f"resized: pass --no-load-optim to load the weights alone")
    change = (f"rows {rows}..{ours - 1} at zero" if ours > rows
              else f"its rows {ours}..{rows - 1} left out")
    warn(f" warning: {why}; loaded with {change}")


def _rng_keyed_alike(path: str, common: dict, warn: Callable[[str], None]) -> bool:
    """Whether the checkpoint's RNG states fit this run (same TP and PP); warns when the
    layout changed."""
    saved, layout = _saved_layout(common), _layout()
    if saved is None:
        return True
    keyed_alike = all(saved[k] == layout[k] for k in ("tensor", "pipeline"))
    if {**saved, "expert": saved.get("expert", 1)} != layout:
        rng = ("RNG state kept" if keyed_alike else
               "RNG state re-seeded from --seed (it is kept per TP and PP rank)")
        warn(f" warning: {path} was saved with {_describe(saved)}, this run is "
             f"{_describe(layout)}: model and optimizer state resharded; {rng}")
    return keyed_alike


def _state_to_load(model, optimizer, common: dict, with_rng: bool,
                   extra: Callable[[dict], None] | None) -> dict:
    """The sharded entries to read, made with the content metadata the checkpoint was saved
    with (Megatron-LM's ``load_content_metadata``); its common entries come back as saved."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_2bw.training import adam_steps

    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    sharded = _model_state(model, metadata)
    if optimizer is not None:
        adam_steps.allocate(optimizer)  # an unstepped torch Adam has no state to load into
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=True,
                                                            metadata=metadata)
    if with_rng:
        sharded["rng_state"] = _rng_state()
    if extra is not None:
        extra(sharded)
    return sharded


def _train_state(loaded: dict) -> TrainState:
    """Where the checkpoint's run stood: Megatron-LM keeps the samples in its args; our
    checkpoints from before Megatron-LM's state kept them in "consumed_train_samples"."""
    saved_args = loaded.get("args")
    if saved_args is None:
        return TrainState(iteration=loaded["iteration"],
                          consumed_train_samples=loaded["consumed_train_samples"])
    return TrainState(
        iteration=loaded["iteration"],
        consumed_train_samples=getattr(saved_args, "consumed_train_samples", 0),
        consumed_valid_samples=getattr(saved_args, "consumed_valid_samples", 0),
        num_floating_point_operations_so_far=loaded.get(
            "num_floating_point_operations_so_far", 0))
